use super::config::*;
use super::power::*;
use super::state::*;
use super::*;
use clap::Parser;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

const TOKEN: &str = "root@pam!t=secret";

/// One request over an in-memory connection; the raw answer.
async fn exchange(dir: &Path, request: String) -> String {
    let cli = Cli::parse_from([
        "sim",
        "--state-dir",
        dir.to_str().unwrap(),
        "--auth-delay-ms",
        "0",
        "--token",
        TOKEN,
    ]);
    let pve = Arc::new(Pve::new(cli.args).unwrap());
    let (mut client, server) = tokio::io::duplex(1 << 20);
    tokio::spawn(serve_connection(pve, server));
    client.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    client.read_to_string(&mut out).await.unwrap();
    out
}

fn upload_request(extra_headers: &str, body: &str) -> String {
    format!(
        "POST /api2/json/nodes/pve/storage/local/upload HTTP/1.1\r\nHost: x\r\n\
         Authorization: PVEAPIToken={TOKEN}\r\nConnection: close\r\n\
         Content-Type: multipart/form-data; boundary=XyZ\r\n{extra_headers}\r\n{body}"
    )
}

#[tokio::test]
async fn a_chunked_upload_is_refused_as_pveproxy_does() {
    let dir = tempfile::tempdir().unwrap();
    let body =
        "--XyZ\r\nContent-Disposition: form-data; name=\"content\"\r\n\r\nimport\r\n--XyZ--\r\n";
    let req = upload_request(
        "Transfer-Encoding: chunked\r\n",
        &format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
    );
    let out = exchange(dir.path(), req).await;
    assert!(
        out.starts_with("HTTP/1.1 501 chunked transfer encoding not supported\r\n"),
        "{out}"
    );
}

#[tokio::test]
async fn an_upload_without_content_length_misses_its_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let out = exchange(dir.path(), upload_request("", "")).await;
    assert!(
        out.starts_with("HTTP/1.1 400 Parameter verification failed."),
        "{out}"
    );
    let body: Value = serde_json::from_str(out.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let missing = "property is missing and it is not optional";
    assert_eq!(body["errors"]["content"], missing);
    assert_eq!(body["errors"]["filename"], missing);
}

#[tokio::test]
async fn another_token_is_refused_without_echoing_it() {
    let dir = tempfile::tempdir().unwrap();
    let req = "GET /api2/json/version HTTP/1.1\r\nAuthorization: PVEAPIToken=root@pam!t=guess\r\n\
               Connection: close\r\n\r\n";
    let out = exchange(dir.path(), req.into()).await;
    assert!(
        out.starts_with("HTTP/1.1 401 authentication failure\r\n"),
        "{out}"
    );
    assert!(!out.contains("guess"));
}

#[test]
fn sizes_print_and_parse_as_pve_does() {
    assert_eq!(format_size(20 << 30), "20G");
    assert_eq!(format_size(32 << 20), "32M");
    assert_eq!(format_size(4453302272), "4247M");
    assert_eq!(format_size(1000), "1000");
    assert_eq!(parse_size("+1G"), Some((true, 1 << 30)));
    assert_eq!(parse_size("20G"), Some((false, 20 << 30)));
    assert_eq!(parse_size("G"), None);
}

#[test]
fn drives_print_with_sorted_options() {
    let (file, opts) = split_drive("local-lvm:0,ssd=1,import-from=local:import/a.raw,discard=on");
    assert_eq!(file, "local-lvm:0");
    let opts: Vec<_> = opts
        .into_iter()
        .filter(|(k, _)| k != "import-from")
        .collect();
    assert_eq!(
        print_drive("local-lvm:vm-301-disk-1", opts),
        "local-lvm:vm-301-disk-1,discard=on,ssd=1"
    );
    assert!(is_drive("scsi0") && is_drive("efidisk0") && !is_drive("scsihw") && !is_drive("net0"));
}

