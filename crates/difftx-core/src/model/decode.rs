//! The fused decoder: one new token for each of several sequences per step, on plain f32 buffers
//! and a growing KV cache per sequence (docs/design.md §5.1).
//!
//! `Model::forward` with a KV cache runs about forty tensor ops per layer for each new token; at
//! batch 1 their allocation and dispatch cost more than the arithmetic. The decoder runs the same
//! equations as `Model::forward` directly on slices (`difftx_kernels::decode`):
//!
//! ```text
//! h = RMSNorm(x)·g_in
//! [q | k | v | λ-logits] = h·[Wq; Wk; Wv; Wλ]ᵀ          one matrix-vector pass (λ: diff-v2 only)
//! q, k ← RoPE at the sequence's position; k, v appended to the sequence's cache
//! baseline  o_i = Σ_s softmax_s(q_i·k_s/√d)·v_s
//! diff-v1   o_j = (1 − λ_init)·SubLN( Σ_s (p1_s − λ·p2_s)·[v1_s | v2_s] )
//! diff-v2   o_j = Σ_s (p_{2j,s} − σ(λ-logit_j)·p_{2j+1,s})·v_s
//! x += o·Woᵀ;  h = RMSNorm(x)·g_post;  [gate | up] = h·[Wg; Wu]ᵀ;  x += (silu(gate)·up)·Wdᵀ
//! logits = (RMSNorm(x)·g_final)·W_headᵀ
//! ```
//!
//! Both maps of a differential head are weighed into one value pass (`p1 − λ·p2`), so the maps
//! are never materialised as outputs and never concatenated. One pass runs any set of rows: the
//! positions of a prompt (prefill), or one new token of each of several sequences at different
//! positions (a server's batch); each row attends to its own sequence up to its own position.
//!
//! The decoder holds an f32 snapshot of the weights taken at construction; it covers f32 models
//! on the CPU with the fused kernels and no quantisation probes (`Decoder::supports`), which is
//! every model `generate` meets outside the experiments' probes.

use super::{AttnKind, Linear, Model, SubLayerNorm};
use crate::config::{HeadPairing, RopeStyle};
use crate::ops::Kernels;
use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor};
use difftx_kernels::decode::{
    encode_position, key_offset, matmul_packed, rms_norm_rows, rope_heads, softmax_scores, swiglu_rows, value_offset,
    weighted_values, Bf16, HeadCache, KvElement, KvPrecision, PackedWeight, PositionScales, WeightPrecision, KV_CHUNK,
};
use difftx_kernels::team;

/// How a layer turns its heads' attention into its output features.
enum Mix {
    /// Head i attends with kv head i / (n_q / n_kv).
    Baseline,
    /// Pair j: heads `pairing.pair(j, n_q)` with kv pair j / group; output width 2d per pair.
    DiffV1 {
        lambda: f32,
        /// (1 − λ_init)·g per feature of a pair's 2d outputs (g = 1 when the norm has no gain).
        out_gain: Vec<f32>,
        /// RMS-normalise each pair's output first (false: the "no GroupNorm" ablation).
        normalise: bool,
        eps: f64,
    },
    /// Pair j: heads 2j and 2j+1 (one kv group), λ_j = σ(λ-logit_j) per token.
    DiffV2,
}

struct LayerWeights {
    input_norm: Vec<f32>,
    /// Wq, Wk, Wv (and diff-v2's Wλ) stacked: outputs [q | k | v (| λ-logits)].
    qkv: PackedWeight,
    o_proj: PackedWeight,
    post_norm: Vec<f32>,
    /// W_gate and W_up stacked: outputs [gate | up].
    gate_up: PackedWeight,
    down: PackedWeight,
    mix: Mix,
}

/// The keys and values of one sequence, in chunks of `KV_CHUNK` positions (the layout
/// `difftx_kernels::decode::KV_CHUNK` describes), stored at the decoder's `KvPrecision`. Layer
/// l's keys are `[chunks, n_kv, d, KV_CHUNK]` (feature-major within a chunk: the scores of its
/// positions are summed side by side), its values `[chunks, n_kv, KV_CHUNK, d]` (a weighted sum
/// of rows), so each head's chunk is one contiguous run; an int8 cache adds one scale per position
/// of a head for its keys and one for its values, `[chunks, n_kv, KV_CHUNK]`. The cache grows by
/// appending chunks, its capacity doubling (up to the context), so nothing is copied or
/// concatenated per token.
#[derive(Debug, Clone, Default)]
pub struct SequenceCache {
    len: usize,
    store: KvStore,
}

/// Every layer's keys (`k[l]`) and values (`v[l]`) of one sequence, as `E`, and where `E` is
/// scaled (int8) their positions' scales (`k_scales[l]`, `v_scales[l]`; empty otherwise).
#[derive(Debug, Clone, Default)]
struct Layers<E> {
    k: Vec<Vec<E>>,
    v: Vec<Vec<E>>,
    k_scales: Vec<Vec<f32>>,
    v_scales: Vec<Vec<f32>>,
}

