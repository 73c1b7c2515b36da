//! Fused causal attention (FlashAttention-2 style) with backward, on the CPU.
//!
//! Layouts (row-major, contiguous):
//! * `q`  `[B, Hq, T, dk]`, `k` `[B, Hk, S, dk]`, `v` `[B, Hk, S, dv]`, `out`/`dout` `[B, Hq, T, dv]`
//! * `lse` `[B, Hq, T]`: per query row `m + ln(l)` (log-sum-exp of the scaled scores), saved by the
//!   forward for the backward; `delta` `[B, Hq, T]`: `rowsum(dout * out)` (backward only).
//! * GQA: query head `h` reads kv head `h / (Hq / Hk)`.
//! * Causality with offset: query row `t` sits at absolute position `t + q_offset` and sees keys
//!   `s <= t + q_offset` (clipped to `S - 1`). Masked keys are never computed: each row's key range
//!   is cut short, so there is no `-inf` arithmetic and no `N x N` map anywhere.
//!
//! Forward, per task `(b, h, block of BR query rows)`: loop over key blocks of `BC` keys; the key
//! block is transposed once into `kt [dk][BC]` so a row's scores are `dk` vectorised axpys;
//! online softmax keeps the running max `m`, the running sum `l` and the unnormalised output row.
//!
//! Backward (recompute, two passes, no atomics):
//! * pass 1, per task `(b, kv head, key block)`: for every query head of the group and every query
//!   row that sees the block, recompute `p = exp(s - lse)`, `dp = dout · v`, `ds = p (dp - delta)`,
//!   accumulate `dv += p dout`, `dk += scale ds q` into the block's own rows.
//! * pass 2, per task `(b, h, query block)`: the same recompute, accumulating `dq += scale ds k`.
//! Memory beyond inputs/outputs is O(B·Hq·T) for `lse`/`delta` plus per-thread tiles.

use crate::cpu::storage_slice;
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// Query rows per forward / dq task.
const BR: usize = 64;
/// Keys per key block (tile of K and V kept hot in L1/L2 and transposed once).
const BC: usize = 64;
/// Below this many rows per task the scores are plain dot products (no transposed tile).
const DOT_ROWS: usize = 4;

/// Causal flash attention with backward (dq, dk, dv).
///
/// q: [B, Hq, T, dk], k: [B, Hk, S, dk], v: [B, Hk, S, dv]; Hq % Hk == 0; query head i uses kv
/// head i / (Hq/Hk) (GQA). Query row t sits at absolute position t + q_offset and attends to key
/// positions s <= t + q_offset (S = q_offset + T for a KV cache; q_offset = 0 in training).
/// scores = q·k * scale. Returns out [B, Hq, T, dv]. f32 and f64; CPU only.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, q_offset: usize) -> Result<Tensor> {
    let dims = check_shapes(q, k, v)?;
    if dims.s == 0 && dims.t > 0 {
        bail!("difftx_kernels::flash_attention: no keys (S = 0)");
    }
    let op = FlashAttn { scale, q_offset, lse: Mutex::new(None) };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    b: usize,
    hq: usize,
    hk: usize,
    t: usize,
    s: usize,
    dk: usize,
    dv: usize,
}

impl Dims {
    fn rep(&self) -> usize {
        self.hq / self.hk
    }
}

fn dims_of(q: &[usize], k: &[usize], v: &[usize]) -> Result<Dims> {
    let (&[b, hq, t, dk], &[bk, hk, s, dk2], &[bv, hv, sv, dv]) = (q, k, v) else {
        bail!("difftx_kernels::flash_attention: q, k, v must be rank 4, got {q:?} {k:?} {v:?}");
    };
    if b != bk || b != bv || hk != hv || s != sv || dk != dk2 {
        bail!("difftx_kernels::flash_attention: incompatible shapes q {q:?} k {k:?} v {v:?}");
    }
    if hk == 0 || hq % hk != 0 {
        bail!("difftx_kernels::flash_attention: Hq = {hq} is not a multiple of Hk = {hk}");
    }
    Ok(Dims { b, hq, hk, t, s, dk, dv })
}

fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
    let dt = q.dtype();
    if k.dtype() != dt || v.dtype() != dt {
        bail!("difftx_kernels::flash_attention: dtypes differ: {dt:?} {:?} {:?}", k.dtype(), v.dtype());
    }
    match dt {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::flash_attention: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    dims_of(q.dims(), k.dims(), v.dims())
}

// ---------------------------------------------------------------------------------------------
// Small vector helpers (plain loops over slices; LLVM vectorises them).

#[inline(always)]
fn axpy<T: Float>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[inline(always)]
fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = T::ZERO;
    for (&x, &y) in ra.iter().zip(rb) {
        s += x * y;
    }
    for a in acc {
        s += a;
    }
    s
}

/// `dst[c * BC + j] = src[j * d + c]` for `j < n`, `c < d`: a key/value block transposed.
#[inline(always)]
fn transpose_block<T: Float>(src: &[T], dst: &mut [T], n: usize, d: usize) {
    for j in 0..n {
        let row = &src[j * d..(j + 1) * d];
        for c in 0..d {
            dst[c * BC + j] = row[c];
        }
    }
}

/// `out[j] = sum_c a[c] * mat[c * BC + j]` for `j < n` (scores of one row against a transposed
/// block), or plain dot products against the row-major block when `trans` is `None`.
#[inline(always)]
fn row_scores<T: Float>(out: &mut [T], a: &[T], trans: Option<&[T]>, rows: &[T], d: usize, n: usize) {
    match trans {
        Some(mt) => {
            out[..n].fill(T::ZERO);
            for (c, &ac) in a.iter().enumerate() {
                axpy(&mut out[..n], ac, &mt[c * BC..c * BC + n]);
            }
        }
        None => {
            for j in 0..n {
                out[j] = dot(a, &rows[j * d..(j + 1) * d]);
            }
        }
    }
}

/// Per-thread scratch tiles.
pub(crate) struct Scratch<T> {
    kt: Vec<T>,
    vt: Vec<T>,
    s: Vec<T>,
    p2: Vec<T>,
    qs: Vec<T>,
    m: Vec<T>,
    l: Vec<T>,
}

