//! Loopback address blocks for the simulated nodes, handed out in one place.
//!
//! A simulated node listens on its own address (the Talos API's port 50000
//! and the API server's 6443 are fixed), so two scenarios that run at once
//! must never share a /24. Every test binary runs its modules' scenarios side
//! by side; a block is therefore asked for by name, and the same name gets
//! the same block for the whole test process. Test processes that run at
//! once (two `cargo test`s) stay apart too: each second octet a process
//! uses is reserved by an advisory lock on a file in the temp dir, held
//! until the process ends (a pid alone collided for pids equal mod 200).
//! 127.0.0.0/16, which fixtures and the loopback example use as written,
//! is never handed out.

use std::collections::HashMap;
use std::fs::File;
use std::sync::Mutex;

/// Second octets handed out: 20 to 249.
const FIRST: u32 = 20;
const OCTETS: u32 = 230;

struct Given {
    by_name: HashMap<String, u32>,
    /// The second octets this process holds, in the order taken, with
    /// their lock files (kept open: the lock lives as long as the file).
    octets: Vec<(u32, File)>,
}

/// Takes a second octet no other live test process holds, starting from
/// one derived from the pid.
fn reserve(held: &[(u32, File)]) -> (u32, File) {
    let start = std::process::id() % OCTETS;
    for k in 0..OCTETS {
        let a = FIRST + (start + k) % OCTETS;
        if held.iter().any(|(h, _)| *h == a) {
            continue;
        }
        let path = std::env::temp_dir().join(format!("imgbuild-tests-net-127.{a}.lock"));
        let Ok(file) = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
        else {
            continue;
        };
        if file.try_lock().is_ok() {
            return (a, file);
        }
    }
    panic!("every loopback second octet from {FIRST} is held by another test process");
}

/// `127.A.B`, a /24 (hosts .1–.254) that only `name` uses in this process
/// and no other test process uses while this one runs.
pub fn block(name: &str) -> String {
    static GIVEN: Mutex<Option<Given>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(|| Given {
        by_name: HashMap::new(),
        octets: Vec::new(),
    });
    let next = given.by_name.len() as u32;
    let n = *given.by_name.entry(name.to_owned()).or_insert(next);
    let slot = (n / 254) as usize;
    while given.octets.len() <= slot {
        let taken = reserve(&given.octets);
        given.octets.push(taken);
    }
    format!("127.{}.{}", given.octets[slot].0, 1 + n % 254)
}

/// The block of scenario `k` of the module `module` (its `module_path!()`).
pub fn scenario(module: &str, k: impl std::fmt::Display) -> String {
    block(&format!("{module}#{k}"))
}
