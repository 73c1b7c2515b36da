//! The decoder-only model: embedding, pre-norm blocks (attention + SwiGLU), final norm, LM head.
//!
//! One `Attention` serves all three families; they differ only in how the projected heads are
//! grouped into maps and how the maps are combined (docs/design.md §1). Weights are looked up by name from a
//! flat map (`model.layers.N.self_attn.q_proj.weight`, ...), the same names Hugging Face Llama and
//! DiffLlama use, so checkpoint code never reaches into the model.

pub mod decode;

use crate::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use crate::ops::{self, Kernels};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use std::collections::HashMap;

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal(f64),
    Ones,
}

/// Name, shape and initialisation of one parameter.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// Every parameter of a model with this config, in a fixed order (the init order).
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    let dm = cfg.d_model;
    let normal = Init::Normal(cfg.init_std);
    let mut specs = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, init: Init| specs.push(ParamSpec { name, shape, init });
    push("model.embed_tokens.weight".into(), vec![cfg.vocab_size, dm], normal);
    let shapes = cfg.attention_shapes();
    for l in 0..cfg.n_layers {
        let p = format!("model.layers.{l}");
        push(format!("{p}.input_layernorm.weight"), vec![dm], Init::Ones);
        push(format!("{p}.self_attn.q_proj.weight"), vec![shapes.q_out, dm], normal);
        push(format!("{p}.self_attn.k_proj.weight"), vec![shapes.kv_out, dm], normal);
        push(format!("{p}.self_attn.v_proj.weight"), vec![shapes.kv_out, dm], normal);
        push(format!("{p}.self_attn.o_proj.weight"), vec![dm, shapes.o_in], normal);
        if let Some(n) = shapes.lambda_vec {
            for name in ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"] {
                push(format!("{p}.self_attn.{name}"), vec![n], Init::Normal(cfg.lambda_std));
            }
        }
        if let Some(n) = shapes.subln_gain {
            push(format!("{p}.self_attn.subln.weight"), vec![n], Init::Ones);
        }
        if let Some(n) = shapes.lambda_proj_out {
            push(format!("{p}.self_attn.lambda_proj.weight"), vec![n, dm], normal);
        }
        push(format!("{p}.post_attention_layernorm.weight"), vec![dm], Init::Ones);
        push(format!("{p}.mlp.gate_proj.weight"), vec![cfg.d_ff, dm], normal);
        push(format!("{p}.mlp.up_proj.weight"), vec![cfg.d_ff, dm], normal);
        push(format!("{p}.mlp.down_proj.weight"), vec![dm, cfg.d_ff], normal);
    }
    push("model.norm.weight".into(), vec![dm], Init::Ones);
    if !cfg.tie_embeddings {
        push("lm_head.weight".into(), vec![cfg.vocab_size, dm], normal);
    }
    specs
}

/// Fresh weights, reproducible from `seed` (candle's own CPU RNG cannot be seeded).
pub fn init_weights(cfg: &ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    param_specs(cfg)
        .into_iter()
        .map(|spec| {
            let n: usize = spec.shape.iter().product();
            let data: Vec<f64> = match spec.init {
                Init::Ones => vec![1.0; n],
                Init::Normal(std) => {
                    let dist = Normal::new(0.0, std).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                    (0..n).map(|_| dist.sample(&mut rng)).collect()
                }
            };
            let t = Tensor::from_vec(data, spec.shape.as_slice(), device)?.to_dtype(dtype)?;
            Ok((spec.name, t))
        })
        .collect()
}

/// Looks weights up by name, checking shapes, with errors that name the tensor.
struct WeightSource<'a> {
    map: &'a HashMap<String, Tensor>,
}

impl WeightSource<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("missing weight '{name}' (expected shape {shape:?})")))?;
        if t.dims() != shape {
            candle_core::bail!("weight '{name}' has shape {:?}, the config expects {shape:?}", t.dims());
        }
        Ok(t.clone())
    }
}