impl<T: Float> Scratch<T> {
    fn new(d: &Dims) -> Self {
        Scratch {
            kt: vec![T::ZERO; d.dk * BC],
            vt: vec![T::ZERO; d.dv * BC],
            s: vec![T::ZERO; BC],
            p2: vec![T::ZERO; BC],
            qs: vec![T::ZERO; d.dk],
            m: vec![T::ZERO; BR],
            l: vec![T::ZERO; BR],
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.

/// One forward task: rows `t0 .. t0 + lse.len()` of one (batch, query head).
/// `qh` is that head's `[T, dk]`, `kh`/`vh` its kv head's `[S, dk]`/`[S, dv]`;
/// writes `out` (`[rows, dv]`) and `lse` (`[rows]`).
#[inline(always)]
fn fwd_task<T: Float>(
    d: &Dims,
    scale: T,
    q_offset: usize,
    t0: usize,
    qh: &[T],
    kh: &[T],
    vh: &[T],
    out: &mut [T],
    lse: &mut [T],
    sc: &mut Scratch<T>,
) {
    let (dk, dv) = (d.dk, d.dv);
    let rows = lse.len();
    let use_t = rows >= DOT_ROWS;
    let (m, l) = (&mut sc.m[..rows], &mut sc.l[..rows]);
    m.fill(T::NEG_INF);
    l.fill(T::ZERO);
    out.fill(T::ZERO);
    let kend = (t0 + rows + q_offset).min(d.s);
    let mut s0 = 0;
    while s0 < kend {
        let s1 = (s0 + BC).min(kend);
        let kb = &kh[s0 * dk..s1 * dk];
        if use_t {
            transpose_block(kb, &mut sc.kt, s1 - s0, dk);
        }
        for i in 0..rows {
            let lim = (t0 + i + q_offset + 1).min(s1);
            if lim <= s0 {
                continue;
            }
            let n = lim - s0;
            for (x, &y) in sc.qs.iter_mut().zip(&qh[(t0 + i) * dk..(t0 + i + 1) * dk]) {
                *x = y * scale;
            }
            let s = &mut sc.s[..n];
            row_scores(s, &sc.qs, if use_t { Some(&sc.kt) } else { None }, kb, dk, n);
            let mut mx = m[i];
            for &x in s.iter() {
                mx = mx.maxf(x);
            }
            let alpha = (m[i] - mx).exp(); // 0 on the first block (m = -inf)
            for x in s.iter_mut() {
                *x -= mx;
            }
            T::exp_inplace(s);
            let mut psum = T::ZERO;
            for &x in s.iter() {
                psum += x;
            }
            l[i] = l[i] * alpha + psum;
            m[i] = mx;
            let o = &mut out[i * dv..(i + 1) * dv];
            if alpha != T::ONE {
                for x in o.iter_mut() {
                    *x *= alpha;
                }
            }
            for (j, &p) in s.iter().enumerate() {
                axpy(o, p, &vh[(s0 + j) * dv..(s0 + j + 1) * dv]);
            }
        }
        s0 = s1;
    }
    for i in 0..rows {
        let inv = T::ONE / l[i];
        for x in out[i * dv..(i + 1) * dv].iter_mut() {
            *x *= inv;
        }
        lse[i] = m[i] + l[i].ln();
    }
}

/// Forward over all heads: fills `out` `[B, Hq, T, dv]` and `lse` `[B, Hq, T]`.
pub(crate) fn flash_fwd<T: Float>(d: &Dims, scale: f64, q_offset: usize, q: &[T], k: &[T], v: &[T], out: &mut [T], lse: &mut [T]) {
    if d.t == 0 || d.dv == 0 || d.b * d.hq == 0 {
        return;
    }
    let scale = T::from_f64(scale);
    let rows_per = if d.t <= BR { d.t } else { BR };
    let mut tasks = Vec::with_capacity(d.b * d.hq * d.t.div_ceil(rows_per));
    for (bh, (oc, lc)) in out.chunks_mut(d.t * d.dv).zip(lse.chunks_mut(d.t)).enumerate() {
        for (blk, (o, l)) in oc.chunks_mut(rows_per * d.dv).zip(lc.chunks_mut(rows_per)).enumerate() {
            tasks.push((bh, blk * rows_per, o, l));
        }
    }
    tasks.reverse(); // heaviest (latest) query blocks first
    let kernel = simd::pick_fwd::<T>();
    tasks.into_par_iter().for_each_init(
        || Scratch::new(d),
        |sc, (bh, t0, o, l)| {
            let (b, h) = (bh / d.hq, bh % d.hq);
            let kv = b * d.hk + h / d.rep();
            let qh = &q[bh * d.t * d.dk..(bh + 1) * d.t * d.dk];
            let kh = &k[kv * d.s * d.dk..(kv + 1) * d.s * d.dk];
            let vh = &v[kv * d.s * d.dv..(kv + 1) * d.s * d.dv];
            kernel(d, scale, q_offset, t0, qh, kh, vh, o, l, sc);
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// Inputs shared by both backward passes.
pub(crate) struct BwdIn<'a, T> {
    d: Dims,
    scale: T,
    q_offset: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    dout: &'a [T],
    lse: &'a [T],
    delta: &'a [T],
}

/// Pass 1 task: key rows `s0 .. s0 + dkb.len() / dk` of kv head `(b, g)`; accumulates `dkb`
/// `[nb, dk]` and `dvb` `[nb, dv]` over every query head of the group and every row that sees it.
#[inline(always)]
fn bwd_kv_task<T: Float>(x: &BwdIn<T>, b: usize, g: usize, s0: usize, dkb: &mut [T], dvb: &mut [T], sc: &mut Scratch<T>) {
    let d = &x.d;
    let (dk, dv) = (d.dk, d.dv);
    let nb = dkb.len() / dk.max(1);
    let nb = if dk == 0 { dvb.len() / dv } else { nb };
    let s1 = s0 + nb;
    dkb.fill(T::ZERO);
    dvb.fill(T::ZERO);
    let kv = b * d.hk + g;
    let kb = &x.k[(kv * d.s + s0) * dk..(kv * d.s + s1) * dk];
    let vb = &x.v[(kv * d.s + s0) * dv..(kv * d.s + s1) * dv];
    transpose_block(kb, &mut sc.kt, nb, dk);
    transpose_block(vb, &mut sc.vt, nb, dv);
    let t_start = s0.saturating_sub(x.q_offset);
    for h in g * d.rep()..(g + 1) * d.rep() {
        let bh = b * d.hq + h;
        for t in t_start..d.t {
            let n = (t + x.q_offset + 1).min(s1) - s0;
            let row = bh * d.t + t;
            let qr = &x.q[row * dk..(row + 1) * dk];
            let gr = &x.dout[row * dv..(row + 1) * dv];
            let (lse, delta) = (x.lse[row], x.delta[row]);
            let p = &mut sc.s[..n];
            row_scores(p, qr, Some(&sc.kt), kb, dk, n);
            for e in p.iter_mut() {
                *e = *e * x.scale - lse;
            }
            T::exp_inplace(p);
            let dp = &mut sc.p2[..n];
            row_scores(dp, gr, Some(&sc.vt), vb, dv, n);
            for j in 0..n {
                let pj = p[j];
                axpy(&mut dvb[j * dv..(j + 1) * dv], pj, gr);
                let ds = pj * (dp[j] - delta) * x.scale;
                axpy(&mut dkb[j * dk..(j + 1) * dk], ds, qr);
            }
        }
    }
}

/// Pass 2 task: `dq` rows `t0 .. t0 + rows` of `(b, h)`; `dqb` is `[rows, dk]`.
#[inline(always)]
fn bwd_q_task<T: Float>(x: &BwdIn<T>, bh: usize, t0: usize, dqb: &mut [T], sc: &mut Scratch<T>) {
    let d = &x.d;
    let (dk, dv) = (d.dk, d.dv);
    let rows = dqb.len() / dk;
    let use_t = rows >= DOT_ROWS;
    dqb.fill(T::ZERO);
    let kv = (bh / d.hq) * d.hk + (bh % d.hq) / d.rep();
    let kend = (t0 + rows + x.q_offset).min(d.s);
    let mut s0 = 0;
    while s0 < kend {
        let s1 = (s0 + BC).min(kend);
        let kb = &x.k[(kv * d.s + s0) * dk..(kv * d.s + s1) * dk];
        let vb = &x.v[(kv * d.s + s0) * dv..(kv * d.s + s1) * dv];
        if use_t {
            transpose_block(kb, &mut sc.kt, s1 - s0, dk);
            transpose_block(vb, &mut sc.vt, s1 - s0, dv);
        }
        for i in 0..rows {
            let lim = (t0 + i + x.q_offset + 1).min(s1);
            if lim <= s0 {
                continue;
            }
            let n = lim - s0;
            let row = bh * d.t + t0 + i;
            let qr = &x.q[row * dk..(row + 1) * dk];
            let gr = &x.dout[row * dv..(row + 1) * dv];
            let (lse, delta) = (x.lse[row], x.delta[row]);
            let p = &mut sc.s[..n];
            row_scores(p, qr, if use_t { Some(&sc.kt) } else { None }, kb, dk, n);
            for e in p.iter_mut() {
                *e = *e * x.scale - lse;
            }
            T::exp_inplace(p);
            let dp = &mut sc.p2[..n];
            row_scores(dp, gr, if use_t { Some(&sc.vt) } else { None }, vb, dv, n);
            let dq = &mut dqb[i * dk..(i + 1) * dk];
            for j in 0..n {
                let ds = p[j] * (dp[j] - delta) * x.scale;
                axpy(dq, ds, &kb[j * dk..(j + 1) * dk]);
            }
        }
        s0 = s1;
    }
}

/// Backward over all heads. Writes `dq` `[B,Hq,T,dk]`, `dk` `[B,Hk,S,dk]`, `dv` `[B,Hk,S,dv]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_bwd<T: Float>(
    d: &Dims,
    scale: f64,
    q_offset: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    dout: &[T],
    lse: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    dq.fill(T::ZERO);
    dk.fill(T::ZERO);
    dv.fill(T::ZERO);
    if d.t == 0 || d.s == 0 || d.b * d.hq == 0 || d.dv == 0 {
        return;
    }
    // delta = rowsum(dout * out)
    let mut delta = vec![T::ZERO; d.b * d.hq * d.t];
    delta
        .par_iter_mut()
        .zip(out.par_chunks(d.dv).zip(dout.par_chunks(d.dv)))
        .with_min_len(256)
        .for_each(|(o, (a, b))| *o = dot(a, b));
    let x = BwdIn { d: *d, scale: T::from_f64(scale), q_offset, q, k, v, dout, lse, delta: &delta };
    let (kv_kernel, q_kernel) = simd::pick_bwd::<T>();
    if d.dk > 0 {
        // pass 2 first or second does not matter; dq
        let rows_per = if d.t <= BR { d.t } else { BR };
        let mut tasks = Vec::new();
        for (bh, c) in dq.chunks_mut(d.t * d.dk).enumerate() {
            for (blk, o) in c.chunks_mut(rows_per * d.dk).enumerate() {
                tasks.push((bh, blk * rows_per, o));
            }
        }
        tasks.reverse();
        tasks.into_par_iter().for_each_init(|| Scratch::new(d), |sc, (bh, t0, o)| q_kernel(&x, bh, t0, o, sc));
    }
    // pass 1: dk, dv per key block
    let mut tasks = Vec::new();
    let dk_chunk = (d.s * d.dk).max(1);
    let mut dk_heads: Vec<&mut [T]> = if d.dk > 0 { dk.chunks_mut(dk_chunk).collect() } else { Vec::new() };
    for (bg, dvc) in dv.chunks_mut(d.s * d.dv).enumerate() {
        let dkc: &mut [T] = if d.dk > 0 { std::mem::take(&mut dk_heads[bg]) } else { &mut [] };
        let mut dk_blocks: Vec<&mut [T]> = if d.dk > 0 { dkc.chunks_mut(BC * d.dk).collect() } else { Vec::new() };
        for (blk, dvb) in dvc.chunks_mut(BC * d.dv).enumerate() {
            let dkb: &mut [T] = if d.dk > 0 { std::mem::take(&mut dk_blocks[blk]) } else { &mut [] };
            tasks.push((bg / d.hk, bg % d.hk, blk * BC, dkb, dvb));
        }
    }
    tasks.into_par_iter().for_each_init(|| Scratch::new(d), |sc, (b, g, s0, dkb, dvb)| kv_kernel(&x, b, g, s0, dkb, dvb, sc));
}

// ---------------------------------------------------------------------------------------------
// Runtime dispatch: the same generic bodies compiled for AVX2+FMA / AVX-512 when available.

mod simd {
    use super::*;

    pub(super) type FwdFn<T> =
        fn(&Dims, T, usize, usize, &[T], &[T], &[T], &mut [T], &mut [T], &mut Scratch<T>);
    pub(super) type KvFn<T> = fn(&BwdIn<T>, usize, usize, usize, &mut [T], &mut [T], &mut Scratch<T>);
    pub(super) type QFn<T> = fn(&BwdIn<T>, usize, usize, &mut [T], &mut Scratch<T>);

    macro_rules! variants {
        ($feat:literal, $fwd:ident, $kv:ident, $q:ident) => {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $fwd<T: Float>(
                d: &Dims, scale: T, qo: usize, t0: usize, qh: &[T], kh: &[T], vh: &[T],
                out: &mut [T], lse: &mut [T], sc: &mut Scratch<T>,
            ) {
                fwd_task(d, scale, qo, t0, qh, kh, vh, out, lse, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $kv<T: Float>(x: &BwdIn<T>, b: usize, g: usize, s0: usize, dkb: &mut [T], dvb: &mut [T], sc: &mut Scratch<T>) {
                bwd_kv_task(x, b, g, s0, dkb, dvb, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $q<T: Float>(x: &BwdIn<T>, bh: usize, t0: usize, dqb: &mut [T], sc: &mut Scratch<T>) {
                bwd_q_task(x, bh, t0, dqb, sc)
            }
        };
    }
    variants!("avx2,fma", fwd_avx2, kv_avx2, q_avx2);

    #[cfg(target_arch = "x86_64")]
    fn has_avx2() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    pub(super) fn pick_fwd<T: Float>() -> FwdFn<T> {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the enabled features (checked just above).
            return |d, s, qo, t0, qh, kh, vh, o, l, sc| unsafe { fwd_avx2(d, s, qo, t0, qh, kh, vh, o, l, sc) };
        }
        |d, s, qo, t0, qh, kh, vh, o, l, sc| fwd_task(d, s, qo, t0, qh, kh, vh, o, l, sc)
    }

    pub(super) fn pick_bwd<T: Float>() -> (KvFn<T>, QFn<T>) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the enabled features (checked just above).
            return (
                |x, b, g, s0, dkb, dvb, sc| unsafe { kv_avx2(x, b, g, s0, dkb, dvb, sc) },
                |x, bh, t0, dqb, sc| unsafe { q_avx2(x, bh, t0, dqb, sc) },
            );
        }
        (|x, b, g, s0, dkb, dvb, sc| bwd_kv_task(x, b, g, s0, dkb, dvb, sc), |x, bh, t0, dqb, sc| bwd_q_task(x, bh, t0, dqb, sc))
    }
}

// ---------------------------------------------------------------------------------------------
// candle glue.

struct FlashAttn {
    scale: f64,
    q_offset: usize,
    /// log-sum-exp per query row saved by the forward (`[B, Hq, T]`, same dtype as q).
    lse: Mutex<Option<CpuStorage>>,
}

fn fwd_typed<T: Float>(
    op: &FlashAttn,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let d = dims_of(l1.dims(), l2.dims(), l3.dims())?;
    let (q, k, v) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?, storage_slice::<T>(s3, l3)?);
    let mut out = vec![T::ZERO; d.b * d.hq * d.t * d.dv];
    let mut lse = vec![T::ZERO; d.b * d.hq * d.t];
    flash_fwd(&d, op.scale, op.q_offset, q, k, v, &mut out, &mut lse);
    *op.lse.lock().unwrap() = Some(T::to_cpu_storage_owned(lse));
    Ok((T::to_cpu_storage_owned(out), Shape::from_dims(&[d.b, d.hq, d.t, d.dv])))
}

fn bwd_typed<T: Float>(
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    use crate::cpu::with_slice;
    let d = dims_of(q.dims(), k.dims(), v.dims())?;
    let mut dq = vec![T::ZERO; q.elem_count()];
    let mut dk = vec![T::ZERO; k.elem_count()];
    let mut dv = vec![T::ZERO; v.elem_count()];
    let saved = op.lse.lock().unwrap().take();
    with_slice::<T, _>(q, |qs| {
        with_slice::<T, _>(k, |ks| {
            with_slice::<T, _>(v, |vs| {
                with_slice::<T, _>(out, |os| {
                    with_slice::<T, _>(grad, |gs| {
                        let recomputed;
                        let lse: &[T] = match &saved {
                            Some(st) => st.as_slice::<T>()?,
                            None => {
                                let mut o2 = vec![T::ZERO; os.len()];
                                let mut l = vec![T::ZERO; d.b * d.hq * d.t];
                                flash_fwd(&d, op.scale, op.q_offset, qs, ks, vs, &mut o2, &mut l);
                                recomputed = l;
                                &recomputed
                            }
                        };
                        flash_bwd(&d, op.scale, op.q_offset, qs, ks, vs, os, gs, lse, &mut dq, &mut dk, &mut dv);
                        Ok(())
                    })
                })
            })
        })
    })?;
    // Keep the saved lse for a possible second backward through the same graph.
    *op.lse.lock().unwrap() = saved;
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, q.shape(), dev)?,
        Tensor::from_vec(dk, k.shape(), dev)?,
        Tensor::from_vec(dv, v.shape(), dev)?,
    ))
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "difftx-flash-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::F64 => fwd_typed::<f64>(self, s1, l1, s2, l2, s3, l3),
            dt => bail!("difftx-flash-attention: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.to_dtype(q.dtype())?;
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => bwd_typed::<f32>(self, q, k, v, res, &grad)?,
            DType::F64 => bwd_typed::<f64>(self, q, k, v, res, &grad)?,
            dt => bail!("difftx-flash-attention: unsupported dtype {dt:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
