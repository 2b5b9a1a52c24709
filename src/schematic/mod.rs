//! Image Factory schematics: the data model, Go-compatible parsing, the
//! canonical bytes and the ID (their SHA-256), computed locally so that an ID
//! can be reviewed and reproduced without the factory.

mod emit;
pub mod installer;
pub mod node;
mod resolve;
pub mod review;

pub use emit::EmitError;

use emit::{Node, emit_document, go_float};
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use std::fmt;

/// A schematic ID: lowercase hex SHA-256 of the canonical YAML.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct SchematicId(String);

impl SchematicId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SchematicId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The requested image customisation, field for field as the factory has it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schematic {
    #[serde(default, deserialize_with = "go_string")]
    pub owner: String,
    #[serde(default)]
    pub overlay: Overlay,
    #[serde(default)]
    pub customization: Customization,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overlay {
    #[serde(default, deserialize_with = "go_string")]
    pub image: String,
    #[serde(default, deserialize_with = "go_string")]
    pub name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub options: serde_yaml_ng::Mapping,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Customization {
    #[serde(default, deserialize_with = "go_string")]
    pub embedded_machine_configuration: String,
    #[serde(default, deserialize_with = "go_strings")]
    pub extra_kernel_args: Vec<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub meta: Vec<MetaValue>,
    #[serde(default)]
    pub system_extensions: SystemExtensions,
    #[serde(default)]
    pub bootloader: Bootloader,
    #[serde(default, rename = "secureboot")]
    pub secure_boot: SecureBoot,
    #[serde(default)]
    pub disk_image: DiskImage,
}

/// One initial META entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaValue {
    pub key: u8,
    #[serde(default, deserialize_with = "go_string")]
    pub value: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SystemExtensions {
    #[serde(default, deserialize_with = "go_strings")]
    pub official_extensions: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SecureBoot {
    #[serde(default, deserialize_with = "go_string")]
    pub enroll_keys: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub include_well_known_certificates: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DiskImage {
    #[serde(default, deserialize_with = "null_as_default")]
    pub sector_size: u64,
}

/// The image's bootloader; `none` (the zero value) is never written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Bootloader {
    #[default]
    None,
    DualBoot,
    SdBoot,
    Grub,
}

impl serde::Serialize for Bootloader {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl Bootloader {
    /// The zero value, which schematics omit.
    pub fn is_none(&self) -> bool {
        *self == Bootloader::None
    }

    fn name(self) -> &'static str {
        match self {
            Bootloader::None => "none",
            Bootloader::DualBoot => "dual-boot",
            Bootloader::SdBoot => "sd-boot",
            Bootloader::Grub => "grub",
        }
    }
}

impl<'de> Deserialize<'de> for Bootloader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = go_string(d)?;
        match s.to_ascii_lowercase().as_str() {
            "" | "none" => Ok(Bootloader::None),
            "dual-boot" => Ok(Bootloader::DualBoot),
            "sd-boot" => Ok(Bootloader::SdBoot),
            "grub" => Ok(Bootloader::Grub),
            _ => Err(serde::de::Error::custom(format!(
                "bootloader {s:?} is not one of none, dual-boot, sd-boot, grub"
            ))),
        }
    }
}

/// Go decodes any scalar into a string field as its text, and null as "".
fn go_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<GoScalar>::deserialize(d)?.map_or_else(String::new, |s| s.0))
}

fn go_strings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let items = Option::<Vec<Option<GoScalar>>>::deserialize(d)?.unwrap_or_default();
    Ok(items
        .into_iter()
        .map(|s| s.map_or_else(String::new, |s| s.0))
        .collect())
}

/// Go leaves a field at its zero value when the YAML says null.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

struct GoScalar(String);