/// RoPE cos/sin tables for positions 0..max_seq_len, [max_seq_len, d/2].
#[derive(Debug, Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl Rope {
    fn new(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let d = cfg.head_dim();
        let half = d / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
        let mut cos = Vec::with_capacity(cfg.max_seq_len * half);
        let mut sin = Vec::with_capacity(cfg.max_seq_len * half);
        for pos in 0..cfg.max_seq_len {
            for &f in &inv_freq {
                // In f32 models the angle is rounded as Hugging Face computes it (f32 inv_freq times
                // f32 position), so imported models match to the last bits; f64 models stay exact.
                let angle = if dtype == DType::F64 { pos as f64 * f } else { (pos as f32 * f as f32) as f64 };
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let shape = (cfg.max_seq_len, half);
        Ok(Rope {
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
            style: cfg.rope_style,
        })
    }

    /// Rotates x: [B, T, H, d] at positions offset..offset+T (fused kernel or composed ops).
    fn apply(&self, x: &Tensor, offset: usize, kernels: Kernels) -> Result<Tensor> {
        if kernels == Kernels::Fused {
            return difftx_kernels::rope(x, &self.cos, &self.sin, offset, self.style == RopeStyle::Interleaved);
        }
        let (b, t, h, d) = x.dims4()?;
        let half = d / 2;
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        match self.style {
            RopeStyle::Interleaved => {
                // Pairs (2i, 2i+1).
                let x = x.reshape((b, t, h, half, 2))?;
                let (x0, x1) = (x.narrow(4, 0, 1)?, x.narrow(4, 1, 1)?);
                let cos = cos.reshape((1, t, 1, half, 1))?;
                let sin = sin.reshape((1, t, 1, half, 1))?;
                let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
                let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
                Tensor::cat(&[y0, y1], 4)?.reshape((b, t, h, d))
            }
            RopeStyle::RotateHalf => {
                // Pairs (i, i + d/2).
                let (x0, x1) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
                let cos = cos.reshape((1, t, 1, half))?;
                let sin = sin.reshape((1, t, 1, half))?;
                let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
                let y1 = (x1.broadcast_mul(&cos)? + x0.broadcast_mul(&sin)?)?;
                Tensor::cat(&[y0, y1], 3)
            }
        }
    }

    /// Rotates x: [B, T, H, d] into the attention layout [B, H, T, d] (the fused kernel writes
    /// it there directly; the composed ops transpose after rotating).
    fn apply_to_heads(&self, x: &Tensor, offset: usize, kernels: Kernels) -> Result<Tensor> {
        if kernels == Kernels::Fused {
            let interleaved = self.style == RopeStyle::Interleaved;
            return difftx_kernels::rope_to_heads(x, &self.cos, &self.sin, offset, interleaved);
        }
        self.apply(x, offset, kernels)?.transpose(1, 2)?.contiguous()
    }
}

/// How a forward pass runs: kernels and the quantisation probes of the experiments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    pub kernels: Kernels,
    /// Fake-quantise attention logits (per query row, dynamic absmax) to this many bits before
    /// the softmax. Forces the materialised reference attention.
    pub attn_logit_bits: Option<u32>,
    /// Fake-quantise the input of every linear layer (per token, dynamic absmax): the "A" of WxAy.
    pub act_bits: Option<u32>,
    /// Arithmetic of the linear layers' f32 products (quantised weights ignore it).
    pub precision: ops::Precision,
}

/// Storage of the linear layers' weights for inference (training always uses f32 tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    /// 8-bit, blocks of 32 (ggml Q8_0).
    Q8_0,
    /// 4-bit k-quant, blocks of 256 (ggml Q4K); layers whose input width is not a multiple of
    /// 256 fall back to Q4_0 (4-bit, blocks of 32).
    Q4K,
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(WeightFormat::F32),
            "q8_0" | "q8" | "int8" => Ok(WeightFormat::Q8_0),
            "q4k" | "q4_k" | "int4" => Ok(WeightFormat::Q4K),
            _ => Err(format!("unknown weight format '{s}' (expected f32, q8_0 or q4k)")),
        }
    }
}

/// A bias-free linear layer: f32 weight [out, in], optionally a quantised copy used instead.
#[derive(Clone)]
struct Linear {
    w: Tensor,
    quantized: Option<candle_core::quantized::QMatMul>,
}

impl Linear {
    fn new(w: Tensor) -> Self {
        Linear { w, quantized: None }
    }

    /// Replaces the weight by a quantised copy; returns the ggml type used.
    fn quantize(&mut self, format: WeightFormat) -> Result<Option<candle_core::quantized::GgmlDType>> {
        use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
        let in_dim = self.w.dim(1)?;
        let dtype = match format {
            WeightFormat::F32 => {
                self.quantized = None;
                return Ok(None);
            }
            WeightFormat::Q8_0 if in_dim % 32 == 0 => GgmlDType::Q8_0,
            WeightFormat::Q4K if in_dim % 256 == 0 => GgmlDType::Q4K,
            WeightFormat::Q4K if in_dim % 32 == 0 => GgmlDType::Q4_0,
            _ => candle_core::bail!(
                "cannot quantise a layer of input width {in_dim} to {format:?}: needs a multiple of 32"
            ),
        };
        let q = QTensor::quantize(&self.w.to_dtype(DType::F32)?, dtype)?;
        self.quantized = Some(QMatMul::from_qtensor(q)?);
        Ok(Some(dtype))
    }
}

