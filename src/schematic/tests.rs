use super::*;
use proptest::prelude::*;
use std::path::PathBuf;

fn vectors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/schematics")
}

#[test]
fn every_published_vector_reproduces_its_id() {
    let ids = std::fs::read_to_string(vectors().join("ids.txt")).unwrap();
    let mut checked = 0;
    for line in ids
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (file, want) = line.split_once(' ').unwrap();
        let text = std::fs::read_to_string(vectors().join(file)).unwrap();
        let got = Schematic::parse(&text).unwrap().id().unwrap();
        assert_eq!(got.as_str(), want, "{file}");
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} vectors read");
}

#[test]
fn multiline_meta_canonical_bytes_match_exactly() {
    let input = std::fs::read_to_string(vectors().join("meta-multiline.yaml")).unwrap();
    let want = std::fs::read_to_string(vectors().join("meta-multiline.canonical")).unwrap();
    assert_eq!(Schematic::parse(&input).unwrap().canonical().unwrap(), want);
}

#[test]
fn empty_lists_give_the_same_id_as_absent_ones() {
    let a = Schematic::parse("customization:\n  extraKernelArgs: []\n").unwrap();
    let b = Schematic::parse("customization: {}\n").unwrap();
    assert_eq!(a.id().unwrap(), b.id().unwrap());
}

#[test]
fn extension_order_changes_the_id() {
    let a = Schematic::parse("customization: {systemExtensions: {officialExtensions: [a/b, c/d]}}")
        .unwrap();
    let b = Schematic::parse("customization: {systemExtensions: {officialExtensions: [c/d, a/b]}}")
        .unwrap();
    assert_ne!(a.id().unwrap(), b.id().unwrap());
}

#[test]
fn unknown_fields_are_errors() {
    let err = Schematic::parse("customization:\n  extraKernelArg: [x]\n").unwrap_err();
    assert!(err.to_string().contains("extraKernelArg"), "{err}");
    assert!(Schematic::parse("custom: {}\n").is_err());
}

#[test]
fn empty_input_is_an_error() {
    assert!(matches!(Schematic::parse(""), Err(ParseError::Empty)));
    assert!(matches!(
        Schematic::parse("# only\n"),
        Err(ParseError::Empty)
    ));
}

#[test]
fn bootloader_is_case_insensitive_and_none_is_omitted() {
    let s = Schematic::parse("customization: {bootloader: SD-Boot}").unwrap();
    assert_eq!(
        s.canonical().unwrap(),
        "customization:\n    bootloader: sd-boot\n"
    );
    let none = Schematic::parse("customization: {bootloader: None}").unwrap();
    assert_eq!(none.canonical().unwrap(), "customization: {}\n");
    assert!(Schematic::parse("customization: {bootloader: lilo}").is_err());
}

#[test]
fn hex_meta_keys_are_written_in_decimal() {
    let s =
        Schematic::parse("customization:\n  meta:\n    - key: 0xa\n      value: foo\n").unwrap();
    assert!(s.canonical().unwrap().contains("- key: 10\n"));
    assert!(Schematic::parse("customization: {meta: [{key: 256, value: x}]}").is_err());
}

#[test]
fn scalars_decode_into_strings_as_go_does() {
    let s = Schematic::parse("customization: {extraKernelArgs: [123, true, ~]}").unwrap();
    assert_eq!(s.customization.extra_kernel_args, vec!["123", "true", ""]);
}

#[test]
fn overlay_fields_and_sorted_options() {
    let s =
        Schematic::parse("overlay: {name: rpi, options: {b10: 1, b9: x, a: [1.5, null], c: {}}}\n")
            .unwrap();
    assert_eq!(
        s.canonical().unwrap(),
        "overlay:\n    image: \"\"\n    name: rpi\n    options:\n        a:\n            - 1.5\n            - null\n        b9: x\n        b10: 1\n        c: {}\ncustomization: {}\n"
    );
}

#[test]
fn go_natural_key_order() {
    let mut keys = vec!["b10", "a", "b9", "B", "a1", "a01", "ab", "_x"];
    keys.sort_by(|a, b| natural_cmp(a, b));
    assert_eq!(keys, vec!["_x", "B", "a", "a1", "a01", "ab", "b9", "b10"]);
}

/// A schematic whose canonical form reads back as itself. Left out are
/// multi-line values that start with a space or break, or have a line that
/// starts with a tab: Go writes those as literal blocks no YAML reader
/// accepts (its own included), and we copy Go byte for byte.
fn arb_text() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "a", "Z", "0", "1", " ", ":", "#", "-", "'", "\"", "\\", "\t", "\n", "{", "[", "@", "!",
        "%", "&", "*", "?", ",", "é", "~", ".", "true", "null", "0x", "e5", "yes", "=", "/",
    ]);
    prop::collection::vec(piece, 0..12)
        .prop_map(|p| p.concat())
        .prop_filter("literal block Go cannot read back", |s| {
            !(s.contains('\n')
                && (s.starts_with([' ', '\n']) || s.split('\n').any(|l| l.starts_with('\t'))))
        })
}

prop_compose! {
    fn arb_schematic()(
        args in prop::collection::vec(arb_text(), 0..4),
        exts in prop::collection::vec(arb_text(), 0..4),
        meta in prop::collection::vec((any::<u8>(), arb_text()), 0..3),
        emc in arb_text(),
        boot in 0..4u8,
        wk in any::<bool>(),
        enroll in arb_text(),
        sector in prop::sample::select(vec![0u64, 512, 4096]),
        image in arb_text(),
        name in arb_text(),
    ) -> Schematic {
        Schematic {
            owner: String::new(),
            overlay: Overlay { image, name, options: Default::default() },
            customization: Customization {
                embedded_machine_configuration: emc,
                extra_kernel_args: args,
                meta: meta.into_iter().map(|(key, value)| MetaValue { key, value }).collect(),
                system_extensions: SystemExtensions { official_extensions: exts },
                bootloader: [Bootloader::None, Bootloader::DualBoot, Bootloader::SdBoot, Bootloader::Grub][boot as usize],
                secure_boot: SecureBoot { enroll_keys: enroll, include_well_known_certificates: wk },
                disk_image: DiskImage { sector_size: sector },
            },
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn canonical_output_parses_back_to_the_same_schematic(s in arb_schematic()) {
        let text = s.canonical().unwrap();
        let back: Schematic = serde_yaml_ng::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(&back, &s, "canonical:\n{}", text);
        prop_assert_eq!(back.id().unwrap(), s.id().unwrap());
    }
}
