//! difftx-train: everything needed to train a difftx model and nothing else — reading and
//! splitting training text (`data`), AdamW and the learning-rate schedule (`optim`), and the
//! resumable training loop with its run folder and checkpoints (`trainer`), evaluation of a model
//! on text (`eval`: mean loss, perplexity, bits per byte), and the throughput benchmarks of
//! docs/design.md §4.3 (`bench`). It builds on the public API of difftx-core and never parses
//! command lines.

pub mod bench;
pub mod data;
pub mod eval;
pub mod optim;
pub mod trainer;

/// Runs `f` on a thread of rayon's pool (in place when already on one) and returns its result.
/// Training runs there: a parallel op (gemm, the kernels) called from outside the pool hands its
/// work to the pool and parks the caller until it is done, a wake-up each way for each of a
/// step's hundreds of ops; called from a pool thread, it runs its first share in place while the
/// other workers take the rest. On the 2-core Intel Xeon of docs/design.md §7.13: +8–17%
/// training tokens/s.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
