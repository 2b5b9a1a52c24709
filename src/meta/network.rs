//! PlatformNetworkConfig: the YAML Talos reads from META key 10 on the metal
//! platform before it has a machine config, so a node comes up on its static
//! address instead of waiting for DHCP. Field names follow Talos' own
//! resource specs (`AddressSpecSpec`, `RouteSpecSpec`, …).

use serde::{Deserialize, Serialize};

/// Every spec in key 10 belongs to the `platform` configuration layer.
const LAYER: &str = "platform";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlatformNetworkConfig {
    #[serde(default)]
    pub addresses: Vec<Address>,
    #[serde(default)]
    pub links: Vec<Link>,
    #[serde(default)]
    pub routes: Vec<Route>,
    #[serde(default)]
    pub hostnames: Vec<Hostname>,
    #[serde(default)]
    pub resolvers: Vec<Resolvers>,
    #[serde(default)]
    pub time_servers: Vec<TimeServers>,
    #[serde(default)]
    pub operators: Vec<Operator>,
    #[serde(default, rename = "externalIPs")]
    pub external_ips: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Address {
    /// `10.0.0.11/16`
    pub address: String,
    pub link_name: String,
    pub family: String,
    pub scope: String,
    pub flags: String,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Link {
    pub name: String,
    pub logical: bool,
    pub up: bool,
    /// 0 keeps the driver's default.
    pub mtu: u32,
    pub kind: String,
    #[serde(rename = "type")]
    pub link_type: String,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    pub family: String,
    /// Empty means the default route.
    pub dst: String,
    pub gateway: String,
    pub out_link_name: String,
    pub table: String,
    pub priority: u32,
    pub scope: String,
    #[serde(rename = "type")]
    pub route_type: String,
    pub protocol: String,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hostname {
    pub hostname: String,
    pub domainname: String,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resolvers {
    pub dns_servers: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search_domains: Vec<String>,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeServers {
    pub time_servers: Vec<String>,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Operator {
    pub operator: String,
    pub link_name: String,
    pub require_up: bool,
    pub dhcp4: Dhcp4Options,
    pub layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Dhcp4Options {
    pub route_metric: u32,
}

fn family(ip: &std::net::IpAddr) -> &'static str {
    if ip.is_ipv4() { "inet4" } else { "inet6" }
}

/// The networking one node needs, in plain terms; [`PlatformNetworkConfig::from_plan`]
/// spells it the way Talos reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkPlan {
    pub hostname: String,
    /// `None` leaves links to Talos' defaults (DHCP on every link).
    pub link: Option<String>,
    pub mtu: Option<u32>,
    /// `None` asks for DHCP on the link.
    pub address: Option<(std::net::IpAddr, u8)>,
    pub gateway: Option<std::net::IpAddr>,
    pub nameservers: Vec<std::net::IpAddr>,
    pub search_domains: Vec<String>,
    pub time_servers: Vec<String>,
}

impl PlatformNetworkConfig {
    /// Builds the key-10 document for one node.
    pub fn from_plan(plan: &NetworkPlan) -> Self {
        let mut cfg = PlatformNetworkConfig {
            links: plan
                .link
                .iter()
                .map(|name| Link {
                    name: name.clone(),
                    logical: false,
                    up: true,
                    mtu: plan.mtu.unwrap_or(0),
                    kind: String::new(),
                    link_type: "ether".into(),
                    layer: LAYER.into(),
                })
                .collect(),
            hostnames: vec![Hostname {
                hostname: plan.hostname.clone(),
                domainname: String::new(),
                layer: LAYER.into(),
            }],
            ..Default::default()
        };
        match (plan.address, &plan.link) {
            (Some((ip, prefix)), Some(link)) => {
                cfg.addresses.push(Address {
                    address: format!("{ip}/{prefix}"),
                    link_name: link.clone(),
                    family: family(&ip).into(),
                    scope: "global".into(),
                    flags: "permanent".into(),
                    layer: LAYER.into(),
                });
                if let Some(gw) = plan.gateway {
                    cfg.routes.push(Route {
                        family: family(&gw).into(),
                        dst: String::new(),
                        gateway: gw.to_string(),
                        out_link_name: link.clone(),
                        table: "main".into(),
                        priority: 1024,
                        scope: "global".into(),
                        route_type: "unicast".into(),
                        protocol: "static".into(),
                        layer: LAYER.into(),
                    });
                }
            }
            (None, Some(link)) => cfg.operators.push(Operator {
                operator: "dhcp4".into(),
                link_name: link.clone(),
                require_up: true,
                dhcp4: Dhcp4Options { route_metric: 1024 },
                layer: LAYER.into(),
            }),
            // A static address always has a link (the inventory checks it);
            // without one, Talos runs DHCP on every link by itself.
            (_, None) => {}
        }
        if !plan.nameservers.is_empty() {
            cfg.resolvers.push(Resolvers {
                dns_servers: plan.nameservers.iter().map(ToString::to_string).collect(),
                search_domains: plan.search_domains.clone(),
                layer: LAYER.into(),
            });
        }
        if !plan.time_servers.is_empty() {
            cfg.time_servers.push(TimeServers {
                time_servers: plan.time_servers.clone(),
                layer: LAYER.into(),
            });
        }
        cfg
    }

    /// The YAML stored as the value of META key 10.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).expect("plain data always serialises")
    }

    /// Parses a key-10 value (YAML or JSON). The value comes from an image
    /// anyone may have made: aliases and nesting are bounded first.
    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let text = crate::input::yaml(text).map_err(|e| e.to_string())?;
        serde_yaml_ng::from_str(text).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(address: Option<(&str, u8)>) -> NetworkPlan {
        NetworkPlan {
            hostname: "cp-01".into(),
            link: Some("eth0".into()),
            mtu: None,
            address: address.map(|(a, p)| (a.parse().unwrap(), p)),
            gateway: Some("10.0.0.1".parse().unwrap()),
            nameservers: vec!["1.1.1.1".parse().unwrap()],
            search_domains: vec![],
            time_servers: vec!["time.cloudflare.com".into()],
        }
    }

    #[test]
    fn static_plan_has_address_and_default_route() {
        let cfg = PlatformNetworkConfig::from_plan(&plan(Some(("10.0.0.11", 16))));
        assert_eq!(cfg.addresses[0].address, "10.0.0.11/16");
        assert_eq!(cfg.addresses[0].family, "inet4");
        assert_eq!(cfg.routes[0].gateway, "10.0.0.1");
        assert_eq!(cfg.routes[0].dst, "");
        assert!(cfg.operators.is_empty());
        let back = PlatformNetworkConfig::from_yaml(&cfg.to_yaml()).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn dhcp_plan_has_operator_and_no_address() {
        let cfg = PlatformNetworkConfig::from_plan(&plan(None));
        assert!(cfg.addresses.is_empty() && cfg.routes.is_empty());
        assert_eq!(cfg.operators[0].operator, "dhcp4");
        assert_eq!(cfg.hostnames[0].hostname, "cp-01");
    }

    #[test]
    fn json_values_are_accepted() {
        let cfg = PlatformNetworkConfig::from_yaml(r#"{"externalIPs":["1.2.3.4"]}"#).unwrap();
        assert_eq!(cfg.external_ips, vec!["1.2.3.4"]);
    }
}