/// The linear layers that read one input as one product `x·[W1; W2; ..]ᵀ`, `[N, Σ out]`: one pass
/// over x and one `dx` product instead of one per layer. `None` (run them one by one) where a
/// weight is quantised or the reference kernels run.
fn joined_linear(x: &Tensor, ws: &[&Linear], opts: &RunOptions) -> Result<Option<Tensor>> {
    if opts.kernels == Kernels::Reference || ws.iter().any(|w| w.quantized.is_some()) {
        return Ok(None);
    }
    let w = Tensor::cat(&ws.iter().map(|w| &w.w).collect::<Vec<_>>(), 0)?;
    Ok(Some(linear(x, &Linear::new(w), opts)?))
}

/// x: [N, in] times w: [out, in] -> [N, out] (PyTorch's Linear layout, no bias).
fn linear(x: &Tensor, w: &Linear, opts: &RunOptions) -> Result<Tensor> {
    use candle_core::Module;
    let x = match opts.act_bits {
        Some(bits) => ops::fake_quant_absmax(x, bits)?,
        None => x.clone(),
    };
    match &w.quantized {
        Some(q) => q.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype()),
        None => ops::linear_matmul(&x, &w.w, opts.precision, opts.kernels),
    }
}

/// Per-layer key/value cache for incremental decoding; k, v stored as [B, Hkv, S, d].
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        KvCache { layers: (0..cfg.n_layers).map(|_| candle_nn::kv_cache::KvCache::new(2, cfg.max_seq_len)).collect() }
    }
    /// Number of positions already cached.
    pub fn seq_len(&self) -> usize {
        self.layers.first().map(|c| c.current_seq_len()).unwrap_or(0)
    }
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(|c| c.reset());
    }
}

/// What a forward pass may record for analysis (experiments, interop checks).
#[derive(Default)]
pub struct Probe {
    pub capture_hidden: bool,
    pub capture_attention: bool,
    /// Embedding output, then each block's output (before the final norm).
    pub hidden: Vec<Tensor>,
    /// Per layer: raw attention logits q·kᵀ·scale of every map, [B, maps, T, S] (no mask).
    pub attn_logits: Vec<Tensor>,
    /// Per layer: the effective attention map [B, heads, T, S] (diff: A1 - lambda·A2).
    pub attn_maps: Vec<Tensor>,
    /// Per layer lambda: diff-v1 scalar `[1]`; diff-v2 per token and pair `[B, H, T]`; baseline none.
    pub lambdas: Vec<Option<Tensor>>,
}

/// Everything one layer needs to know about the current call besides its input.
struct Step<'a> {
    /// Batch B and new tokens T of this call.
    batch: usize,
    len: usize,
    /// Absolute position of the first new token (the number of cached tokens before it).
    offset: usize,
    rope: &'a Rope,
    opts: &'a RunOptions,
}

/// One layer's projected and rotated heads, shared by the attention maths and the probe.
/// q: [B, n_q, T, d]; k, v: [B, n_kv, S, d] with S = offset + T (the cache included).
struct Heads {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

/// The sub-layer RMSNorm of diff-v1 over each head's 2d features (the paper's "GroupNorm").
enum SubLayerNorm {
    /// The "DIFF without GroupNorm" ablation (`subln: false`).
    Off,
    /// Norm without gain (`subln_affine: false`, Hugging Face DiffLlama).
    Plain,
    /// Norm with one learnable gain of size 2d shared by all heads (official code).
    Gain(Tensor),
}

/// What a diff-v1 layer owns beyond the projections.
struct DiffV1 {
    /// λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, four vectors of dim d.
    lambda_q1: Tensor,
    lambda_k1: Tensor,
    lambda_q2: Tensor,
    lambda_k2: Tensor,
    /// λ_init(l) = 0.8 − 0.6·exp(−0.3·l) of this layer.
    lambda_init: f64,
    subln: SubLayerNorm,
    subln_eps: f64,
}

impl DiffV1 {
    /// The layer's λ: one scalar shared by all heads, shape [1], differentiable.
    fn lambda(&self) -> Result<Tensor> {
        let dot_exp = |a: &Tensor, b: &Tensor| -> Result<Tensor> { (a * b)?.sum_keepdim(0)?.exp() };
        (dot_exp(&self.lambda_q1, &self.lambda_k1)? - dot_exp(&self.lambda_q2, &self.lambda_k2)?)? + self.lambda_init
    }

