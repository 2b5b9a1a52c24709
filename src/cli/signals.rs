//! SIGINT and SIGTERM for runs that create cloud resources: the first asks
//! the run to stop (it then deletes what it created), a second exits at once.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use imgbuild::publish::Cancel;

static STOP: AtomicBool = AtomicBool::new(false);

/// What the first signal prints (a static text: the handler may only read).
static SAYS: AtomicPtr<u8> = AtomicPtr::new(CREATED.as_ptr().cast_mut());
static SAYS_LEN: AtomicUsize = AtomicUsize::new(CREATED.len());
const CREATED: &[u8] =
    b"\nimgbuild: stopping; deleting what this run created (again to exit now)\n";

extern "C" fn on_signal(_: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
    let (msg, len) = (SAYS.load(Ordering::SeqCst), SAYS_LEN.load(Ordering::SeqCst));
    // SAFETY: write is async-signal-safe; the text is static.
    unsafe { libc::write(2, msg.cast(), len) };
}

/// [`cancel_on_signals`] for a run that creates nothing: the first signal
/// says `says` (a run stopping between steps) instead.
pub fn stop_on_signals(says: &'static [u8]) -> Cancel {
    SAYS_LEN.store(0, Ordering::SeqCst);
    SAYS.store(says.as_ptr().cast_mut(), Ordering::SeqCst);
    SAYS_LEN.store(says.len(), Ordering::SeqCst);
    cancel_on_signals()
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
