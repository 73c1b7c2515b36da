//! Time spent inside the attention kernels, so that a benchmark can say what share of a training
//! step attention takes without a profiler.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Nanoseconds in the attention ops' forward (0) and backward (1).
static ATTENTION_NS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Which pass of an op is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Forward = 0,
    Backward = 1,
}

/// Wall-clock time this process has spent so far in the attention ops (`flash_attention`,
/// `diff_attention`, `diff_v2_attention`) in `pass`, summed over calls. The difference of two
/// readings is the attention time of the work in between; calls on several threads at once (a
/// server) are each counted in full.
pub fn attention_time(pass: Pass) -> Duration {
    Duration::from_nanos(ATTENTION_NS[pass as usize].load(Ordering::Relaxed))
}

/// Runs `f`, adding its wall-clock time to [`attention_time`] of `pass`.
pub(crate) fn timed_attention<R>(pass: Pass, f: impl FnOnce() -> R) -> R {
    let start = Instant::now();
    let result = f();
    ATTENTION_NS[pass as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass's counter grows by at least the time spent inside `timed_attention` for it.
    #[test]
    fn timed_attention_adds_its_time() {
        let pause = Duration::from_millis(20);
        for pass in [Pass::Forward, Pass::Backward] {
            let before = attention_time(pass);
            timed_attention(pass, || std::thread::sleep(pause));
            assert!(attention_time(pass) - before >= pause);
        }
    }
}
