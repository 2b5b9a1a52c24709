//! Loopback address blocks for the simulated nodes, handed out in one place.
//!
//! A simulated node listens on its own address (the Talos API's port 50000
//! and the API server's 6443 are fixed), so two scenarios that run at once
//! must never share a /24. Every test binary runs its modules' scenarios side
//! by side; a block is therefore asked for by name, and the same name gets
//! the same block for the whole test process. The second octet follows the
//! process id, so test processes that run at once (two `cargo test`s) stay
//! apart as well, and stays clear of 127.0.0.0/16, which fixtures and the
//! loopback example use as written.

use std::collections::HashMap;
use std::sync::Mutex;

/// `127.A.B`, a /24 (hosts .1–.254) that only `name` uses in this process.
pub fn block(name: &str) -> String {
    static GIVEN: Mutex<Option<HashMap<String, u32>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashMap::new);
    let next = given.len() as u32;
    let n = *given.entry(name.to_owned()).or_insert(next);
    // 200 second octets from 20 (a process's blocks run on into the next
    // ones), 254 blocks each from .1.
    let first = 20 + std::process::id() % 200;
    let a = 20 + (first - 20 + n / 254) % 230;
    format!("127.{a}.{}", 1 + n % 254)
}

/// The block of scenario `k` of the module `module` (its `module_path!()`).
pub fn scenario(module: &str, k: impl std::fmt::Display) -> String {
    block(&format!("{module}#{k}"))
}