    /// (1 − λ_init)·SubLN(o) for o: [B, H/2, T, 2d].
    ///
    /// Implementation detail: on the fused path the factor (1 − λ_init) is folded into the gain
    /// of the fused RMSNorm (g·(1 − λ_init), or a constant gain when the norm has none), so norm
    /// and scale are one kernel; the reference path applies them one after the other as written.
    fn norm_and_scale(&self, o: &Tensor, kernels: Kernels) -> Result<Tensor> {
        let scale = 1.0 - self.lambda_init;
        let gain = match &self.subln {
            SubLayerNorm::Off => return o * scale,
            SubLayerNorm::Plain => None,
            SubLayerNorm::Gain(g) => Some(g),
        };
        match kernels {
            Kernels::Reference => ops::rms_norm(o, gain, self.subln_eps, kernels)? * scale,
            Kernels::Fused => {
                let folded = match gain {
                    Some(g) => (g * scale)?,
                    None => Tensor::full(scale, o.dim(3)?, o.device())?.to_dtype(o.dtype())?,
                };
                ops::rms_norm(o, Some(&folded), self.subln_eps, kernels)
            }
        }
    }
}

enum AttnKind {
    Baseline,
    DiffV1(DiffV1),
    /// λ_{t,j} = sigmoid(x_t · W_λ[:, j]), W_λ: [H, D].
    DiffV2 {
        lambda_proj: Linear,
    },
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    kind: AttnKind,
    /// Which two projected heads form the two maps of a differential head (diff-v1).
    pairing: HeadPairing,
    n_q: usize,
    n_kv: usize,
    head_dim: usize,
}

impl Attention {
    fn load(w: &WeightSource, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let p = format!("model.layers.{layer}.self_attn");
        let dm = cfg.d_model;
        let s = cfg.attention_shapes();
        let kind = match cfg.family {
            Family::Baseline => AttnKind::Baseline,
            Family::DiffV1 => {
                let d = s.head_dim;
                let subln = match (cfg.subln, s.subln_gain) {
                    (false, _) => SubLayerNorm::Off,
                    (true, None) => SubLayerNorm::Plain,
                    (true, Some(n)) => SubLayerNorm::Gain(w.get(&format!("{p}.subln.weight"), &[n])?),
                };
                AttnKind::DiffV1(DiffV1 {
                    lambda_q1: w.get(&format!("{p}.lambda_q1"), &[d])?,
                    lambda_k1: w.get(&format!("{p}.lambda_k1"), &[d])?,
                    lambda_q2: w.get(&format!("{p}.lambda_q2"), &[d])?,
                    lambda_k2: w.get(&format!("{p}.lambda_k2"), &[d])?,
                    lambda_init: ModelConfig::lambda_init(layer),
                    subln,
                    subln_eps: cfg.subln_eps,
                })
            }
            Family::DiffV2 => {
                let h = s.lambda_proj_out.unwrap_or(cfg.n_heads);
                AttnKind::DiffV2 { lambda_proj: Linear::new(w.get(&format!("{p}.lambda_proj.weight"), &[h, dm])?) }
            }
        };
        Ok(Attention {
            q_proj: Linear::new(w.get(&format!("{p}.q_proj.weight"), &[s.q_out, dm])?),
            k_proj: Linear::new(w.get(&format!("{p}.k_proj.weight"), &[s.kv_out, dm])?),
            v_proj: Linear::new(w.get(&format!("{p}.v_proj.weight"), &[s.kv_out, dm])?),
            o_proj: Linear::new(w.get(&format!("{p}.o_proj.weight"), &[dm, s.o_in])?),
            kind,
            pairing: cfg.head_pairing,
            n_q: s.n_q,
            n_kv: s.n_kv,
            head_dim: s.head_dim,
        })
    }

