//! SIGINT and SIGTERM for runs that create cloud resources: the first asks
//! the run to stop (it then deletes what it created), a second exits at once.

use std::sync::atomic::{AtomicBool, Ordering};

use imgbuild::publish::Cancel;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
    let msg = b"\nimgbuild: stopping; deleting what this run created (again to exit now)\n";
    // SAFETY: write is async-signal-safe; the buffer outlives the call.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Installs the handlers; the returned token reports the first signal.
pub fn cancel_on_signals() -> Cancel {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only touches an atomic and calls
        // async-signal-safe functions.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
    Cancel::on(&STOP)
}
