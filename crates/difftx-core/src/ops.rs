//! Numeric building blocks the model calls, each in two implementations:
//! `Reference` (composed candle ops: slow, obviously right, differentiable) and `Fused`
//! (difftx-kernels custom ops with hand-written backward). The model picks one per instance, so
//! tests can compare the two paths on the same weights.

use crate::config::HeadPairing;
use candle_core::{DType, Device, IndexOp, Result, Tensor, D};
use difftx_kernels::TileProducts;

/// Which implementation of the hot ops a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Composed candle ops (autograd through every primitive).
    Reference,
    /// difftx-kernels custom ops with their own backward (flash attention, softmax, RMSNorm,
    /// RoPE).
    #[default]
    Fused,
}

/// Arithmetic of the matrix products: the linear layers' and the fused attention kernels' tiles
/// (everything else is f32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    /// Inputs rounded to bf16, products summed in f32 (AMX or AVX512_BF16): mixed-precision
    /// training's matmuls, in the linear layers and in the fused attention kernels' tiles
    /// (scores, P·V and their gradients; the softmax stays f32). Weights, activations between
    /// ops, gradients and optimizer state stay f32. Needs a bf16 backend (`difftx_kernels::bf16_backend`);
    /// [`Precision::resolve`] keeps it only where that backend outpaces f32.
    Bf16,
    /// The arithmetic of `Bf16` (same roundings, gradients included) by f32 gemm on rounded
    /// copies in the linear layers: any CPU, no faster than f32; the reference the bf16 kernel
    /// is checked against. The attention tiles round the same way as under `Bf16` (through
    /// `vdpbf16ps` where the CPU has it, rounded copies elsewhere).
    Bf16Emulated,
}

impl Precision {
    /// Whether `Bf16` runs as bf16 here: the CPU has a bf16 matrix-product backend (AMX-BF16 or
    /// AVX512_BF16) and it outpaces f32 (`difftx_kernels::bf16_outpaces_f32`: not Intel's
    /// AVX512_BF16 without AMX). The model runs `Bf16` wherever a backend exists; this is the
    /// policy of [`Precision::resolve`].
    pub fn bf16_faster_than_f32() -> bool {
        difftx_kernels::bf16_faster_than_f32()
    }

    /// What `self` runs as here, with a sentence for the user when bf16 was asked for but the
    /// CPU has no backend faster than f32 (then f32).
    pub fn resolve(self) -> (Precision, Option<String>) {
        match self {
            Precision::Bf16 if !Self::bf16_faster_than_f32() => (Precision::F32, Some(Self::bf16_fallback_reason())),
            p => (p, None),
        }
    }

    /// Why `Bf16` runs as f32 on this CPU.
    fn bf16_fallback_reason() -> String {
        if difftx_kernels::bf16_backend().is_some() {
            "bf16 precision: this CPU has no usable AMX, and its AVX512_BF16 dot products run at half \
             its f32 FMA rate (Intel), so bf16 products would be slower than f32; running in f32 \
             (DIFFTX_BF16_BACKEND=avx512_bf16 runs them anyway)"
                .into()
        } else {
            "bf16 precision: this CPU has neither AMX-BF16 nor AVX512_BF16; running in f32".into()
        }
    }

    /// How the fused attention kernels multiply their tiles at this precision.
    pub fn tile_products(self) -> TileProducts {
        match self {
            Precision::F32 => TileProducts::Native,
            Precision::Bf16 | Precision::Bf16Emulated => TileProducts::Bf16,
        }
    }

    /// "f32", or "bf16 (amx)" / "bf16 (avx512_bf16)": what reports record.
    pub fn describe(self) -> String {
        match (self, difftx_kernels::bf16_backend()) {
            (Precision::F32, _) => "f32".into(),
            (Precision::Bf16, Some(difftx_kernels::Bf16Backend::Amx)) => "bf16 (amx)".into(),
            (Precision::Bf16, Some(difftx_kernels::Bf16Backend::Avx512Bf16)) => "bf16 (avx512_bf16)".into(),
            (Precision::Bf16, None) => "bf16 (unavailable)".into(),
            (Precision::Bf16Emulated, _) => "bf16 (emulated in f32)".into(),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "bf16-emulated" => Ok(Precision::Bf16Emulated),
            _ => Err(format!("unknown precision '{s}' (expected f32, bf16 or bf16-emulated)")),
        }
    }
}