    /// x: [B·T, D] -> [B·T, D]. When the probe asks for attention, a separate pass records the
    /// maps from the same projected heads before the output is computed.
    fn forward(
        &self,
        x: &Tensor,
        step: &Step,
        cache: Option<&mut candle_nn::kv_cache::KvCache>,
        probe: Option<&mut Probe>,
    ) -> Result<Tensor> {
        let heads = self.project(x, step, cache)?;
        if let Some(p) = probe.filter(|p| p.capture_attention) {
            self.capture(x, &heads, step, p)?;
        }
        let out = self.combine(x, &heads, step)?; // [B, heads, T, width]
        let (_, n, _, width) = out.dims4()?;
        let out = ops::swap_dims12(&out, step.opts.kernels)?.reshape((step.batch * step.len, n * width))?;
        linear(&out, &self.o_proj, step.opts)
    }

    /// Q, K, V projections, RoPE at absolute positions, and the KV cache.
    fn project(&self, x: &Tensor, step: &Step, cache: Option<&mut candle_nn::kv_cache::KvCache>) -> Result<Heads> {
        let (b, t, d, opts) = (step.batch, step.len, self.head_dim, step.opts);
        let (n_q, n_kv) = (self.n_q, self.n_kv);
        let (q, k, v) = match joined_linear(x, &[&self.q_proj, &self.k_proj, &self.v_proj], opts)? {
            // Every position's q, k and v heads side by side, [B, T, Hq + 2Hkv, d]: the kernels
            // below read each part in place, and its gradient comes back into one buffer
            // (vendor/README.md).
            Some(qkv) => {
                let qkv = qkv.reshape((b, t, n_q + 2 * n_kv, d))?;
                (qkv.narrow(2, 0, n_q)?, qkv.narrow(2, n_q, n_kv)?, qkv.narrow(2, n_q + n_kv, n_kv)?)
            }
            None => (
                linear(x, &self.q_proj, opts)?.reshape((b, t, n_q, d))?,
                linear(x, &self.k_proj, opts)?.reshape((b, t, n_kv, d))?,
                linear(x, &self.v_proj, opts)?.reshape((b, t, n_kv, d))?,
            ),
        };
        // [B, T, heads, d] -> [B, heads, T, d]
        let q = step.rope.apply_to_heads(&q, step.offset, opts.kernels)?;
        let k = step.rope.apply_to_heads(&k, step.offset, opts.kernels)?;
        let v = ops::swap_dims12(&v, opts.kernels)?;
        let (k, v) = match cache {
            Some(c) => c.append(&k, &v)?,
            None => (k, v),
        };
        Ok(Heads { q, k, v })
    }

    /// The family's attention, in the paper's order. Returns [B, heads, T, width] before o_proj.
    fn combine(&self, x: &Tensor, heads: &Heads, step: &Step) -> Result<Tensor> {
        let Heads { q, k, v } = heads;
        match &self.kind {
            // O = softmax(Q Kᵀ/√d + mask) V                                   [B, H, T, d]
            AttnKind::Baseline => self.attend(q, k, v, step),
            AttnKind::DiffV1(diff) if self.pairs_in_one_op(step) => {
                // The same equations as below, with both maps of every pair in one attention over
                // all H query heads, unsplit: query pair (a, b) reads kv pair (a', b') and its
                // value [v1, v2]; the fused kernel's backward shares dO·Vᵀ and dV between the
                // two maps (docs/design.md §5).
                let lambda = diff.lambda()?;
                let (scale, kernels) = (self.scale(), step.opts.kernels);
                let (pairing, precision) = (self.pairing, step.opts.precision);
                let o = ops::diff_attention(q, k, v, &lambda, pairing, scale, step.offset, kernels, precision)?; // [B, H/2, T, 2d]
                diff.norm_and_scale(&o, step.opts.kernels)
            }
            AttnKind::DiffV1(diff) => {
                let (q1, q2) = ops::split_pairs(q, self.pairing)?; // [B, H/2, T, d] each
                let (k1, k2) = ops::split_pairs(k, self.pairing)?; // [B, Hkv/2, S, d] each
                let v = self.pair_values(v)?; // [B, Hkv/2, S, 2d]
                let lambda = diff.lambda()?; // [1]

                // (A1 − λ·A2) V = A1 V − λ·A2 V                              [B, H/2, T, 2d]
                let o1 = self.attend(&q1, &k1, &v, step)?;
                let o2 = self.attend(&q2, &k2, &v, step)?;
                let o = ops::diff_combine(&o1, &o2, &lambda, step.opts.kernels)?;
                // (1 − λ_init)·SubLN(O)
                diff.norm_and_scale(&o, step.opts.kernels)
            }
            AttnKind::DiffV2 { lambda_proj } => {
                let lambda = self.token_lambda(x, lambda_proj, step)?; // [B, H, T, 1]
                if self.pairs_in_one_op(step) {
                    // The same equations as below in one op whose backward shares dO·Vᵀ and dV
                    // between the two maps of a pair, which read one kv head (docs/design.md §5).
                    let (kernels, precision) = (step.opts.kernels, step.opts.precision);
                    return ops::diff_v2_attention(q, k, v, &lambda, self.scale(), step.offset, kernels, precision);
                }
                // One attention over all 2H query heads; pair j = heads (2j, 2j+1)      [B, 2H, T, d]
                let o = self.attend(q, k, v, step)?;
                // O_j = attn_{2j} − λ_{t,j}·attn_{2j+1}                              [B, H, T, d]
                ops::diff_combine_pairs(&o, &lambda, HeadPairing::Interleaved, step.opts.kernels)
            }
        }
    }

