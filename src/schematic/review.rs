//! Schematic files kept in Git for review (`schematic --all --write`): the
//! canonical bytes under two comment lines naming the ID and the installer,
//! so `schematic id` on the file gives the same ID.

use super::{EmitError, Schematic, SchematicId, id_of, node};
use crate::inventory::{Inventory, NodeSpec};
use std::path::{Path, PathBuf};

/// One node's (or `base`'s) schematic as a reviewable file.
#[derive(Debug, Clone)]
pub struct ReviewFile {
    pub name: String,
    pub id: SchematicId,
    /// The installer image reference for this schematic.
    pub installer: String,
    pub canonical: String,
}

/// A schematic that has no canonical form (see [`EmitError`]), named by
/// whose it is.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("schematic of {name}")]
    Own {
        name: String,
        #[source]
        source: EmitError,
    },
    #[error("installer schematic of {name}")]
    Installer {
        name: String,
        #[source]
        source: EmitError,
    },
}

impl ReviewFile {
    /// `node`'s file: its image's schematic, and the installer its machine
    /// config names ([`super::installer::installer_for`]).
    pub fn for_node(inv: &Inventory, node: &NodeSpec) -> Result<ReviewFile, ReviewError> {
        let canonical = canonical(&node.name, &node::for_node(inv, node))?;
        let installer = super::installer::installer_for(inv, node).map_err(|source| {
            ReviewError::Installer {
                name: node.name.clone(),
                source,
            }
        })?;
        Ok(ReviewFile {
            name: node.name.clone(),
            id: id_of(&canonical),
            installer,
            canonical,
        })
    }

    /// The file of the cluster's base schematic, named `base`: it has no
    /// META, so its installer is its own.
    pub fn base(inv: &Inventory) -> Result<ReviewFile, ReviewError> {
        let canonical = canonical("base", &node::base(inv))?;
        let id = id_of(&canonical);
        Ok(ReviewFile {
            name: "base".into(),
            installer: super::installer::installer_of(inv, &id),
            id,
            canonical,
        })
    }

    /// The file's text: ID and installer in leading comments, then the
    /// canonical bytes.
    pub fn text(&self) -> String {
        format!(
            "# imgbuild schematic for {}\n# id: {}\n# installer: {}\n{}",
            self.name, self.id, self.installer, self.canonical
        )
    }

    /// Every node's file, in inventory order, then `base`'s.
    pub fn all(inv: &Inventory) -> Result<Vec<ReviewFile>, ReviewError> {
        let nodes = inv.nodes.iter().map(|n| ReviewFile::for_node(inv, n));
        nodes
            .chain(std::iter::once_with(|| ReviewFile::base(inv)))
            .collect()
    }
}

/// `name`'s schematic in canonical form.
fn canonical(name: &str, schematic: &Schematic) -> Result<String, ReviewError> {
    schematic.canonical().map_err(|source| ReviewError::Own {
        name: name.to_owned(),
        source,
    })
}

/// A review file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Writes each file as `<dir>/<name>.yaml` (atomically, only when its text
/// changed); returns each path and whether it changed.
pub fn write_review_files(
    files: &[ReviewFile],
    dir: &Path,
) -> Result<Vec<(PathBuf, bool)>, WriteError> {
    std::fs::create_dir_all(dir).map_err(|source| WriteError {
        path: dir.to_owned(),
        source,
    })?;
    files
        .iter()
        .map(|f| {
            let path = dir.join(format!("{}.yaml", f.name));
            crate::atomic::write_if_changed(&path, f.text().as_bytes(), false)
                .map(|changed| (path.clone(), changed))
                .map_err(|source| WriteError { path, source })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_written_once_and_read_back_to_the_same_id() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = "customization: {}\n".to_owned();
        let f = ReviewFile {
            name: "base".into(),
            id: super::super::id_of(&canonical),
            installer: "factory.example/metal-installer/x:v1.11.2".into(),
            canonical,
        };
        let first = write_review_files(std::slice::from_ref(&f), dir.path()).unwrap();
        assert_eq!(first, vec![(dir.path().join("base.yaml"), true)]);
        let again = write_review_files(std::slice::from_ref(&f), dir.path()).unwrap();
        assert!(!again[0].1, "unchanged text is not rewritten");
        let text = std::fs::read_to_string(dir.path().join("base.yaml")).unwrap();
        let parsed = super::super::Schematic::parse(&text).unwrap();
        assert_eq!(parsed.id().unwrap(), f.id);
        let blocked = dir.path().join("base.yaml/sub");
        let err = write_review_files(&[f], &blocked).unwrap_err();
        assert!(err.to_string().contains("base.yaml/sub"), "{err}");
    }

    fn atlas() -> Inventory {
        let text = include_str!("../../examples/atlas/cluster.yaml");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
        Inventory::parse(text, &path).unwrap()
    }

    #[test]
    fn every_node_gets_its_own_file_and_installs_from_its_meta_less_schematic() {
        let inv = atlas();
        let files = ReviewFile::all(&inv).unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        let mut wanted: Vec<&str> = inv.nodes.iter().map(|n| n.name.as_str()).collect();
        wanted.push("base");
        assert_eq!(names, wanted);
        for (f, node) in files.iter().zip(&inv.nodes) {
            // Metal: the node's image carries key 10, its installer does not.
            assert!(f.canonical.contains("meta:"), "{}", f.canonical);
            let meta_less = node::base_for_node(&inv, node).id().unwrap();
            assert_ne!(f.id, meta_less, "{}", f.name);
            assert!(
                f.installer
                    .ends_with(&format!("/{meta_less}:{}", inv.cluster.talos_version)),
                "{}",
                f.installer
            );
            let parsed = Schematic::parse(&f.text()).unwrap();
            assert_eq!(parsed.id().unwrap(), f.id, "{}", f.name);
        }
        let base = files.last().unwrap();
        assert_eq!(base.id, node::base(&inv).id().unwrap());
        assert!(
            base.installer.contains(&base.id.to_string()),
            "{}",
            base.installer
        );
    }

    #[test]
    fn a_schematic_without_canonical_form_names_its_node() {
        // U+2028 cannot be hashed reliably (EmitError::LineSeparator); the
        // inventory refuses it, so it is put in after parsing.
        let mut inv = atlas();
        let worker = inv
            .nodes
            .iter_mut()
            .find(|n| n.name == "worker-01")
            .unwrap();
        worker.extensions.push("siderolabs/a\u{2028}b".into());
        let err = ReviewFile::all(&inv).unwrap_err();
        assert!(
            matches!(err, ReviewError::Own { ref name, .. } if name == "worker-01"),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "schematic of worker-01");
        assert!(ReviewFile::for_node(&inv, inv.node("cp-01").unwrap()).is_ok());
    }
}