/// x [N, in] times wᵀ (w [out, in]) at `precision`. In f32 the fused kernel's backward writes
/// the weight's gradient in w's layout (candle's product gets it as a transposed view and copies
/// it); the composed product is the reference.
pub fn linear_matmul(x: &Tensor, w: &Tensor, precision: Precision, kernels: Kernels) -> Result<Tensor> {
    match precision {
        Precision::F32 if kernels == Kernels::Fused && matches!(x.dtype(), DType::F32 | DType::F64) => {
            difftx_kernels::linear(x, w)
        }
        Precision::F32 => x.matmul(&w.t()?),
        Precision::Bf16 => difftx_kernels::linear_bf16(x, w),
        Precision::Bf16Emulated => difftx_kernels::linear_bf16_emulated(x, w),
    }
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::softmax_last_dim(x),
        Kernels::Reference => {
            let max = x.max_keepdim(D::Minus1)?;
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
    }
}

/// RMSNorm over the last dimension with an optional gain, statistics in at least f32.
pub fn rms_norm(x: &Tensor, gain: Option<&Tensor>, eps: f64, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::rms_norm(x, gain, eps),
        Kernels::Reference => {
            let dtype = x.dtype();
            let xf = if dtype == DType::F64 { x.clone() } else { x.to_dtype(DType::F32)? };
            let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
            let y = xf.broadcast_div(&(ms + eps)?.sqrt()?)?.to_dtype(dtype)?;
            match gain {
                Some(g) => y.broadcast_mul(g),
                None => Ok(y),
            }
        }
    }
}

/// x [B, N1, N2, d] -> [B, N2, N1, d], contiguous (the projections' [B, T, heads, d] and the
/// attention kernels' [B, heads, T, d]); the kernel is one parallel copy each way.
pub fn swap_dims12(x: &Tensor, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::swap_dims12(x),
        Kernels::Reference => x.transpose(1, 2)?.contiguous(),
    }
}

/// Splits the head axis (dim 1) of [B, heads, T, d] into the two maps of each pair (docs/design.md §3).
pub fn split_pairs(x: &Tensor, pairing: HeadPairing) -> Result<(Tensor, Tensor)> {
    let (b, heads, t, d) = x.dims4()?;
    let half = heads / 2;
    match pairing {
        HeadPairing::Interleaved => {
            let x = x.reshape((b, half, 2, t, d))?;
            Ok((x.i((.., .., 0))?, x.i((.., .., 1))?))
        }
        HeadPairing::Halves => Ok((x.narrow(1, 0, half)?, x.narrow(1, half, half)?)),
    }
}

/// diff-v1's value of every head for one attention over the unsplit heads: v [B, heads, S, d] ->
/// [B, heads, S, 2d], head i holding [v_a, v_b] of the pair (a, b) it belongs to (pairs as
/// `pairing` says), so that query head i of pair (a, b) reads the pair's value through its own kv
/// head (docs/design.md §5).
pub fn pair_values_per_head(v: &Tensor, pairing: HeadPairing, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::pair_values(v, pair_layout(pairing)),
        Kernels::Reference => {
            let (v1, v2) = split_pairs(v, pairing)?;
            let pv = Tensor::cat(&[v1, v2], 3)?; // [B, heads/2, S, 2d]
            match pairing {
                // heads (j, j + heads/2) form pair j
                HeadPairing::Halves => Tensor::cat(&[&pv, &pv], 1),
                // heads (2j, 2j + 1) form pair j
                HeadPairing::Interleaved => {
                    let (b, p, s, w) = pv.dims4()?;
                    pv.unsqueeze(2)?.broadcast_as((b, p, 2, s, w))?.reshape((b, 2 * p, s, w))
                }
            }
        }
    }
}

/// diff-v1's attention over unsplit heads, z_j = A_a V_p − λ·A_b V_p for every query pair
/// j = (a, b), V_p the value [v_a', v_b'] of the kv pair its heads read: q [B, H, T, d],
/// k, v [B, Hkv, S, d], λ one element -> [B, H/2, T, 2d]. The two heads of a query pair must read
/// the two heads of one kv pair (pairs (j, j + H/2) at any GQA ratio, (2j, 2j + 1) without GQA;
/// docs/design.md §5). The fused kernel shares dO·Vᵀ and dV between a pair's maps in its backward.
#[allow(clippy::too_many_arguments)]
pub fn diff_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lambda: &Tensor,
    pairing: HeadPairing,
    scale: f64,
    q_offset: usize,
    kernels: Kernels,
    precision: Precision,
) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => {
            let (layout, products) = (pair_layout(pairing), precision.tile_products());
            difftx_kernels::diff_attention(q, k, v, lambda, layout, scale, q_offset, products)
        }
        Kernels::Reference => {
            let v = pair_values_per_head(v, pairing, kernels)?; // [B, Hkv, S, 2d]
            let o = attention(q, k, &v, scale, q_offset, kernels, precision)?; // [B, H, T, 2d]
            diff_combine_pairs(&o, lambda, pairing, kernels)
        }
    }
}

