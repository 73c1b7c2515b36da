//! difftx-core: the model itself.
//!
//! Owns the configuration (`config`), the numeric building blocks with their reference and fused
//! implementations (`ops`), the decoder model with its three attention families and KV cache
//! (`model`), tokenizers (`tokenizer`), checkpoint folders on disk (`checkpoint`) and sampling
//! (`generate`). It owns no training state and no command-line parsing.

pub mod checkpoint;
pub mod config;
pub mod generate;
pub mod hf;
pub mod model;
pub mod official;
pub mod ops;
pub mod tokenizer;

pub use config::{Family, HeadPairing, ModelConfig, RopeStyle};
pub use difftx_kernels::decode::{KvPrecision, WeightPrecision};
pub use difftx_kernels::profile;
pub use model::decode::{Decoder, SequenceCache};
pub use model::{KvCache, Model, Probe, RunOptions, WeightFormat};
pub use ops::{Kernels, Precision};
