//! Memory the servers give back to the operating system once a load is over.
//!
//! The `turnwise` binary allocates with mimalloc and starts with `MIMALLOC_PURGE_DELAY=-1`
//! ([`turnwise_model::device::reexec_with_fast_settings`]): freed pages are kept for reuse and
//! never returned, which saves the kernel re-zeroing them on every training step. A server's
//! load comes in bursts, so that setting kept a burst's peak resident for good (a policy server
//! held 4.68 GB idle after one `n = 64` request; a retrieval server 3.4 GB after three large
//! requests: ../shared/reviews/cli-as-a-user-3.md, M4 and M5). [`release_when_idle`] lets
//! mimalloc purge freed pages again (after [`PURGE_DELAY_MS`], so memory freed and reused
//! within a request is not purged) and starts a thread that forces the purges due about once a
//! second, since mimalloc only purges while the process allocates, and an idle server does not.
//!
//! Outside the binary (the library's tests), mimalloc is not the allocator and these calls
//! touch nothing that is in use.

use std::os::raw::{c_int, c_long};
use std::sync::Once;
use std::time::Duration;

// Forces the mimalloc crate, and with it the static mimalloc library, into every artifact
// that links this module.
use mimalloc as _;

// mimalloc's C API (v3, the version the `mimalloc` crate builds by default).
unsafe extern "C" {
    fn mi_collect(force: bool);
    fn mi_option_set(option: c_int, value: c_long);
}

/// `mi_option_purge_delay` in mimalloc v3's `mi_option_t` (include/mimalloc.h).
const MI_OPTION_PURGE_DELAY: c_int = 15;

/// Milliseconds a freed page stays committed before mimalloc may return it (its own default
/// is 10; arenas wait ten times as long).
pub const PURGE_DELAY_MS: i64 = 100;

/// How often the purge thread returns the pages due.
pub const PURGE_INTERVAL: Duration = Duration::from_secs(1);

/// Lets the allocator return freed memory to the OS and starts the thread that does it while
/// the server is idle. Call it once a server starts; later calls do nothing.
pub fn release_when_idle() {
    static START: Once = Once::new();
    START.call_once(|| {
        // SAFETY: mi_option_set only stores an option value; any value is valid for this
        // option (negative: never purge, 0: at once, positive: after that many ms).
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as c_long) };
        let spawned = std::thread::Builder::new()
            .name("turnwise-purge".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(PURGE_INTERVAL);
                    release_now();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the memory purge thread");
        }
    });
}

/// Returns the calling thread's free pages and every page due to the OS now (e.g. by the
/// engine thread once its last request is answered).
pub fn release_now() {
    // SAFETY: mi_collect takes no pointer and may be called from any thread at any time.
    unsafe { mi_collect(true) };
}
