use super::iso::*;
use super::state::*;
use super::uki::*;

#[test]
fn the_id_is_the_sha256_of_the_bytes_received() {
    // The public ID of the empty schematic (image-factory's vanilla Talos).
    assert_eq!(
        schematic_id(b"customization: {}\n"),
        "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"
    );
    // No canonicalisation: other bytes, another ID.
    assert_ne!(
        schematic_id(b"customization: {}"),
        schematic_id(b"customization: {}\n")
    );
}

#[test]
fn isos_are_dual_boot_from_v1_10_unless_grub_is_asked_for_from_v1_12() {
    let grub =
        serde_yaml_ng::from_str::<SchematicShape>("customization: {bootloader: grub}").unwrap();
    let default = SchematicShape::default();
    assert!(!dual_boot_iso("v1.9.5", &default));
    assert!(dual_boot_iso("v1.10.0", &default));
    assert!(
        dual_boot_iso("v1.11.2", &grub),
        "grub is not honoured before v1.12"
    );
    assert!(dual_boot_iso("v1.12.0", &default));
    assert!(!dual_boot_iso("v1.12.0", &grub));
}

#[test]
fn a_pe_image_ends_past_its_last_section() {
    let mut pe = vec![0u8; 0x200];
    pe[0x3c] = 0x40;
    pe[0x40..0x44].copy_from_slice(b"PE\0\0");
    pe[0x46] = 2; // two sections
    pe[0x54] = 0xf0; // optional header size
    pe[0x58..0x5a].copy_from_slice(&0x20bu16.to_le_bytes());
    pe[0x58 + 24..0x58 + 32].copy_from_slice(&0x1000_0000u64.to_le_bytes());
    let table = 0x58 + 0xf0;
    for (i, (size, addr)) in [(0x500u32, 0x9000u32), (0x100, 0x4000)].iter().enumerate() {
        let s = table + 40 * i;
        pe[s + 8..s + 12].copy_from_slice(&size.to_le_bytes());
        pe[s + 12..s + 16].copy_from_slice(&addr.to_le_bytes());
    }
    assert_eq!(pe_end(&pe).unwrap(), 0x1000_9500);
    pe[0x58] = 0x0b;
    pe[0x59] = 0x01;
    assert!(pe_end(&pe).unwrap_err().to_string().contains("PE32+"));
    assert!(pe_end(&pe[..0x60]).is_err());
}

#[test]
fn unknown_fields_and_bad_yaml_are_refused() {
    let parse = |s: &str| serde_yaml_ng::from_str::<Option<SchematicShape>>(s);
    assert!(parse("customization:\n  extraKernelArgs: [a]\n").is_ok());
    assert!(parse("customization:\n  colour: red\n").is_err());
    assert!(parse("overlay: {image: x, foo: 1}\n").is_err());
    assert!(parse("customization: [\n").is_err());
    let meta = parse("customization:\n  meta:\n    - key: 0xa\n      value: x\n")
        .unwrap()
        .unwrap();
    assert_eq!(meta.customization.meta[0].key, 10);
}
