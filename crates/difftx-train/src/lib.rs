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
