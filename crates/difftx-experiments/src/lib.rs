//! difftx-experiments: the paper's instruments (seed demo, activation outliers, quantization,
//! attention allocation, multi-needle retrieval, in-context order robustness) and `compare`, which
//! trains parameter-matched families and reports on them. Uses only the public APIs of difftx-core
//! and difftx-train; writes JSON and PNG files, never touches model internals.

pub mod attention;
pub mod common;
pub mod compare;
pub mod efficiency;
pub mod icl;
pub mod mixture;
pub mod needle;
pub mod outliers;
pub mod plot;
pub mod quantize;
pub mod recall;
pub mod seed_demo;
pub mod stats;