/// diff-v2's attention, z_j = A_{2j} V_g − λ_j·A_{2j+1} V_g for every query pair j, g the kv
/// head both its heads read: q [B, 2H, T, d], k, v [B, Hkv, S, d], λ [B, H, T, 1] ->
/// [B, H, T, d]. Each kv head must serve an even number of query heads. The fused kernel shares
/// dO·Vᵀ and dV between a pair's maps in its backward (docs/design.md §5).
#[allow(clippy::too_many_arguments)]
pub fn diff_v2_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lambda: &Tensor,
    scale: f64,
    q_offset: usize,
    kernels: Kernels,
    precision: Precision,
) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => {
            difftx_kernels::diff_v2_attention(q, k, v, lambda, scale, q_offset, precision.tile_products())
        }
        Kernels::Reference => {
            let o = attention(q, k, v, scale, q_offset, kernels, precision)?; // [B, 2H, T, d]
            diff_combine_pairs(&o, lambda, HeadPairing::Interleaved, kernels)
        }
    }
}

fn pair_layout(pairing: HeadPairing) -> difftx_kernels::PairLayout {
    match pairing {
        HeadPairing::Interleaved => difftx_kernels::PairLayout::Interleaved,
        HeadPairing::Halves => difftx_kernels::PairLayout::Halves,
    }
}

/// The differential combination read from one tensor holding both maps of every pair:
/// x [B, 2P, T, w] -> x_a − λ·x_b, [B, P, T, w], pairs as `pairing` says; λ is one element
/// (diff-v1) or [B, P, T, 1] (diff-v2's per-token λ).
pub fn diff_combine_pairs(x: &Tensor, lambda: &Tensor, pairing: HeadPairing, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::diff_combine_pairs(x, lambda, pair_layout(pairing)),
        Kernels::Reference => {
            let (a, b) = split_pairs(x, pairing)?;
            a.broadcast_sub(&b.broadcast_mul(lambda)?)
        }
    }
}

/// diff-v1's differential combination o1 − λ·o2 for a one-element λ (any shape of o1 = o2).
pub fn diff_combine(o1: &Tensor, o2: &Tensor, lambda: &Tensor, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::diff_combine(o1, o2, lambda),
        Kernels::Reference => o1.broadcast_sub(&o2.broadcast_mul(lambda)?),
    }
}

/// Causal attention with GQA, the single-map primitive all three families are built from.
///
/// q: [B, Hq, T, dk], k: [B, Hk, S, dk], v: [B, Hk, S, dv]; query head i uses kv head
/// i / (Hq / Hk). Query row t sits at absolute position t + q_offset and sees keys s <= t + q_offset.
/// Returns [B, Hq, T, dv]. `precision` sets the fused kernel's tile products; the reference
/// path multiplies in f32.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    q_offset: usize,
    kernels: Kernels,
    precision: Precision,
) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => difftx_kernels::flash_attention(q, k, v, scale, q_offset, precision.tile_products()),
        Kernels::Reference => {
            let probs = attention_probs(q, k, scale, q_offset, kernels)?; // [B, Hq, T, S]
            weigh_values(&probs, v)
        }
    }
}

/// Attention maps softmax(q kᵀ·scale + causal mask): [B, Hq, T, S]. Materialises the maps, so it
/// is the reference path and the probe used by the experiments.
pub fn attention_probs(q: &Tensor, k: &Tensor, scale: f64, q_offset: usize, kernels: Kernels) -> Result<Tensor> {
    masked_softmax(&attention_scores(q, k, scale)?, q_offset, kernels)
}

/// softmax(scores + causal mask) over the last dim; scores [B, Hq, T, S].
fn masked_softmax(scores: &Tensor, q_offset: usize, kernels: Kernels) -> Result<Tensor> {
    let (_, _, t, s) = scores.dims4()?;
    let scores = match causal_mask(t, s, q_offset, scores.dtype(), scores.device())? {
        Some(mask) => scores.broadcast_add(&mask)?,
        None => scores.clone(),
    };
    softmax_last_dim(&scores, kernels)
}