impl<E> Layers<E> {
    fn new(layers: usize) -> Self {
        fn empty<T>(layers: usize) -> Vec<Vec<T>> {
            (0..layers).map(|_| Vec::new()).collect()
        }
        Layers { k: empty(layers), v: empty(layers), k_scales: empty(layers), v_scales: empty(layers) }
    }

    fn layer(&self, l: usize) -> LayerCache<'_, E> {
        LayerCache {
            keys: &self.k[l],
            values: &self.v[l],
            key_scales: &self.k_scales[l],
            value_scales: &self.v_scales[l],
        }
    }
}

#[derive(Debug, Clone)]
enum KvStore {
    F32(Layers<f32>),
    Bf16(Layers<Bf16>),
    Int8(Layers<i8>),
}

impl Default for KvStore {
    fn default() -> Self {
        KvStore::F32(Layers::default())
    }
}

impl KvStore {
    fn layers(&self) -> usize {
        match self {
            KvStore::F32(l) => l.k.len(),
            KvStore::Bf16(l) => l.k.len(),
            KvStore::Int8(l) => l.k.len(),
        }
    }

    fn precision(&self) -> KvPrecision {
        match self {
            KvStore::F32(_) => KvPrecision::F32,
            KvStore::Bf16(_) => KvPrecision::Bf16,
            KvStore::Int8(_) => KvPrecision::Int8,
        }
    }

    /// Layer l's keys and values.
    fn layer(&self, l: usize) -> LayerKv<'_> {
        match self {
            KvStore::F32(s) => LayerKv::F32(s.layer(l)),
            KvStore::Bf16(s) => LayerKv::Bf16(s.layer(l)),
            KvStore::Int8(s) => LayerKv::Int8(s.layer(l)),
        }
    }
}

