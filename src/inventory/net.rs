//! Address types the inventory needs beyond `std::net`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// A subnet as written, `10.0.0.0/16` (host bits may be set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    fn bits(&self) -> u32 {
        if self.addr.is_ipv4() { 32 } else { 128 }
    }

    /// The network bits, within the family's width.
    fn mask(&self) -> u128 {
        let host_bits = self.bits() - u32::from(self.prefix);
        let host = if host_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        let all = if self.addr.is_ipv4() {
            u128::from(u32::MAX)
        } else {
            u128::MAX
        };
        all & !host
    }

    /// True when `ip` is inside this subnet (and of the same family).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.addr.is_ipv4() == ip.is_ipv4()
            && as_u128(self.addr) & self.mask() == as_u128(ip) & self.mask()
    }

    /// The subnet with its host bits cleared: `10.0.0.11/24` → `10.0.0.0/24`
    /// (how an interface address names the network it sits in).
    pub fn network(&self) -> Cidr {
        let bits = as_u128(self.addr) & self.mask();
        let addr = match self.addr {
            IpAddr::V4(_) => IpAddr::V4((bits as u32).into()),
            IpAddr::V6(_) => IpAddr::V6(bits.into()),
        };
        Cidr {
            addr,
            prefix: self.prefix,
        }
    }

    /// True for an IPv4 subnet's first and last address (prefix below 31).
    pub fn is_network_or_broadcast(&self, ip: IpAddr) -> bool {
        if !ip.is_ipv4() || self.prefix >= 31 {
            return false;
        }
        let host = as_u128(ip) & !self.mask() & u128::from(u32::MAX);
        let max = !self.mask() & u128::from(u32::MAX);
        host == 0 || host == max
    }
}

fn as_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not an address/prefix like 10.0.0.0/16");
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("{s:?}: prefix /{prefix} is longer than {max} bits"));
        }
        Ok(Cidr { addr, prefix })
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A MAC address, stored lowercase with colons.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct MacAddr([u8; 6]);

impl MacAddr {
    /// The `enx…` alternative name Talos gives the link with this address.
    pub fn altname(&self) -> String {
        format!("enx{}", hex::encode(self.0))
    }
}

impl FromStr for MacAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = s.split([':', '-']).collect();
        let mut out = [0u8; 6];
        if parts.len() != 6 {
            return Err(format!("{s:?} is not a MAC address like bc:24:11:00:00:01"));
        }
        for (o, p) in out.iter_mut().zip(&parts) {
            if p.len() != 2 {
                return Err(format!("{s:?} is not a MAC address like bc:24:11:00:00:01"));
            }
            *o = u8::from_str_radix(p, 16)
                .map_err(|_| format!("{s:?} is not a MAC address like bc:24:11:00:00:01"))?;
        }
        Ok(MacAddr(out))
    }
}

impl TryFrom<String> for MacAddr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<MacAddr> for String {
    fn from(m: MacAddr) -> String {
        m.to_string()
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|b| format!("{b:02x}")).collect();
        f.write_str(&parts.join(":"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_interface_address_names_its_network() {
        let net = |s: &str| s.parse::<Cidr>().unwrap().network().to_string();
        assert_eq!(net("192.168.200.11/24"), "192.168.200.0/24");
        assert_eq!(net("10.20.1.21/16"), "10.20.0.0/16");
        assert_eq!(net("10.1.2.3/0"), "0.0.0.0/0");
        assert_eq!(net("10.1.2.3/32"), "10.1.2.3/32");
        assert_eq!(net("2001:db8::5/64"), "2001:db8::/64");
    }

    #[test]
    fn cidr_membership() {
        let c: Cidr = "10.0.0.0/16".parse().unwrap();
        assert!(c.contains(ip("10.0.255.1")));
        assert!(!c.contains(ip("10.1.0.1")));
        assert!(!c.contains(ip("::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("192.168.1.1")));
        let host: Cidr = "10.0.0.5/32".parse().unwrap();
        assert!(host.contains(ip("10.0.0.5")) && !host.contains(ip("10.0.0.6")));
        let v6: Cidr = "fd00::/64".parse().unwrap();
        assert!(v6.contains(ip("fd00::1")) && !v6.contains(ip("fd01::1")));
    }

    #[test]
    fn cidr_edges() {
        let c: Cidr = "10.0.0.0/24".parse().unwrap();
        assert!(c.is_network_or_broadcast(ip("10.0.0.0")));
        assert!(c.is_network_or_broadcast(ip("10.0.0.255")));
        assert!(!c.is_network_or_broadcast(ip("10.0.0.1")));
    }

    #[test]
    fn cidr_parse_errors_name_the_input() {
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "10.0.0.0/"] {
            assert!(bad.parse::<Cidr>().unwrap_err().contains(bad), "{bad}");
        }
    }

    #[test]
    fn mac_parses_and_names_its_link() {
        let m: MacAddr = "BC-24-11-00-00-1A".parse().unwrap();
        assert_eq!(m.to_string(), "bc:24:11:00:00:1a");
        assert_eq!(m.altname(), "enxbc241100001a");
        assert!("bc:24:11:00:00".parse::<MacAddr>().is_err());
        assert!("bc:24:11:00:00:zz".parse::<MacAddr>().is_err());
    }
}