/// probs [B, Hq, T, S] times v [B, Hk, S, dv] with GQA (query head i uses kv head i / (Hq/Hk)),
/// without copying v per query head: -> [B, Hq, T, dv].
fn weigh_values(probs: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, hq, t, s) = probs.dims4()?;
    let (_, hk, _, dv) = v.dims4()?;
    probs.reshape((b, hk, (hq / hk) * t, s))?.matmul(&v.contiguous()?)?.reshape((b, hq, t, dv))
}

/// Raw attention logits q kᵀ·scale (no mask): [B, Hq, T, S], GQA without copying k.
pub fn attention_scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, hq, t, dk) = q.dims4()?;
    let (_, hk, s, _) = k.dims4()?;
    if hq % hk != 0 {
        candle_core::bail!("attention: {hq} query heads are not a multiple of {hk} kv heads");
    }
    let rep = hq / hk;
    let q = q.contiguous()?.reshape((b, hk, rep * t, dk))?;
    let scores = q.matmul(&k.contiguous()?.t()?)?;
    (scores * scale)?.reshape((b, hq, t, s))
}

/// Additive causal mask [T, S] (0 or -inf) for queries at positions q_offset..q_offset+T, or None
/// when every query sees every key.
pub fn causal_mask(t: usize, s: usize, q_offset: usize, dtype: DType, device: &Device) -> Result<Option<Tensor>> {
    if q_offset + 1 >= s {
        // Even the first query sees every key (decoding one token against a cache).
        return Ok(None);
    }
    let mask: Vec<f32> =
        (0..t).flat_map(|i| (0..s).map(move |j| if j > i + q_offset { f32::NEG_INFINITY } else { 0.0 })).collect();
    Ok(Some(Tensor::from_vec(mask, (t, s), device)?.to_dtype(dtype)?))
}

/// Fake quantisation by dynamic absmax over the last dimension: each row is scaled so its largest
/// |value| maps to the largest `bits`-bit signed integer, rounded, and scaled back. Rows of zeros
/// stay zero. `bits` in 2..=16.
pub fn fake_quant_absmax(x: &Tensor, bits: u32) -> Result<Tensor> {
    if !(2..=16).contains(&bits) {
        candle_core::bail!("quantisation needs 2 to 16 bits, got {bits}");
    }
    let qmax = ((1u32 << (bits - 1)) - 1) as f64;
    let absmax = x.abs()?.max_keepdim(D::Minus1)?;
    // Guard all-zero rows: their scale is irrelevant, avoid 0/0.
    let scale = (absmax.maximum(1e-30)? / qmax)?;
    x.broadcast_div(&scale)?.round()?.broadcast_mul(&scale)
}

/// Causal attention with the logits fake-quantised to `bits` before the mask and softmax (the
/// paper's attention-logit quantisation experiment). Always the materialised reference path.
pub fn attention_quantized_logits(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    q_offset: usize,
    bits: u32,
) -> Result<Tensor> {
    weigh_values(&quantized_probs(q, k, scale, q_offset, bits)?, v)
}

/// softmax(fake_quant(q kᵀ·scale) + mask).
pub fn quantized_probs(q: &Tensor, k: &Tensor, scale: f64, q_offset: usize, bits: u32) -> Result<Tensor> {
    masked_softmax(&fake_quant_absmax(&attention_scores(q, k, scale)?, bits)?, q_offset, Kernels::Reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_quant_round_trip() {
        let x = Tensor::new(&[[1.0f64, -0.5, 0.26, 0.0], [0.0, 0.0, 0.0, 0.0], [-8.0, 3.0, 2.0, 1.0]], &Device::Cpu)
            .unwrap();
        // 4 bits: qmax 7; row 0 scale 1/7: 0.26 -> round(1.82)=2 -> 2/7.
        let q = fake_quant_absmax(&x, 4).unwrap().to_vec2::<f64>().unwrap();
        let want0 = [1.0, -4.0 / 7.0, 2.0 / 7.0, 0.0];
        for (a, b) in q[0].iter().zip(want0) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        assert_eq!(q[1], vec![0.0; 4]);
        assert!((q[2][0] + 8.0).abs() < 1e-12 && (q[2][1] - 24.0 / 7.0).abs() < 1e-12);
        // 16 bits is nearly lossless; error bounded by half a step.
        let q16 = fake_quant_absmax(&x, 16).unwrap();
        let err = (q16 - &x).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        assert!(err <= 8.0 / 32767.0 / 2.0 + 1e-15, "{err}");
        assert!(fake_quant_absmax(&x, 1).is_err());
    }
}