/// One layer's keys and values of one sequence, at the cache's precision.
#[derive(Clone, Copy)]
enum LayerKv<'a> {
    F32(LayerCache<'a, f32>),
    Bf16(LayerCache<'a, Bf16>),
    Int8(LayerCache<'a, i8>),
}

impl SequenceCache {
    /// Number of positions cached (the position the next token will take).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the sequence, keeping the allocations (what is left in them is never read as
    /// keys or values of the new sequence: a position is written before it is attended to).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Forgets every position from `len` on (a speculative draft's rejected tokens), keeping the
    /// allocations, as `clear` does; a `len` at or past the end changes nothing.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// One layer's cache of one sequence, as `attend` reads it (the scales empty unless `E` is
/// scaled).
struct LayerCache<'a, E> {
    keys: &'a [E],
    values: &'a [E],
    key_scales: &'a [f32],
    value_scales: &'a [f32],
}

// By hand: derived, they would ask `E: Copy`.
impl<E> Clone for LayerCache<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for LayerCache<'_, E> {}

/// One thread's buffers for attending rows, reused by every row and layer.
struct Scratch {
    /// The two maps' attention weights of one head pair, [positions].
    p1: Vec<f32>,
    p2: Vec<f32>,
    /// A diff-v1 pair's output before its norm, [2d].
    pair: Vec<f32>,
    /// One row's keys rotated to its position, [n_kv·d].
    k_rot: Vec<f32>,
}

/// Prompt positions run as rows of one pass at most (bounds the pass's buffers).
const PREFILL_CHUNK: usize = 512;

/// Default of `Decoder::parallel_attention_macs` (below it, splitting cost more than it saved when
/// splits woke rayon workers; not retuned for `team`'s hot helpers).
const PARALLEL_ATTENTION_MACS: usize = 1 << 16;

/// A model's weights laid out for decoding (a copy: the decoder does not borrow the model).
pub struct Decoder {
    layers: Vec<LayerWeights>,
    embed: Vec<f32>,
    final_norm: Vec<f32>,
    lm_head: PackedWeight,
    /// RoPE tables [max_seq_len, d/2].
    cos: Vec<f32>,
    sin: Vec<f32>,
    rope_style: RopeStyle,
    pairing: HeadPairing,
    d_model: usize,
    d_ff: usize,
    vocab: usize,
    n_q: usize,
    n_kv: usize,
    head_dim: usize,
    /// Width of the attention output before o_proj.
    o_in: usize,
    norm_eps: f64,
    max_seq_len: usize,
    /// How `new_sequence`'s caches store keys and values.
    kv_precision: KvPrecision,
    /// Attention multiply-adds of a pass from which its rows are attended on several threads.
    parallel_attention_macs: usize,
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A linear layer's weight packed for `matmul_packed`.
fn weight(l: &Linear, precision: WeightPrecision) -> Result<PackedWeight> {
    stacked(&[l], precision)
}

/// Several linear layers of the same input stacked into one (their outputs side by side).
fn stacked(ls: &[&Linear], precision: WeightPrecision) -> Result<PackedWeight> {
    ensure!(
        ls.iter().all(|l| l.quantized.is_none()),
        "the decoder needs f32 weights; this model's layers are quantised"
    );
    let in_dim = ls[0].w.dim(1)?;
    let mut rows = Vec::new();
    for l in ls {
        rows.extend(to_f32(&l.w)?);
    }
    Ok(PackedWeight::from_rows_as(&rows, in_dim, precision))
}

/// `f(scratch, i, &mut tasks[i])` for every task: split over `team`'s threads (a scratch each)
/// where `parallel`, else in order on this thread with `scratch`.
fn for_each_task<T: Send>(
    parallel: bool,
    tasks: &mut [T],
    scratch: &mut Scratch,
    new_scratch: impl Fn() -> Scratch + Sync,
    f: impl Fn(&mut Scratch, usize, &mut T) + Sync,
) {
    if parallel {
        team::for_each_mut_init(tasks, new_scratch, f);
    } else {
        tasks.iter_mut().enumerate().for_each(|(i, task)| f(scratch, i, task));
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Values of a step's element-wise pass (a residual add and norm over `[rows, d_model]`, SwiGLU
/// over `[rows, d_ff]`) from which its rows are split over the team: at 32 rows of bench-s these
/// passes on the caller alone kept the helper waiting (design.md §7.31); a split costs a few
/// hundred nanoseconds, more than a few rows' pass.
const ELEMENTWISE_SPLIT: usize = 4096;

/// `f(first, runs)` over the rows of `parts` (row-major slices over the same `rows`): on runs
/// of rows split over the team where there are at least [`ELEMENTWISE_SPLIT`] values in the
/// widest part, else once over all of them (`first`: the run's first row).
fn split_rows<const N: usize>(rows: usize, mut parts: [&mut [f32]; N], f: impl Fn(usize, [&mut [f32]; N]) + Sync) {
    let widest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
    let threads = team::participants().min(rows);
    if threads < 2 || widest < ELEMENTWISE_SPLIT {
        return f(0, parts);
    }
    let per = rows.div_ceil(threads);
    let mut runs: Vec<(usize, [&mut [f32]; N])> = Vec::with_capacity(threads);
    for first in (0..rows).step_by(per) {
        let take = per.min(rows - first);
        let run = std::array::from_fn(|i| {
            let part = std::mem::take(&mut parts[i]);
            let (run, rest) = part.split_at_mut(part.len() / (rows - first) * take);
            parts[i] = rest;
            run
        });
        runs.push((first, run));
    }
    team::for_each_mut(&mut runs, |_, (first, run)| f(*first, std::array::from_fn(|i| std::mem::take(&mut run[i]))));
}

/// `x += delta` (where given), then `h = RMSNorm(x)·gain`, row by row (rows of `gain.len()`).
fn residual_and_norm(x: &mut [f32], delta: Option<&[f32]>, gain: &[f32], eps: f64, h: &mut [f32]) {
    let width = gain.len();
    split_rows(x.len() / width.max(1), [x, h], |first, [x, h]| {
        if let Some(delta) = delta {
            add_into(x, &delta[first * width..]);
        }
        rms_norm_rows(x, gain, eps, h);
    });
}

/// `act = silu(gate)·up` for every row of `gate_up` (`[rows, 2·dff]`: gate, then up).
fn swiglu_all_rows(gate_up: &[f32], dff: usize, act: &mut [f32]) {
    split_rows(act.len() / dff.max(1), [act], |first, [act]| {
        let gate_up = gate_up[first * 2 * dff..].chunks_exact(2 * dff);
        for (gu, a) in gate_up.zip(act.chunks_exact_mut(dff)) {
            swiglu_rows(&gu[..dff], &gu[dff..], a);
        }
    });
}

impl Decoder {
    /// Whether `Decoder::new` accepts this model: f32 on the CPU, fused kernels, no quantised
    /// layers and no quantisation probes (those run through `Model::forward`).
    pub fn supports(model: &Model) -> bool {
        model.dtype() == DType::F32
            && matches!(model.device(), Device::Cpu)
            && model.opts.kernels == Kernels::Fused
            && model.opts.attn_logit_bits.is_none()
            && model.opts.act_bits.is_none()
            && model.lm_head.quantized.is_none()
            && model.blocks.iter().all(|b| {
                let a = &b.attn;
                [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &b.mlp.gate, &b.mlp.up, &b.mlp.down]
                    .iter()
                    .all(|l| l.quantized.is_none())
                    && !matches!(&a.kind, AttnKind::DiffV2 { lambda_proj } if lambda_proj.quantized.is_some())
            })
    }

    /// Copies the model's weights into the decoder's layout (a snapshot: later changes to the
    /// model's weights are not seen).
    pub fn new(model: &Model) -> Result<Self> {
        Decoder::with_precision(model, WeightPrecision::F32)
    }

    /// As `new`, with the linear layers' weights stored at `precision`: bf16 halves the bytes read
    /// per token, int8 (symmetric, one scale per output channel) quarters them (decode at batch 1
    /// is bound by memory bandwidth). Activations, the KV cache, norms and the embedding stay f32,
    /// so the only change is the weights' rounding (the prompt's pass included).
    pub fn with_precision(model: &Model, precision: WeightPrecision) -> Result<Self> {
        if !Decoder::supports(model) {
            bail!(
                "the fused decoder runs f32 CPU models with the fused kernels and no quantisation; \
                 use Model::forward with a KvCache for this one"
            );
        }
        let cfg = model.config();
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for b in &model.blocks {
            let a = &b.attn;
            let (qkv, mix) = match &a.kind {
                AttnKind::Baseline => (stacked(&[&a.q_proj, &a.k_proj, &a.v_proj], precision)?, Mix::Baseline),
                AttnKind::DiffV2 { lambda_proj } => {
                    (stacked(&[&a.q_proj, &a.k_proj, &a.v_proj, lambda_proj], precision)?, Mix::DiffV2)
                }
                AttnKind::DiffV1(diff) => {
                    let lambda = diff.lambda()?.to_dtype(DType::F32)?.to_vec1::<f32>()?[0];
                    let scale = (1.0 - diff.lambda_init) as f32;
                    let width = 2 * a.head_dim;
                    let (out_gain, normalise) = match &diff.subln {
                        SubLayerNorm::Off => (vec![scale; width], false),
                        SubLayerNorm::Plain => (vec![scale; width], true),
                        SubLayerNorm::Gain(g) => (to_f32(g)?.iter().map(|g| g * scale).collect(), true),
                    };
                    let mix = Mix::DiffV1 { lambda, out_gain, normalise, eps: diff.subln_eps };
                    (stacked(&[&a.q_proj, &a.k_proj, &a.v_proj], precision)?, mix)
                }
            };
            layers.push(LayerWeights {
                input_norm: to_f32(&b.input_norm)?,
                qkv,
                o_proj: weight(&a.o_proj, precision)?,
                post_norm: to_f32(&b.post_norm)?,
                gate_up: stacked(&[&b.mlp.gate, &b.mlp.up], precision)?,
                down: weight(&b.mlp.down, precision)?,
                mix,
            });
        }
        let a = &model.blocks[0].attn;
        let lm_head = weight(&model.lm_head, precision)?;
        // Both threads read every weight once, together: batch-1 steps ran ~25% faster after it
        // on the Xeon model 207 (docs/design.md §7.29).
        let mut packed: Vec<&PackedWeight> =
            layers.iter().flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down]).collect();
        packed.push(&lm_head);
        difftx_kernels::decode::read_on_every_thread(&packed);
        Ok(Decoder {
            layers,
            embed: to_f32(&model.embed)?,
            final_norm: to_f32(&model.norm)?,
            lm_head,
            cos: to_f32(&model.rope.cos)?,
            sin: to_f32(&model.rope.sin)?,
            rope_style: model.rope.style,
            pairing: a.pairing,
            d_model: cfg.d_model,
            d_ff: cfg.d_ff,
            vocab: cfg.vocab_size,
            n_q: a.n_q,
            n_kv: a.n_kv,
            head_dim: a.head_dim,
            o_in: cfg.attention_shapes().o_in,
            norm_eps: cfg.norm_eps,
            max_seq_len: cfg.max_seq_len,
            kv_precision: KvPrecision::F32,
            parallel_attention_macs: PARALLEL_ATTENTION_MACS,
        })
    }

    /// Stores the keys and values of the sequences made from now on (`new_sequence`) at
    /// `precision`. bf16 halves the bytes attention reads per cached position, which is what
    /// bounds several sequences stepped together once their caches outgrow the last-level cache
    /// (docs/design.md §7.22); keys and values are rounded to nearest even when written, and
    /// scores, weights and sums stay f32. Caches made before keep their precision, and a step
    /// refuses them.
    pub fn set_kv_precision(&mut self, precision: KvPrecision) {
        self.kv_precision = precision;
    }

    /// How this decoder's new caches store keys and values.
    pub fn kv_precision(&self) -> KvPrecision {
        self.kv_precision
    }

    /// Sets how much attention work (multiply-adds of one pass) is split over threads: 0 always
    /// splits, `usize::MAX` never (tests of both paths; tuning).
    pub fn set_parallel_attention_macs(&mut self, macs: usize) {
        self.parallel_attention_macs = macs;
    }

    /// Number of tokens the logits score.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The model's context length: a sequence holds at most this many positions.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// An empty cache for one sequence of this model.
    pub fn new_sequence(&self) -> SequenceCache {
        let n = self.layers.len();
        let store = match self.kv_precision {
            KvPrecision::F32 => KvStore::F32(Layers::new(n)),
            KvPrecision::Bf16 => KvStore::Bf16(Layers::new(n)),
            KvPrecision::Int8 => KvStore::Int8(Layers::new(n)),
        };
        SequenceCache { len: 0, store }
    }

    /// Whether `seq` was made by this decoder (`new_sequence`) at its current KV precision.
    fn owns(&self, seq: &SequenceCache) -> bool {
        seq.store.layers() == self.layers.len() && seq.store.precision() == self.kv_precision
    }

    /// Floats of one layer's chunk of `KV_CHUNK` positions: every kv head's keys (or values).
    fn chunk_stride(&self) -> usize {
        self.n_kv * self.head_dim * KV_CHUNK
    }

    /// Where kv head h's part of every chunk starts in a layer's keys (and values).
    fn head_offset(&self, h: usize) -> usize {
        h * self.head_dim * KV_CHUNK
    }

    /// Scales of one layer's chunk of `KV_CHUNK` positions (int8 caches): every kv head's.
    fn scale_chunk_stride(&self) -> usize {
        self.n_kv * KV_CHUNK
    }

    /// Kv head h's part of a layer's keys or values (`elems`) and, where `E` is scaled, of their
    /// scales.
    fn head_cache<'a, E: KvElement>(&self, elems: &'a [E], scales: &'a [f32], h: usize) -> HeadCache<'a, E> {
        let scales = E::SCALED
            .then(|| PositionScales { scales: &scales[h * KV_CHUNK..], chunk_stride: self.scale_chunk_stride() });
        HeadCache { elems: &elems[self.head_offset(h)..], chunk_stride: self.chunk_stride(), scales }
    }

    /// Makes room in `seq` for at least `needed` positions, in whole chunks (the allocation
    /// doubling, capped at the context, so appending is amortised O(1)).
    fn reserve(&self, seq: &mut SequenceCache, needed: usize) {
        fn grow<T: Clone + Default>(layers: &mut [Vec<T>], values: usize, most: usize) {
            for layer in layers {
                if values > layer.len() {
                    let capacity = values.max(2 * layer.capacity()).min(most).max(values);
                    layer.reserve_exact(capacity - layer.len());
                    layer.resize(values, T::default());
                }
            }
        }
        fn grow_all<E: KvElement>(layers: &mut Layers<E>, chunks: usize, most: usize, stride: usize, scales: usize) {
            grow(&mut layers.k, chunks * stride, most * stride);
            grow(&mut layers.v, chunks * stride, most * stride);
            if E::SCALED {
                grow(&mut layers.k_scales, chunks * scales, most * scales);
                grow(&mut layers.v_scales, chunks * scales, most * scales);
            }
        }
        let (chunks, most) = (needed.div_ceil(KV_CHUNK), self.max_seq_len.div_ceil(KV_CHUNK));
        let (stride, scales) = (self.chunk_stride(), self.scale_chunk_stride());
        match &mut seq.store {
            KvStore::F32(layers) => grow_all(layers, chunks, most, stride, scales),
            KvStore::Bf16(layers) => grow_all(layers, chunks, most, stride, scales),
            KvStore::Int8(layers) => grow_all(layers, chunks, most, stride, scales),
        }
    }

    /// Writes one position's keys (rotated) and values of layer `l` into `layers` (each head's
    /// scales too, where `E` is scaled).
    fn write_kv<E: KvElement>(&self, layers: &mut Layers<E>, l: usize, pos: usize, keys: &[f32], values: &[f32]) {
        let (d, stride) = (self.head_dim, self.chunk_stride());
        for (h, (k, v)) in keys.chunks_exact(d).zip(values.chunks_exact(d)).enumerate() {
            let head_keys = &mut layers.k[l][self.head_offset(h)..];
            let key_scale = encode_position(k, |feature, c| head_keys[key_offset(pos, feature, stride)] = c);
            let head_values = &mut layers.v[l][self.head_offset(h) + value_offset(pos, d, stride)..][..d];
            let value_scale = encode_position(v, |i, c| head_values[i] = c);
            if E::SCALED {
                // As `head_cache` reads them: head h's scales from h·KV_CHUNK, chunk by chunk.
                let at = h * KV_CHUNK + pos / KV_CHUNK * self.scale_chunk_stride() + pos % KV_CHUNK;
                layers.k_scales[l][at] = key_scale;
                layers.v_scales[l][at] = value_scale;
            }
        }
    }

    /// Starts `seq` over with `prompt` and returns the logits of the prompt's last position,
    /// `[vocab]`. The prompt's positions run as rows of one pass (in chunks of `PREFILL_CHUNK`),
    /// each attending to the positions up to its own.
    pub fn prefill(&self, seq: &mut SequenceCache, prompt: &[u32]) -> Result<Vec<f32>> {
        crate::generate::check_prompt(prompt, self.max_seq_len)?;
        if !self.owns(seq) {
            *seq = self.new_sequence();
        }
        seq.clear();
        self.append(seq, prompt)
    }

    /// Appends `tokens` (at least one) to `seq` at its next positions, as rows of one pass (in
    /// chunks of `PREFILL_CHUNK`), and returns the logits after the last of them, `[vocab]`: a
    /// prompt, or the tokens a speculative draft's cache has not seen yet.
    pub fn append(&self, seq: &mut SequenceCache, tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "no tokens to append");
        self.append_rows(seq, tokens, false)
    }

    /// Appends `tokens` to `seq` at its next positions, as rows of one pass (in chunks of
    /// `PREFILL_CHUNK`), and returns the next-token logits after each of them, row-major
    /// [tokens.len(), vocab]: what `step` would return token by token, in one read of the weights
    /// per chunk (speculative decoding checks a draft's tokens so).
    pub fn extend(&self, seq: &mut SequenceCache, tokens: &[u32]) -> Result<Vec<f32>> {
        self.append_rows(seq, tokens, true)
    }

    /// `tokens` as rows of one sequence, a pass per `PREFILL_CHUNK`; the logits after every
    /// token (`every`) or after the last one only.
    fn append_rows(&self, seq: &mut SequenceCache, tokens: &[u32], every: bool) -> Result<Vec<f32>> {
        ensure!(
            seq.len + tokens.len() <= self.max_seq_len,
            "{} cached and {} new positions are more than the model's context of {} tokens",
            seq.len,
            tokens.len(),
            self.max_seq_len
        );
        let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_CHUNK).collect();
        let mut logits = Vec::with_capacity(if every { tokens.len() } else { 1 } * self.vocab);
        for (c, chunk) in chunks.iter().enumerate() {
            let rows: Vec<(usize, u32)> = chunk.iter().map(|&t| (0, t)).collect();
            let wanted: Vec<usize> = match (every, c + 1 == chunks.len()) {
                (true, _) => (0..rows.len()).collect(),
                (false, true) => vec![rows.len() - 1],
                (false, false) => Vec::new(),
            };
            logits.extend(self.forward_rows(&mut [&mut *seq], &rows, &wanted)?);
        }
        Ok(logits)
    }

    /// Appends `tokens[r]` to `seqs[r]` for every r and returns the next-token logits of each,
    /// row-major [r, vocab]. Every sequence must have room for one more position.
    pub fn step(&self, seqs: &mut [&mut SequenceCache], tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(seqs.len() == tokens.len(), "{} sequences but {} tokens", seqs.len(), tokens.len());
        let rows: Vec<(usize, u32)> = tokens.iter().copied().enumerate().collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        self.forward_rows(seqs, &rows, &all)
    }

    /// The decoder's one forward: row `i` appends token `rows[i].1` to sequence `seqs[rows[i].0]`
    /// at that sequence's next free position (rows of one sequence take consecutive positions, in
    /// order). Returns the logits of the rows listed in `logit_rows`, row-major.
    ///
    /// Per layer, every row's keys and values are written first (in row order), then the rows
    /// attend, each to the positions up to its own: one row of a prompt is one row here, so a
    /// prompt and a batch of sequences run the same code. Attention is split across threads when
    /// there is enough of it: over the rows, or over each row's heads when rows are fewer than
    /// threads. When each row is a sequence of its own and attends whole on one thread (a batch
    /// of sequences), it writes its keys and values in its own task, just before it reads them:
    /// the scattered key writes, a cache line per feature, were half of the caller's serial work
    /// at sixteen sequences (docs/design.md §7.24). Every split runs on `difftx_kernels::team`'s
    /// hot helpers (rayon's workers fall asleep between the step's splits; docs/design.md §7.13).
    fn forward_rows(
        &self,
        seqs: &mut [&mut SequenceCache],
        rows: &[(usize, u32)],
        logit_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let n = rows.len();
        // Each row's position, and how many positions each sequence gains.
        let mut gained = vec![0usize; seqs.len()];
        let mut pos = Vec::with_capacity(n);
        for &(s, t) in rows {
            ensure!(s < seqs.len(), "row for sequence {s} of {}", seqs.len());
            ensure!((t as usize) < self.vocab, "token {t} is outside the vocabulary of {} tokens", self.vocab);
            ensure!(
                self.owns(seqs[s]),
                "this cache was not made by this decoder (new_sequence) at its KV precision ({:?})",
                self.kv_precision
            );
            let p = seqs[s].len + gained[s];
            ensure!(
                p < self.max_seq_len,
                "the sequence already fills the model's context of {} tokens",
                self.max_seq_len
            );
            pos.push(p);
            gained[s] += 1;
        }
        let (dm, d, dff) = (self.d_model, self.head_dim, self.d_ff);
        let (q_out, kv_out) = (self.n_q * d, self.n_kv * d);
        let qkv_width = self.layers.first().map_or(0, |l| l.qkv.out_dim());
        let longest = pos.iter().map(|p| p + 1).max().unwrap_or(0);
        // Buffers of this pass, reused by every layer.
        let mut x = Vec::with_capacity(n * dm);
        for &(_, t) in rows {
            x.extend_from_slice(&self.embed[t as usize * dm..(t as usize + 1) * dm]);
        }
        let mut h = vec![0f32; n * dm];
        let mut qkv = vec![0f32; n * qkv_width];
        let mut q_rot = vec![0f32; n * q_out];
        let mut att = vec![0f32; n * self.o_in];
        let mut delta = vec![0f32; n * dm];
        let mut gate_up = vec![0f32; n * 2 * dff];
        let mut act = vec![0f32; n * dff];
        for (seq, &g) in seqs.iter_mut().zip(&gained) {
            let needed = seq.len + g;
            self.reserve(seq, needed);
        }
        // Split attention over threads only where it outweighs the split's cost (multiply-adds of
        // scores and values, summed over rows).
        let attention_work: usize = pos.iter().map(|p| (p + 1) * 2 * q_out).sum();
        let threads = team::participants();
        // Fewer rows than threads (a single sequence's step): each row's units (heads, diff-v1's
        // pairs) are tasks of their own, dealt out over the threads.
        let units = self.o_in / self.attention_unit_width();
        let groups = if n < threads { units } else { 1 };
        let parallel = n * groups >= 2 && attention_work >= self.parallel_attention_macs;
        let group_width = self.o_in / groups;
        // Rows that write their own keys and values (see above).
        let write_in_task = groups == 1 && seqs.len() == n && rows.iter().enumerate().all(|(i, &(s, _))| s == i);
        let new_scratch = || Scratch {
            p1: vec![0f32; longest],
            p2: vec![0f32; longest],
            pair: vec![0f32; 2 * d],
            k_rot: vec![0f32; kv_out],
        };
        // One thread's scratch serves every layer; split passes make one per thread.
        let mut scratch = new_scratch();
        if let Some(first) = self.layers.first() {
            residual_and_norm(&mut x, None, &first.input_norm, self.norm_eps, &mut h);
        }
        for (l, lw) in self.layers.iter().enumerate() {
            matmul_packed(&h, &lw.qkv, &mut qkv);
            // Row i's queries, keys, values and (diff-v2) λ-logits.
            let row_parts = |i: usize| {
                let row = &qkv[i * qkv_width..(i + 1) * qkv_width];
                let (q, rest) = row.split_at(q_out);
                let (k, rest) = rest.split_at(kv_out);
                let (v, lambda_logits) = rest.split_at(kv_out);
                (q, k, v, lambda_logits)
            };
            // Row i's keys (rotated with `k_rot`) and values into `seq`, its queries rotated into
            // `q_rot`.
            let write_row = |i: usize, seq: &mut SequenceCache, q_rot: &mut [f32], k_rot: &mut [f32]| {
                let (q, k, v, _) = row_parts(i);
                self.rope(q, pos[i], q_rot);
                self.rope(k, pos[i], k_rot);
                match &mut seq.store {
                    KvStore::F32(layers) => self.write_kv(layers, l, pos[i], k_rot, v),
                    KvStore::Bf16(layers) => self.write_kv(layers, l, pos[i], k_rot, v),
                    KvStore::Int8(layers) => self.write_kv(layers, l, pos[i], k_rot, v),
                }
            };
            // Output units `first ..` of row i (out: whole units) over `cache`.
            let attend_row =
                |i: usize, cache: LayerKv, q: &[f32], first: usize, scratch: &mut Scratch, out: &mut [f32]| {
                    let (lambda_logits, len) = (row_parts(i).3, pos[i] + 1);
                    out.fill(0.0);
                    match cache {
                        LayerKv::F32(c) => self.attend(&lw.mix, q, lambda_logits, c, len, first, scratch, out),
                        LayerKv::Bf16(c) => self.attend(&lw.mix, q, lambda_logits, c, len, first, scratch, out),
                        LayerKv::Int8(c) => self.attend(&lw.mix, q, lambda_logits, c, len, first, scratch, out),
                    }
                };
            if write_in_task {
                // Row i = sequence i: its task writes, then attends.
                let mut tasks: Vec<_> = att
                    .chunks_exact_mut(self.o_in)
                    .zip(q_rot.chunks_exact_mut(q_out))
                    .zip(seqs.iter_mut())
                    .map(|((out, q), seq)| (out, q, &mut **seq))
                    .collect();
                let run = |scratch: &mut Scratch,
                           i: usize,
                           (out, q, seq): &mut (&mut [f32], &mut [f32], &mut SequenceCache)| {
                    write_row(i, seq, q, &mut scratch.k_rot);
                    attend_row(i, seq.store.layer(l), q, 0, scratch, out);
                };
                for_each_task(parallel, &mut tasks, &mut scratch, new_scratch, run);
            } else {
                // Every row's keys and values into its sequence's cache first, in row order.
                for (i, &(s, _)) in rows.iter().enumerate() {
                    write_row(i, seqs[s], &mut q_rot[i * q_out..(i + 1) * q_out], &mut scratch.k_rot);
                }
                let caches: Vec<LayerKv> = seqs.iter().map(|s| s.store.layer(l)).collect();
                // Group `g` of row `i`: its output units from `g * units / groups` on.
                let attend_group = |scratch: &mut Scratch, task: usize, out: &mut [f32]| {
                    let (i, g) = (task / groups, task % groups);
                    let q = &q_rot[i * q_out..(i + 1) * q_out];
                    attend_row(i, caches[rows[i].0], q, g * units / groups, scratch, out)
                };
                let mut outs: Vec<&mut [f32]> = att.chunks_exact_mut(group_width).collect();
                for_each_task(parallel, &mut outs, &mut scratch, new_scratch, |scratch, task, out| {
                    attend_group(scratch, task, out)
                });
            }
            matmul_packed(&att, &lw.o_proj, &mut delta);
            residual_and_norm(&mut x, Some(&delta), &lw.post_norm, self.norm_eps, &mut h);
            matmul_packed(&h, &lw.gate_up, &mut gate_up);
            swiglu_all_rows(&gate_up, dff, &mut act);
            matmul_packed(&act, &lw.down, &mut delta);
            match self.layers.get(l + 1) {
                Some(next) => residual_and_norm(&mut x, Some(&delta), &next.input_norm, self.norm_eps, &mut h),
                None => add_into(&mut x, &delta),
            }
        }
        for (seq, &g) in seqs.iter_mut().zip(&gained) {
            seq.len += g;
        }
        // The head only for the rows whose logits are wanted.
        let mut last = Vec::with_capacity(logit_rows.len() * dm);
        for &i in logit_rows {
            last.extend_from_slice(&x[i * dm..(i + 1) * dm]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm_rows(&last, &self.final_norm, self.norm_eps, &mut normed);
        let mut logits = vec![0f32; logit_rows.len() * self.vocab];
        matmul_packed(&normed, &self.lm_head, &mut logits);
        Ok(logits)
    }

    /// Every head of `x` ([heads, d]) rotated to position `pos`, into `y`.
    fn rope(&self, x: &[f32], pos: usize, y: &mut [f32]) {
        let half = self.head_dim / 2;
        let (cos, sin) = (&self.cos[pos * half..(pos + 1) * half], &self.sin[pos * half..(pos + 1) * half]);
        rope_heads(x, y, cos, sin, self.head_dim, self.rope_style == RopeStyle::Interleaved);
    }

    /// Width of one attention output unit: a head (baseline, diff-v2's pair) or a diff-v1 pair.
    fn attention_unit_width(&self) -> usize {
        match self.layers.first().map(|l| &l.mix) {
            Some(Mix::DiffV1 { .. }) => 2 * self.head_dim,
            _ => self.head_dim,
        }
    }

    /// Output units `first ..` of one row's attention (`out`: whole units, zeroed) from its
    /// rotated queries `q` ([n_q, d]) over the first `len` cached positions.
    #[allow(clippy::too_many_arguments)]
    fn attend<E: KvElement>(
        &self,
        mix: &Mix,
        q: &[f32],
        lambda_logits: &[f32],
        cache: LayerCache<E>,
        len: usize,
        first: usize,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        let d = self.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let Scratch { p1, p2, pair, .. } = scratch;
        let (p1, p2) = (&mut p1[..len], &mut p2[..len]);
        let q_head = |i: usize| &q[i * d..(i + 1) * d];
        // Query head i's attention weights over kv head h into p; p's weighted sum of h's values
        // added to o.
        let scores = |i: usize, h: usize, p: &mut [f32]| {
            softmax_scores(q_head(i), self.head_cache(cache.keys, cache.key_scales, h), scale, p)
        };
        let add_values = |p: &[f32], h: usize, o: &mut [f32]| {
            weighted_values(p, self.head_cache(cache.values, cache.value_scales, h), o)
        };
        match mix {
            Mix::Baseline => {
                let group = self.n_q / self.n_kv;
                for (i, o) in (first..).zip(out.chunks_exact_mut(d)) {
                    scores(i, i / group, p1);
                    add_values(p1, i / group, o);
                }
            }
            Mix::DiffV1 { lambda, out_gain, normalise, eps } => {
                let group = self.n_q / self.n_kv; // pairs of queries per pair of kv heads
                for (j, o) in (first..).zip(out.chunks_exact_mut(2 * d)) {
                    let (qa, qb) = self.pairing.pair(j, self.n_q);
                    let (ka, kb) = self.pairing.pair(j / group, self.n_kv);
                    scores(qa, ka, p1);
                    scores(qb, kb, p2);
                    p1.iter_mut().zip(p2.iter()).for_each(|(a, b)| *a -= lambda * b);
                    // The pair's value is [v_ka | v_kb] (width 2d).
                    pair.fill(0.0);
                    let (o1, o2) = pair.split_at_mut(d);
                    add_values(p1, ka, o1);
                    add_values(p1, kb, o2);
                    if *normalise {
                        rms_norm_rows(pair, out_gain, *eps, o);
                    } else {
                        o.iter_mut().zip(pair.iter()).zip(out_gain).for_each(|((o, v), g)| *o = v * g);
                    }
                }
            }
            Mix::DiffV2 => {
                let group = self.n_q / self.n_kv; // even: a pair's two heads share a kv head
                for (j, o) in (first..).zip(out.chunks_exact_mut(d)) {
                    let lambda = 1.0 / (1.0 + (-lambda_logits[j]).exp());
                    let kv = 2 * j / group;
                    scores(2 * j, kv, p1);
                    scores(2 * j + 1, kv, p2);
                    p1.iter_mut().zip(p2.iter()).for_each(|(a, b)| *a -= lambda * b);
                    add_values(p1, kv, o);
                }
            }
        }
    }
}
