//! # difftx-kernels
//!
//! Numeric kernels for the difftx engine, each with a forward **and** a backward pass, behind
//! small functions over candle tensors. candle 0.11's fused `softmax_last_dim`, `rms_norm`,
//! `rotary_emb` and `sdpa` have no backward (gradients stop there silently); the functions here
//! are drop-in replacements registered as `CustomOp`s with `bwd`, so `Tensor::backward` flows
//! through them.
//!
//! What this crate owns:
//! * [`softmax_last_dim`]: softmax over the last dimension.
//! * [`rms_norm`]: RMSNorm over the last dimension, optional gain.
//! * [`rope`]: rotary position embedding (interleaved or rotate-half pairs); backward = rotation
//!   by -θ.
//! * [`swiglu`]: silu(gate) · up, the SwiGLU gate.
//! * [`linear`]: `x·wᵀ`, its backward writing the weight's gradient in the weight's layout.
//! * [`swap_dims12`]: `[B, T, H, d]` ↔ `[B, H, T, d]` as one parallel copy; [`rope_to_heads`]
//!   RoPE written straight into `[B, H, T, d]`.
//! * [`cross_entropy`]: mean next-token cross-entropy over the vocabulary, loss and gradient in
//!   one pass each.
//! * [`diff_combine`]: diff-v1's o1 - λ·o2 with a scalar λ; [`diff_combine_pairs`] the same read
//!   straight from one attention output that holds both maps of every pair (no head split);
//!   [`pair_values`] every head's value as its pair's two value heads side by side;
//!   [`diff_attention`] all three in one op whose backward shares `dO·Vᵀ` and `dV` between the
//!   two maps of a pair; [`diff_v2_attention`] the same for diff-v2's pairs, which read one kv
//!   head, with a λ per position.
//! * [`flash_attention`]: fused causal attention (GQA, KV-cache offset, `dv != dk`) with a
//!   FlashAttention-2 style backward; memory O(T·d), never an N×N score map.
//! * [`matmul_bf16`]: a matrix product with bf16 inputs and f32 sums (AMX or AVX512_BF16);
//!   [`linear_bf16`] the same product as the linear layers of `--precision bf16` use it (the
//!   weight's gradient in the weight's layout); [`bf16_matmul`] holds the slice-level kernels.
//! * [`decode`]: the plain-slice pieces of one decode step (matrix-vector products, one attention
//!   row, SwiGLU) for the fused decoder; inference only, no backward.
//! * [`team`]: hot helper threads that the decode step's splits run on (rayon's workers fall
//!   asleep between them).
//! * [`profile`]: the time spent in the attention ops so far (benchmarks break a step down with it).
//!
//! What it must not touch: no model, no configuration, no I/O, no checkpoints, no allocator
//! choices. Everything is a pure function of its input tensors. Each kernel is written as plain
//! functions over row-major slices, with the layout in a comment, forward and backward side by
//! side; the candle glue (dtype dispatch, contiguity, `CustomOp` impls) sits next to them.
//! CPU only: other devices return an error. Supported dtypes: f32 and f64 (bf16 products: f32).

pub mod bf16_matmul;
mod cpu;
mod cross_entropy;
pub mod decode;
mod diff_attention;
mod diff_combine;
mod flash;
mod float;
mod heads;
mod linear;
mod pair_values;
pub mod profile;
mod rms_norm;
mod rope;
mod softmax;
mod swiglu;
pub mod team;
mod tile;

pub use bf16_matmul::{
    bf16_backend, bf16_faster_than_f32, bf16_outpaces_f32, linear_bf16, linear_bf16_emulated, matmul_bf16,
    matmul_bf16_emulated, Bf16Backend,
};
pub use cross_entropy::cross_entropy;
pub use diff_attention::{diff_attention, diff_v2_attention};
pub use diff_combine::{diff_combine, diff_combine_pairs, PairLayout};
pub use flash::flash_attention;
pub use heads::swap_dims12;
pub use linear::linear;
pub use pair_values::pair_values;
pub use rms_norm::rms_norm;
pub use rope::{rope, rope_to_heads};
pub use softmax::softmax_last_dim;
pub use swiglu::swiglu;
pub use tile::TileProducts;
