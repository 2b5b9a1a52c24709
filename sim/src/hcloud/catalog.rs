//! The fixed catalogue the double offers: locations, server types (with
//! their deprecations) and system images, as docs.hetzner.cloud lists them.

/// A location: name, city, country, network zone.
pub(crate) const LOCATIONS: [(&str, &str, &str, &str); 6] = [
    ("fsn1", "Falkenstein", "DE", "eu-central"),
    ("nbg1", "Nuremberg", "DE", "eu-central"),
    ("hel1", "Helsinki", "FI", "eu-central"),
    ("ash", "Ashburn, VA", "US", "us-east"),
    ("hil", "Hillsboro, OR", "US", "us-west"),
    ("sin", "Singapore", "SG", "ap-southeast"),
];

/// A server type as the simulator offers it.
pub(crate) struct ServerType {
    pub(crate) id: u64,
    pub(crate) name: &'static str,
    pub(crate) cores: u32,
    pub(crate) memory: f64,
    pub(crate) disk: u64,
    pub(crate) arch: &'static str,
    /// Locations where it can be ordered.
    pub(crate) offered: &'static [&'static str],
    /// Removed: (announced, unavailable_after).
    pub(crate) deprecation: Option<(&'static str, &'static str)>,
}

pub(crate) const EU: &[&str] = &["fsn1", "nbg1", "hel1"];
pub(crate) const ALL: &[&str] = &["fsn1", "nbg1", "hel1", "ash", "hil", "sin"];

/// In the API's order (by id there; here so that equal disks tie in a
/// known order: cx23 before cpx12).
pub(crate) const SERVER_TYPES: [ServerType; 7] = [
    ServerType {
        id: 22,
        name: "cx22",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "x86",
        offered: &[],
        deprecation: Some(("2025-10-16T06:00:00+00:00", "2026-01-01T00:00:00+00:00")),
    },
    ServerType {
        id: 108,
        name: "cx23",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "x86",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 109,
        name: "cx33",
        cores: 4,
        memory: 8.0,
        disk: 80,
        arch: "x86",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 112,
        name: "cpx22",
        cores: 2,
        memory: 4.0,
        disk: 80,
        arch: "x86",
        offered: ALL,
        deprecation: None,
    },
    ServerType {
        id: 114,
        name: "cpx12",
        cores: 1,
        memory: 2.0,
        disk: 40,
        arch: "x86",
        offered: ALL,
        deprecation: None,
    },
    ServerType {
        id: 45,
        name: "cax11",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "arm",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 93,
        name: "cax21",
        cores: 4,
        memory: 8.0,
        disk: 80,
        arch: "arm",
        offered: EU,
        deprecation: None,
    },
];

/// System images: (id, name, architecture).
pub(crate) const SYSTEM_IMAGES: [(u64, &str, &str); 6] = [
    (161547269, "debian-13", "x86"),
    (161547270, "debian-13", "arm"),
    (114690387, "debian-12", "x86"),
    (114690389, "debian-12", "arm"),
    (161547271, "ubuntu-24.04", "x86"),
    (161547272, "ubuntu-24.04", "arm"),
];