    /// diff-v2's λ_{t,j} = sigmoid(x_t · W_λ[:, j]): [B, H, T, 1].
    fn token_lambda(&self, x: &Tensor, lambda_proj: &Linear, step: &Step) -> Result<Tensor> {
        let h = self.n_q / 2;
        candle_nn::ops::sigmoid(&linear(x, lambda_proj, step.opts)?)?
            .reshape((step.batch, step.len, h))?
            .transpose(1, 2)?
            .unsqueeze(3)
    }

    /// diff-v1's value of head j: the kv pair's two value heads side by side, [B, Hkv/2, S, 2d].
    fn pair_values(&self, v: &Tensor) -> Result<Tensor> {
        let (v1, v2) = ops::split_pairs(v, self.pairing)?;
        Tensor::cat(&[v1, v2], 3)
    }

    /// Whether a differential family runs both maps of every pair in one fused op: fused
    /// kernels, no logit quantisation probe, and a head layout the op takes under flash's GQA
    /// rule (query head h reads kv head h / (Hq / Hkv)). diff-v1: each map must reach its own
    /// pair's key head, true for pairs (j, j + H/2) at any GQA ratio and for pairs (2j, 2j + 1)
    /// only without GQA. diff-v2: both heads of pair (2j, 2j + 1) must read one kv head, true when
    /// each kv head serves an even number of query heads.
    fn pairs_in_one_op(&self, step: &Step) -> bool {
        let layout_fits = match self.kind {
            AttnKind::Baseline => false,
            AttnKind::DiffV1(_) => self.pairing == HeadPairing::Halves || self.n_q == self.n_kv,
            AttnKind::DiffV2 { .. } => (self.n_q / self.n_kv).is_multiple_of(2),
        };
        step.opts.kernels == Kernels::Fused && step.opts.attn_logit_bits.is_none() && layout_fits
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// The single-map attention primitive softmax(q kᵀ/√d + mask) v, honouring the logit-
    /// quantisation probe.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, step: &Step) -> Result<Tensor> {
        match step.opts.attn_logit_bits {
            Some(bits) => ops::attention_quantized_logits(q, k, v, self.scale(), step.offset, bits),
            None => ops::attention(q, k, v, self.scale(), step.offset, step.opts.kernels, step.opts.precision),
        }
    }

    /// Materialised attention maps softmax(q kᵀ/√d + mask): [B, heads, T, S].
    fn probs(&self, q: &Tensor, k: &Tensor, step: &Step) -> Result<Tensor> {
        match step.opts.attn_logit_bits {
            Some(bits) => ops::quantized_probs(q, k, self.scale(), step.offset, bits),
            None => ops::attention_probs(q, k, self.scale(), step.offset, step.opts.kernels),
        }
    }