impl<'de> Deserialize<'de> for GoScalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = GoScalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, v: &str) -> Result<GoScalar, E> {
                Ok(GoScalar(v.to_owned()))
            }
            fn visit_bool<E>(self, v: bool) -> Result<GoScalar, E> {
                Ok(GoScalar(v.to_string()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<GoScalar, E> {
                Ok(GoScalar(v.to_string()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<GoScalar, E> {
                Ok(GoScalar(v.to_string()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<GoScalar, E> {
                Ok(GoScalar(go_float(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Why a schematic could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("schematic is empty")]
    Empty,
    #[error("invalid schematic: {0}")]
    Yaml(String),
    #[error(transparent)]
    Emit(#[from] EmitError),
}

impl Schematic {
    /// Parses schematic YAML (or JSON), refusing unknown fields as the factory does.
    pub fn parse(text: &str) -> Result<Schematic, ParseError> {
        if text.trim().is_empty() || text.lines().all(|l| l.trim_start().starts_with('#')) {
            return Err(ParseError::Empty);
        }
        serde_yaml_ng::from_str(text).map_err(|e| ParseError::Yaml(e.to_string()))
    }

    /// The canonical bytes the factory hashes.
    pub fn canonical(&self) -> Result<String, EmitError> {
        emit_document(&self.to_node())
    }

    /// SHA-256 of [`Schematic::canonical`].
    pub fn id(&self) -> Result<SchematicId, EmitError> {
        Ok(id_of(&self.canonical()?))
    }

    /// Go's struct marshalling: declared field order, `omitempty` everywhere
    /// but `customization`.
    fn to_node(&self) -> Vec<(String, Node)> {
        let mut top = Fields::default();
        top.string("owner", &self.owner);
        let o = &self.overlay;
        if !(o.image.is_empty() && o.name.is_empty() && o.options.is_empty()) {
            let mut ov = Fields::default();
            ov.always("image", Node::Str(o.image.clone()));
            ov.always("name", Node::Str(o.name.clone()));
            if !o.options.is_empty() {
                ov.always("options", mapping_node(&o.options));
            }
            top.always("overlay", Node::Map(ov.0));
        }
        let c = &self.customization;
        let mut cu = Fields::default();
        cu.string(
            "embeddedMachineConfiguration",
            &c.embedded_machine_configuration,
        );
        cu.strings("extraKernelArgs", &c.extra_kernel_args);
        if !c.meta.is_empty() {
            let items = c
                .meta
                .iter()
                .map(|m| {
                    Node::Map(vec![
                        ("key".into(), Node::Raw(m.key.to_string())),
                        ("value".into(), Node::Str(m.value.clone())),
                    ])
                })
                .collect();
            cu.always("meta", Node::Seq(items));
        }
        let mut ext = Fields::default();
        ext.strings(
            "officialExtensions",
            &c.system_extensions.official_extensions,
        );
        cu.nested("systemExtensions", ext);
        if c.bootloader != Bootloader::None {
            cu.always("bootloader", Node::Str(c.bootloader.name().into()));
        }
        let mut sb = Fields::default();
        sb.string("enrollKeys", &c.secure_boot.enroll_keys);
        if c.secure_boot.include_well_known_certificates {
            sb.always("includeWellKnownCertificates", Node::Raw("true".into()));
        }
        cu.nested("secureboot", sb);
        let mut di = Fields::default();
        if c.disk_image.sector_size != 0 {
            di.always(
                "sectorSize",
                Node::Raw(c.disk_image.sector_size.to_string()),
            );
        }
        cu.nested("diskImage", di);
        top.always("customization", Node::Map(cu.0));
        top.0
    }
}

/// The ID of canonical schematic bytes.
pub fn id_of(canonical: &str) -> SchematicId {
    SchematicId(hex::encode(Sha256::digest(canonical.as_bytes())))
}

/// Builds a struct's fields in order, dropping the empty ones (`omitempty`).
#[derive(Default)]
struct Fields(Vec<(String, Node)>);

impl Fields {
    fn always(&mut self, key: &str, node: Node) {
        self.0.push((key.into(), node));
    }
    fn string(&mut self, key: &str, v: &str) {
        if !v.is_empty() {
            self.always(key, Node::Str(v.into()));
        }
    }
    fn strings(&mut self, key: &str, v: &[String]) {
        if !v.is_empty() {
            self.always(key, Node::Seq(v.iter().cloned().map(Node::Str).collect()));
        }
    }
    fn nested(&mut self, key: &str, inner: Fields) {
        if !inner.0.is_empty() {
            self.always(key, Node::Map(inner.0));
        }
    }
}

/// A `map[string]any` as Go writes it: keys in Go's natural sort order.
fn mapping_node(m: &serde_yaml_ng::Mapping) -> Node {
    let mut entries: Vec<(String, Node)> = m
        .iter()
        .map(|(k, v)| (scalar_text(k), value_node(v)))
        .collect();
    entries.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    Node::Map(entries)
}

fn value_node(v: &serde_yaml_ng::Value) -> Node {
    use serde_yaml_ng::Value;
    match v {
        Value::Null => Node::Raw("null".into()),
        Value::Bool(b) => Node::Raw(b.to_string()),
        Value::Number(n) => Node::Raw(match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) => go_float(f),
            _ => n.to_string(),
        }),
        Value::String(s) => Node::Str(s.clone()),
        Value::Sequence(items) => Node::Seq(items.iter().map(value_node).collect()),
        Value::Mapping(m) => mapping_node(m),
        Value::Tagged(t) => value_node(&t.value),
    }
}

fn scalar_text(v: &serde_yaml_ng::Value) -> String {
    match value_node(v) {
        Node::Str(s) | Node::Raw(s) => s,
        _ => serde_yaml_ng::to_string(v).unwrap_or_default(),
    }
}

/// The key order of Go's YAML library: runs of digits compare by value,
/// letters sort before other characters after a letter and after them
/// after a digit, otherwise by code point.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (ar, br): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut digits = false;
    for i in 0..ar.len().min(br.len()) {
        if ar[i] == br[i] {
            digits = ar[i].is_ascii_digit();
            continue;
        }
        let (al, bl) = (ar[i].is_alphabetic(), br[i].is_alphabetic());
        if al && bl {
            return ar[i].cmp(&br[i]);
        }
        if al || bl {
            let a_first = if digits { al } else { bl };
            return if a_first {
                Ordering::Less
            } else {
                Ordering::Greater
            };
        }
        let mut an: i64 = 0;
        let mut bn: i64 = 0;
        if ar[i] == '0' || br[i] == '0' {
            let mut j = i;
            while j > 0 && ar[j - 1].is_ascii_digit() {
                j -= 1;
                if ar[j] != '0' {
                    an = 1;
                    bn = 1;
                    break;
                }
            }
        }
        let mut ai = i;
        while ai < ar.len() && ar[ai].is_ascii_digit() {
            an = an
                .wrapping_mul(10)
                .wrapping_add(i64::from(ar[ai] as u8 - b'0'));
            ai += 1;
        }
        let mut bi = i;
        while bi < br.len() && br[bi].is_ascii_digit() {
            bn = bn
                .wrapping_mul(10)
                .wrapping_add(i64::from(br[bi] as u8 - b'0'));
            bi += 1;
        }
        if an != bn {
            return an.cmp(&bn);
        }
        if ai != bi {
            return ai.cmp(&bi);
        }
        return ar[i].cmp(&br[i]);
    }
    ar.len().cmp(&br.len())
}

#[cfg(test)]
mod tests;