#[test]
fn volumes_belong_to_the_vm_their_name_gives() {
    assert_eq!(volume_owner("local-lvm:vm-301-disk-1"), Some(301));
    assert_eq!(volume_owner("local-lvm:base-9000-disk-0"), Some(9000));
    assert_eq!(volume_owner("local:import/lab-cp-01.raw"), None);
    assert_eq!(volume_owner("local-lvm:vm-301-"), None);
    assert_eq!(volume_owner("vm-301-disk-1"), None);
}

#[test]
fn a_nic_without_a_mac_gets_one() {
    assert_eq!(
        with_mac("virtio,bridge=vmbr0", 301),
        "virtio=BC:24:11:00:01:2D,bridge=vmbr0"
    );
    assert_eq!(
        with_mac("virtio=BC:24:11:00:00:11,bridge=vmbr0", 301),
        "virtio=BC:24:11:00:00:11,bridge=vmbr0"
    );
}

#[test]
fn the_boot_disk_follows_the_boot_order() {
    let config = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let c = config(&[
        ("boot", "order=ide2;virtio1;net0"),
        ("ide2", "local:iso/x.iso,media=cdrom"),
        ("scsi0", "local-lvm:vm-1-disk-0,size=1G"),
        ("virtio1", "local-lvm:vm-1-disk-1,size=1G"),
    ]);
    assert_eq!(
        boot_drives(&c),
        [
            ("local:iso/x.iso".to_owned(), true),
            ("local-lvm:vm-1-disk-1".to_owned(), false)
        ]
    );
    let c = config(&[
        ("boot", "order=scsi0;ide2"),
        ("ide2", "none,media=cdrom"),
        ("scsi0", "local-lvm:vm-1-disk-1,size=1G"),
    ]);
    assert_eq!(
        boot_drives(&c),
        [("local-lvm:vm-1-disk-1".to_owned(), false)]
    );
    let c = config(&[("virtio0", "local-lvm:vm-1-disk-2,size=1G")]);
    assert_eq!(
        boot_drives(&c),
        [("local-lvm:vm-1-disk-2".to_owned(), false)]
    );
    assert!(boot_drives(&config(&[])).is_empty());
}

#[test]
fn a_blank_disk_is_skipped_and_one_with_a_boot_sector_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.raw");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(4 << 20).unwrap();
    assert!(is_blank(&p));
    let mut b = vec![0u8; 512];
    b[510] = 0x55;
    b[511] = 0xaa;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, 0).unwrap();
    assert!(!is_blank(&p));
}

#[test]
fn installer_meta_is_read_plain_and_gzipped() {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    // Talos' own vector (pkg/machinery/meta): 0xa=foo.
    assert_eq!(
        installer_meta_key("MHhhPWZvbw==", 10).unwrap().as_deref(),
        Some("foo")
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, b"0xc=x;0xa=bar").unwrap();
    let v = b64(&gz.finish().unwrap());
    assert_eq!(installer_meta_key(&v, 10).unwrap().as_deref(), Some("bar"));
    assert_eq!(installer_meta_key(&v, 11).unwrap(), None);
    assert!(installer_meta_key("%%", 10).is_err());
}

#[test]
fn key_10_gives_its_first_loopback_address_and_hostname() {
    let yaml = b"addresses:\n  - address: 10.0.0.11/16\n    linkName: eth0\n  - address: 127.0.0.11/8\n    linkName: lo\nhostnames:\n  - hostname: cp-01\n    layer: platform\n";
    assert_eq!(
        key10_target(yaml).unwrap(),
        ("127.0.0.11".to_owned(), Some("cp-01".to_owned()))
    );
    let json = br#"{"addresses": [{"address": "127.0.0.12/8"}]}"#;
    assert_eq!(key10_target(json).unwrap(), ("127.0.0.12".to_owned(), None));
    let outside = b"addresses:\n  - address: 10.0.0.11/16\n";
    assert_eq!(
        key10_target(outside).unwrap_err(),
        "META key 10 has no address in 127.0.0.0/8"
    );
    assert!(key10_target(b"addresses: [").is_err());
}
