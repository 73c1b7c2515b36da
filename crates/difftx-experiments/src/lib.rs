//! difftx-experiments: the paper's instruments (seed demo, activation outliers, quantization,
//! attention allocation, multi-needle retrieval, in-context order robustness) and `compare`, which
//! trains parameter-matched families and reports on them. Uses only the public APIs of difftx-core
//! and difftx-train; writes JSON and PNG files, never touches model internals.
pub mod plot;
pub mod mixture;
pub mod stats;
pub mod needle;
pub mod attention;
pub mod icl;
pub mod compare;