    /// The analysis pass: records this layer's raw logits of every map, its effective attention
    /// maps (A1 − λ·A2 for the differential families) and its λ into the probe.
    fn capture(&self, x: &Tensor, heads: &Heads, step: &Step, probe: &mut Probe) -> Result<()> {
        let Heads { q, k, .. } = heads;
        let scale = self.scale();
        let (logits, map, lambda) = match &self.kind {
            AttnKind::Baseline => (ops::attention_scores(q, k, scale)?, self.probs(q, k, step)?, None),
            AttnKind::DiffV1(diff) => {
                let (q1, q2) = ops::split_pairs(q, self.pairing)?;
                let (k1, k2) = ops::split_pairs(k, self.pairing)?;
                let lambda = diff.lambda()?;
                let (s1, s2) = (ops::attention_scores(&q1, &k1, scale)?, ops::attention_scores(&q2, &k2, scale)?);
                let (a1, a2) = (self.probs(&q1, &k1, step)?, self.probs(&q2, &k2, step)?);
                let logits = Tensor::cat(&[s1, s2], 1)?; // [B, H, T, S]: all Q1 maps, then all Q2 maps
                (logits, a1.broadcast_sub(&a2.broadcast_mul(&lambda)?)?, Some(lambda))
            }
            AttnKind::DiffV2 { lambda_proj } => {
                let lambda = self.token_lambda(x, lambda_proj, step)?; // [B, H, T, 1]
                let (a1, a2) = ops::split_pairs(&self.probs(q, k, step)?, HeadPairing::Interleaved)?;
                let map = a1.broadcast_sub(&a2.broadcast_mul(&lambda)?)?;
                (ops::attention_scores(q, k, scale)?, map, Some(lambda.squeeze(3)?))
            }
        };
        probe.attn_logits.push(logits);
        probe.attn_maps.push(map);
        probe.lambdas.push(lambda);
        Ok(())
    }
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor, opts: &RunOptions) -> Result<Tensor> {
        let (gate, up) = (linear(x, &self.gate, opts)?, linear(x, &self.up, opts)?);
        let h = match opts.kernels {
            Kernels::Fused => difftx_kernels::swiglu(&gate, &up)?,
            Kernels::Reference => (candle_nn::ops::silu(&gate)? * up)?,
        };
        linear(&h, &self.down, opts)
    }
}

struct Block {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// A decoder-only language model of any family.
pub struct Model {
    cfg: ModelConfig,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    rope: Rope,
    /// Kernels and quantisation probes used by every forward pass.
    pub opts: RunOptions,
}

impl Model {
    /// Builds a model from named weights (shapes checked against the config).
    pub fn from_weights(cfg: &ModelConfig, weights: &HashMap<String, Tensor>) -> Result<Self> {
        cfg.validate().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let w = WeightSource { map: weights };
        let dm = cfg.d_model;
        let embed = w.get("model.embed_tokens.weight", &[cfg.vocab_size, dm])?;
        let (dtype, device) = (embed.dtype(), embed.device().clone());
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = format!("model.layers.{l}");
            blocks.push(Block {
                input_norm: w.get(&format!("{p}.input_layernorm.weight"), &[dm])?,
                attn: Attention::load(&w, cfg, l)?,
                post_norm: w.get(&format!("{p}.post_attention_layernorm.weight"), &[dm])?,
                mlp: Mlp {
                    gate: Linear::new(w.get(&format!("{p}.mlp.gate_proj.weight"), &[cfg.d_ff, dm])?),
                    up: Linear::new(w.get(&format!("{p}.mlp.up_proj.weight"), &[cfg.d_ff, dm])?),
                    down: Linear::new(w.get(&format!("{p}.mlp.down_proj.weight"), &[dm, cfg.d_ff])?),
                },
            });
        }
        let lm_head = Linear::new(if cfg.tie_embeddings {
            embed.clone()
        } else {
            w.get("lm_head.weight", &[cfg.vocab_size, dm])?
        });
        Ok(Model {
            cfg: cfg.clone(),
            norm: w.get("model.norm.weight", &[dm])?,
            embed,
            blocks,
            lm_head,
            rope: Rope::new(cfg, dtype, &device)?,
            opts: RunOptions::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Logits [B, T, V] for token ids [B, T] (u32). With a cache, the ids continue the cached
    /// sequence and are appended to it.
    pub fn forward(&self, ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        self.forward_probe(ids, cache, None)
    }

    /// As `forward`, recording what `probe` asks for.
    pub fn forward_probe(
        &self,
        ids: &Tensor,
        cache: Option<&mut KvCache>,
        probe: Option<&mut Probe>,
    ) -> Result<Tensor> {
        let h = self.hidden_states(ids, cache, probe)?;
        let (b, t, dm) = h.dims3()?;
        linear(&h.reshape((b * t, dm))?, &self.lm_head, &self.opts)?.reshape((b, t, self.cfg.vocab_size))
    }

    /// Final-normed hidden states [B, T, D].
    pub fn hidden_states(
        &self,
        ids: &Tensor,
        mut cache: Option<&mut KvCache>,
        mut probe: Option<&mut Probe>,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let offset = cache.as_ref().map(|c| c.seq_len()).unwrap_or(0);
        if offset + t > self.cfg.max_seq_len {
            candle_core::bail!(
                "sequence of {} tokens is longer than the model's context of {} tokens",
                offset + t,
                self.cfg.max_seq_len
            );
        }
        let opts = self.opts;
        let kernels = opts.kernels;
        let mut x = self.embed.index_select(&ids.flatten_all()?, 0)?; // [B·T, D]
        let capture_hidden = probe.as_ref().is_some_and(|p| p.capture_hidden);
        if capture_hidden {
            if let Some(p) = probe.as_deref_mut() {
                p.hidden.push(x.reshape((b, t, self.cfg.d_model))?);
            }
        }
        let step = Step { batch: b, len: t, offset, rope: &self.rope, opts: &opts };
        for (l, block) in self.blocks.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[l]);
            let h = ops::rms_norm(&x, Some(&block.input_norm), self.cfg.norm_eps, kernels)?;
            let a = block.attn.forward(&h, &step, layer_cache, probe.as_deref_mut())?;
            let y = (x + a)?;
            let h = ops::rms_norm(&y, Some(&block.post_norm), self.cfg.norm_eps, kernels)?;
            x = (&y + block.mlp.forward(&h, &opts)?)?;
            if capture_hidden {
                if let Some(p) = probe.as_deref_mut() {
                    p.hidden.push(x.reshape((b, t, self.cfg.d_model))?);
                }
            }
        }
        ops::rms_norm(&x, Some(&self.norm), self.cfg.norm_eps, kernels)?.reshape((b, t, self.cfg.d_model))
    }

