//! Heartbeats from a thread of their own: one that never waits on training, on a peer's
//! answer or on a lock held across I/O, so a node that is alive says so even while its other
//! threads are blocked (on a server that is down, on a straggler, on a full link).

use std::time::Duration;

use falcon_transport::Link;

use crate::error::{Error, Result};
use crate::proto::Msg;

/// Starts the thread: every `every`, a heartbeat on `sched`, then what `extra()` gives (a
/// worker's counters for the metrics), while `alive()` holds and the link is open.
pub(crate) fn start(
    name: &str,
    sched: Link,
    every: Duration,
    alive: impl Fn() -> bool + Send + 'static,
    extra: impl Fn() -> Option<Msg> + Send + 'static,
) -> Result<()> {
    let beat = Msg::Heartbeat.encode();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            // Sleep in short steps, so a finished node's thread ends soon after.
            let step = every.min(Duration::from_millis(100));
            let mut next = std::time::Instant::now() + every;
            loop {
                std::thread::sleep(
                    step.min(next.saturating_duration_since(std::time::Instant::now())),
                );
                if !alive() || !sched.is_open() {
                    return;
                }
                if std::time::Instant::now() >= next {
                    let _ = sched.send(&beat);
                    if let Some(m) = extra() {
                        let _ = sched.send(&m.encode());
                    }
                    next = std::time::Instant::now() + every;
                }
            }
        })
        .map(|_| ())
        .map_err(|e| Error::os("cannot start the heartbeat thread", e))
}
