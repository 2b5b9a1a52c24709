//! Talos: secrets, machine configs, the machine API client and the bootstrap
//! state machine that takes nodes from maintenance mode to a healthy cluster.

pub mod api;
pub mod apply;
pub mod bootstrap;
pub mod client;
pub mod config;
pub mod etcd;
pub mod health;
pub mod kube;
pub mod kubernetes;
pub mod lock;
pub mod merge;
pub mod pki;
pub mod remove;
pub mod secrets;
pub mod stage;
pub mod status;
pub mod talosconfig;
pub mod upgrade;