    /// One layer's attention sub-layer alone (no input norm, no residual, no cache) on hidden
    /// states x: [B, T, D] -> [B, T, D]. The unit of work of the attn-long benchmark.
    pub fn layer_attention(&self, layer: usize, x: &Tensor) -> Result<Tensor> {
        let (b, t, dm) = x.dims3()?;
        let Some(block) = self.blocks.get(layer) else { candle_core::bail!("the model has no layer {layer}") };
        let x = x.reshape((b * t, dm))?;
        let step = Step { batch: b, len: t, offset: 0, rope: &self.rope, opts: &self.opts };
        let y = block.attn.forward(&x, &step, None, None)?;
        y.reshape((b, t, dm))
    }

    /// Mean next-token cross-entropy (nats) of logits [B, T, V] against targets [B, T].
    pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t, v) = logits.dims3()?;
        let logits = logits.reshape((b * t, v))?;
        let logits = if logits.dtype() == DType::F64 { logits } else { logits.to_dtype(DType::F32)? };
        // One pass over the vocabulary for the loss and one for its gradient (difftx-kernels),
        // tested against candle-nn's composed log-softmax + gather + mean.
        difftx_kernels::cross_entropy(&logits, &targets.flatten_all()?)
    }

    /// Quantises every linear layer (projections, SwiGLU, LM head) for inference; the embedding
    /// and the norms stay f32. Returns a count of layers per ggml type used. Not for training:
    /// quantised layers have no gradient.
    pub fn quantize_weights(&mut self, format: WeightFormat) -> Result<std::collections::BTreeMap<String, usize>> {
        let mut used = std::collections::BTreeMap::new();
        let mut layers: Vec<&mut Linear> = vec![&mut self.lm_head];
        for b in self.blocks.iter_mut() {
            let a = &mut b.attn;
            layers.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]);
            if let AttnKind::DiffV2 { lambda_proj } = &mut a.kind {
                layers.push(lambda_proj);
            }
            layers.extend([&mut b.mlp.gate, &mut b.mlp.up, &mut b.mlp.down]);
        }
        for l in layers {
            let name = match l.quantize(format)? {
                Some(t) => format!("{t:?}"),
                None => "F32".to_string(),
            };
            *used.entry(name).or_insert(0) += 1;
        }
        Ok(used)
    }

    /// The current lambda of each layer: diff-v1 only (diff-v2's lambda depends on the token).
    pub fn lambdas(&self) -> Result<Vec<f64>> {
        self.blocks
            .iter()
            .filter_map(|b| match &b.attn.kind {
                AttnKind::DiffV1(diff) => {
                    Some(diff.lambda().and_then(|l| l.to_dtype(DType::F64)?.squeeze(0)?.to_scalar::<f64>()))
                }
                _ => None,
            })
            .collect()
    }
}

/// Convenience: the last position's logits as a `Vec<f32>` for sampling, from `[1, T, V]`.
pub fn last_logits(logits: &Tensor) -> Result<Vec<f32>> {
    let t = logits.dim(1)?;
    logits.i((0, t - 1))?.to_dtype(DType::F32)?.to_vec1::<f32>()
}
