//! Hetzner Cloud networks for the simulator: what `GET /networks` lists and
//! how a server gets its private address on one (`networks` at create,
//! `attach_to_network`). Addresses are only bookkept, never bound: servers
//! are reached on their public 127.4.P.x address.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde_json::{Value, json};

/// An IPv4 range in CIDR notation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    base: u32,
    prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Cidr> {
        let (ip, prefix) = s.split_once('/')?;
        let ip: Ipv4Addr = ip.parse().ok()?;
        let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32)?;
        let mask = Self::mask(prefix);
        Some(Cidr {
            base: u32::from(ip) & mask,
            prefix,
        })
    }

    fn mask(prefix: u8) -> u32 {
        u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix) == self.base
    }

    /// The n-th address of the range (0 is the network address).
    fn nth(&self, n: u32) -> Option<Ipv4Addr> {
        let size = 1u64 << (32 - u32::from(self.prefix));
        (u64::from(n) < size).then(|| Ipv4Addr::from(self.base + n))
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", Ipv4Addr::from(self.base), self.prefix)
    }
}

pub struct Subnet {
    pub range: Cidr,
    pub zone: &'static str,
}

pub struct Network {
    pub id: u64,
    pub name: String,
    pub range: Cidr,
    pub subnets: Vec<Subnet>,
    pub labels: BTreeMap<String, String>,
    pub created: u64,
    /// Attached servers and their private addresses.
    pub servers: BTreeMap<u64, Ipv4Addr>,
}

impl Network {
    /// The network `talos` every simulator starts with: 10.0.0.0/16 with
    /// one cloud subnet 10.0.1.0/24 in eu-central.
    pub fn seeded(id: u64, created: u64) -> Network {
        Network {
            id,
            name: "talos".into(),
            range: Cidr::parse("10.0.0.0/16").expect("valid"),
            subnets: vec![Subnet {
                range: Cidr::parse("10.0.1.0/24").expect("valid"),
                zone: "eu-central",
            }],
            labels: BTreeMap::new(),
            created,
            servers: BTreeMap::new(),
        }
    }

    /// `--network NAME=CIDR`: a network whose one eu-central subnet is the
    /// whole range.
    pub fn from_arg(id: u64, created: u64, spec: &str) -> anyhow::Result<Network> {
        let (name, range) = spec
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--network {spec}: want NAME=CIDR"))?;
        let range = Cidr::parse(range)
            .ok_or_else(|| anyhow::anyhow!("--network {spec}: {range} is not an IPv4 CIDR"))?;
        anyhow::ensure!(!name.is_empty(), "--network {spec}: empty name");
        Ok(Network {
            id,
            name: name.into(),
            range,
            subnets: vec![Subnet {
                range,
                zone: "eu-central",
            }],
            labels: BTreeMap::new(),
            created,
            servers: BTreeMap::new(),
        })
    }

    /// The gateway Hetzner gives every subnet: the network range's first IP.
    fn gateway(&self) -> Ipv4Addr {
        self.range.nth(1).unwrap_or(Ipv4Addr::UNSPECIFIED)
    }

    /// The address a server in `zone` gets: `want` if it is free and in a
    /// subnet of that zone, else the first free one. Errors are the API's
    /// (`ip_not_available`, `no_subnet_available`) with a message.
    pub fn assign(
        &self,
        zone: &str,
        want: Option<Ipv4Addr>,
    ) -> Result<Ipv4Addr, (&'static str, String)> {
        let subnets: Vec<&Subnet> = self.subnets.iter().filter(|s| s.zone == zone).collect();
        if subnets.is_empty() {
            return Err((
                "no_subnet_available",
                format!("network {} has no subnet in network zone {zone}", self.id),
            ));
        }
        let taken = |ip: &Ipv4Addr| *ip == self.gateway() || self.servers.values().any(|s| s == ip);
        if let Some(ip) = want {
            if !subnets.iter().any(|s| s.range.contains(ip)) || taken(&ip) {
                return Err(("ip_not_available", format!("IP {ip} is not available")));
            }
            return Ok(ip);
        }
        subnets
            .iter()
            .flat_map(|s| (2..).map_while(move |n| s.range.nth(n)))
            .find(|ip| !taken(ip) && !ip.is_broadcast() && ip.octets()[3] != 255)
            .ok_or_else(|| {
                (
                    "no_subnet_available",
                    format!("no IP left in network {}", self.id),
                )
            })
    }
}

pub fn network_json(n: &Network, iso: impl Fn(u64) -> String) -> Value {
    json!({
        "id": n.id,
        "name": n.name,
        "ip_range": n.range.to_string(),
        "subnets": n.subnets.iter().map(|s| json!({
            "type": "cloud", "ip_range": s.range.to_string(), "network_zone": s.zone,
            "gateway": n.gateway().to_string(), "vswitch_id": null,
        })).collect::<Vec<_>>(),
        "routes": [],
        "servers": n.servers.keys().collect::<Vec<_>>(),
        "load_balancers": [],
        "protection": {"delete": false},
        "labels": n.labels,
        "created": iso(n.created),
        "expose_routes_to_vswitch": false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_come_from_the_zone_s_subnet_and_are_not_handed_out_twice() {
        let mut n = Network::seeded(1, 0);
        let first = n.assign("eu-central", None).unwrap();
        assert_eq!(first, Ipv4Addr::new(10, 0, 1, 2));
        n.servers.insert(7, first);
        assert_eq!(
            n.assign("eu-central", None).unwrap(),
            Ipv4Addr::new(10, 0, 1, 3)
        );
        assert_eq!(
            n.assign("eu-central", Some(first)).unwrap_err().0,
            "ip_not_available"
        );
        let outside = Some(Ipv4Addr::new(10, 0, 2, 5));
        assert_eq!(
            n.assign("eu-central", outside).unwrap_err().0,
            "ip_not_available"
        );
        assert_eq!(
            n.assign("us-east", None).unwrap_err().0,
            "no_subnet_available"
        );
        let wanted = Ipv4Addr::new(10, 0, 1, 11);
        assert_eq!(n.assign("eu-central", Some(wanted)).unwrap(), wanted);
    }

    #[test]
    fn network_args_are_name_and_cidr() {
        let n = Network::from_arg(2, 0, "lan=192.168.0.0/24").unwrap();
        assert_eq!(
            (n.name.as_str(), n.range.to_string()),
            ("lan", "192.168.0.0/24".into())
        );
        assert!(Network::from_arg(2, 0, "lan").is_err());
        assert!(Network::from_arg(2, 0, "lan=192.168.0.0/33").is_err());
        assert_eq!(
            Cidr::parse("10.0.1.7/24").unwrap().to_string(),
            "10.0.1.0/24"
        );
    }
}
