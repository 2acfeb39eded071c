//! The node's upkeep: work that runs for as long as a node is attached,
//! whatever else it runs. Stale kernel slots can never complete (the
//! stale-round rule drops what would complete them), so they are released
//! here, on one thread of the node, not by an optional part of it (the
//! user-space path's worker only watches its own slots and the overload).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::kernel::xdp;

/// Period of the node's stale-slot reclaim.
pub const RECLAIM_EVERY: Duration = Duration::from_millis(100);

/// A thread that releases the kernel's stale slots every [`RECLAIM_EVERY`]
/// (`KernelMaps::reclaim_stale_slots`, windows read from the `jobs` map, so
/// a reconfigured job's window counts); stopped and joined on drop.
pub(super) struct Upkeep {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upkeep {
    pub(super) fn start(maps: xdp::KernelMaps) -> std::io::Result<Upkeep> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("aggbox-upkeep".into()).spawn(move || {
            // Short sleeps, so that a detach does not wait a whole period.
            let tick = Duration::from_millis(10);
            let mut since = Duration::ZERO;
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                since += tick;
                if since >= RECLAIM_EVERY {
                    since = Duration::ZERO;
                    let windows = maps.job_windows();
                    maps.reclaim_stale_slots(|job| windows.get(&job).copied());
                }
            }
        })?;
        Ok(Upkeep { stop, thread: Some(thread) })
    }
}

impl Drop for Upkeep {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
