//! diff-v1's attention with the differential combination inside, so that the backward shares
//! work between the two maps of a pair.
//!
//! Layouts (row-major): `q` `[B, Hq, T, dk]`, `k` `[B, Hk, S, dk]`, `v` `[B, Hk, S, dv]`, `λ` one
//! element; out `z` `[B, Hq/2, T, 2dv]`. Query pair `j` is `(a(j), b(j))` and kv pair `p` is
//! `(a'(p), b'(p))` by the same [`PairLayout`] over the query and the kv heads; query head `h`
//! reads kv head `h / (Hq / Hk)` (GQA), and both heads of a query pair must read the two heads of
//! one kv pair, first to first (true for halves at any GQA ratio and for interleaved pairs
//! without GQA). The value of kv pair `p` is `V_p = [v_{a'}, v_{b'}]` (`2dv` wide) and
//!
//! `z_j = softmax(scale q_a k_{a'}ᵀ) V_p − λ·softmax(scale q_b k_{b'}ᵀ) V_p`   (causal, KV offset)
//!
//! Forward: the pair values, one flash attention over all heads, the combination: the same
//! kernels as the composition `pair_values` → `flash_attention` → `diff_combine_pairs`.
//!
//! Backward, per task `(batch, kv pair)`: with `P_a`, `P_b` the two maps (recomputed from the
//! saved log-sum-exps), `dz` the output gradient, `delta_a = rowsum(dz ∘ o_a)`,
//! `delta_b = −λ·rowsum(dz ∘ o_b)`:
//! * `dP = dz V_pᵀ` once for both maps (map b's is `−λ·dP`),
//! * `dS_a = scale·P_a ∘ (dP − delta_a)`, `dS_b = scale·P_b ∘ (−λ·dP − delta_b)`,
//! * `dV_p += (P_a − λ·P_b)ᵀ dz` once for both maps,
//! * `dK_{a'} += dS_aᵀ q_a`, `dK_{b'} += dS_bᵀ q_b`, `dq_a += dS_a K_{a'}`, `dq_b += dS_b K_{b'}`,
//! * `dλ = −Σ dz ∘ o_b`.
//!
//! Per pair and tile that is 10 tile-product units (in units of `d`-wide products) where flash's
//! backward over the composed path does 14 (`dP` and `dV` are `2d` wide, once per map); the
//! baseline's two heads also do 10. A task owns its kv pair's `dK`, `dV` and the `dq` of the query
//! pairs that read it: no races, deterministic. With fewer than `ONE_PASS_TASKS_PER_THREAD` tasks
//! per thread (long sequences over few heads) the backward runs the composition's own backward
//! (combination, flash, pair values) instead, which splits the work finer.

// Kernels over raw slices naturally take many arguments.
#![allow(clippy::too_many_arguments)]

use crate::cpu::{storage_slice, with_slice};
use crate::diff_combine::DiffCombinePairs;
use crate::flash::{flash_bwd, flash_fwd, mm, Dims, BC, BR, ONE_PASS_TASKS_PER_THREAD};
use crate::float::Float;
use crate::pair_values::PairValues;
use crate::PairLayout;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// diff-v1's attention `z_j = A_a V_p − λ·A_b V_p` for every query pair `j` (see the module
/// docs), with backward for `q`, `k`, `v` and `λ`. f32 and f64, one dtype; CPU only.
pub fn diff_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lambda: &Tensor,
    layout: PairLayout,
    scale: f64,
    q_offset: usize,
) -> Result<Tensor> {
    let dt = q.dtype();
    if !matches!(dt, DType::F32 | DType::F64) {
        bail!("difftx_kernels::diff_attention: unsupported dtype {dt:?} (f32, f64 only)");
    }
    if k.dtype() != dt || v.dtype() != dt || lambda.dtype() != dt {
        bail!("difftx_kernels::diff_attention: q, k, v and lambda must share one dtype");
    }
    if lambda.elem_count() != 1 {
        bail!("difftx_kernels::diff_attention: lambda must have one element, got shape {:?}", lambda.dims());
    }
    let (b, hq, t, dk) = q.dims4()?;
    let (bk, hk, s, dk2) = k.dims4()?;
    let (bv, hv, sv, dv) = v.dims4()?;
    if bk != b || bv != b || hv != hk || sv != s || dk2 != dk {
        bail!(
            "difftx_kernels::diff_attention: shapes q {:?}, k {:?}, v {:?} do not fit [B, Hq, T, dk], [B, Hk, S, dk], [B, Hk, S, dv]",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if hq % 2 != 0 || hk % 2 != 0 || hk == 0 || hq % hk != 0 {
        bail!("difftx_kernels::diff_attention: {hq} query heads and {hk} kv heads cannot form pairs (both even, Hq a multiple of Hk)");
    }
    if s == 0 && t > 0 {
        bail!("difftx_kernels::diff_attention: no keys (S = 0)");
    }
    let d = Dims { b, hq, hk, t, s, dk, dv: 2 * dv };
    let pairs_of = query_pairs_per_kv_pair(&d, layout)?;
    let op = DiffAttn { d, layout, scale, q_offset, pairs_of, saved: Mutex::new(None) };
    // candle's custom ops take three inputs: λ rides at the end of v's flattened data.
    let v_lambda = Tensor::cat(&[&v.flatten_all()?, &lambda.flatten_all()?], 0)?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v_lambda, op)
}

/// The pair `(a, b)` number `j` of `n` heads.
fn pair(layout: PairLayout, n: usize, j: usize) -> (usize, usize) {
    match layout {
        PairLayout::Interleaved => (2 * j, 2 * j + 1),
        PairLayout::Halves => (j, j + n / 2),
    }
}

/// For every kv pair, the query pairs that read it; an error when a query pair's two heads do
/// not read the two heads of one kv pair, first to first.
fn query_pairs_per_kv_pair(d: &Dims, layout: PairLayout) -> Result<Vec<Vec<usize>>> {
    let rep = d.rep();
    let mut pairs_of = vec![Vec::new(); d.hk / 2];
    for j in 0..d.hq / 2 {
        let (a, b) = pair(layout, d.hq, j);
        let (ka, kb) = (a / rep, b / rep);
        match (0..d.hk / 2).find(|&p| pair(layout, d.hk, p) == (ka, kb)) {
            Some(p) => pairs_of[p].push(j),
            None => bail!(
                "difftx_kernels::diff_attention: with {layout:?} pairs, {} query heads and {} kv heads, query pair ({a}, {b}) reads kv heads ({ka}, {kb}), which are not a pair",
                d.hq,
                d.hk
            ),
        }
    }
    Ok(pairs_of)
}

struct DiffAttn {
    /// Flash attention's dims over all heads, `dv` the pair value's width `2dv`.
    d: Dims,
    layout: PairLayout,
    scale: f64,
    q_offset: usize,
    pairs_of: Vec<Vec<usize>>,
    /// Saved by the forward for the backward: every head's output `[B, Hq, T, 2dv]` and
    /// log-sum-exp `[B, Hq, T]`.
    saved: Mutex<Option<(CpuStorage, CpuStorage)>>,
}

impl DiffAttn {
    fn pair_values(&self) -> PairValues {
        PairValues { b: self.d.b, h: self.d.hk, s: self.d.s, d: self.d.dv / 2, layout: self.layout }
    }

    fn combine(&self) -> DiffCombinePairs {
        let (d, p) = (&self.d, self.d.hq / 2);
        let (outer, inner) = match self.layout {
            PairLayout::Interleaved => (d.b * p, d.t * d.dv),
            PairLayout::Halves => (d.b, p * d.t * d.dv),
        };
        DiffCombinePairs { outer, inner, width: 0 }
    }

    /// Every head's output and log-sum-exp, and the pair values.
    fn attend<T: Float>(&self, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let d = &self.d;
        let mut v2 = vec![T::ZERO; 2 * v.len()];
        self.pair_values().fwd(v, &mut v2);
        let mut o = vec![T::ZERO; d.b * d.hq * d.t * d.dv];
        let mut lse = vec![T::ZERO; d.b * d.hq * d.t];
        flash_fwd(d, self.scale, self.q_offset, q, k, &v2, &mut o, &mut lse);
        (o, lse, v2)
    }
}

/// What one backward task produces for kv pair `p` of batch `b`.
struct TaskGrads<T> {
    b: usize,
    p: usize,
    /// `[S, dk]` each.
    dk_a: Vec<T>,
    dk_b: Vec<T>,
    /// `[S, 2dv]`: the pair value's gradient.
    dv_pair: Vec<T>,
    /// `[n_pairs, 2, T, dk]`: heads a and b of every query pair reading this kv pair.
    dq: Vec<T>,
}

/// Inputs of the shared-map backward.
struct BwdIn<'a, T> {
    d: Dims,
    layout: PairLayout,
    lambda: T,
    scale: T,
    q_offset: usize,
    q: &'a [T],
    k: &'a [T],
    v2: &'a [T],
    dz: &'a [T],
    lse: &'a [T],
    /// `[B, Hq, T]`: `rowsum(dz ∘ o_a)` for heads a, `−λ·rowsum(dz ∘ o_b)` for heads b.
    delta: &'a [T],
    pairs_of: &'a [Vec<usize>],
}

/// Per-thread `[BR, BC]` tiles: both maps' scores / probabilities (map a's becomes
/// `P_a − λ·P_b`), the shared `dP`, both maps' `dS`.
struct Tiles<T> {
    pa: Vec<T>,
    pb: Vec<T>,
    dp: Vec<T>,
    dsa: Vec<T>,
    dsb: Vec<T>,
}

impl<T: Float> Tiles<T> {
    fn new() -> Self {
        let z = || vec![T::ZERO; BR * BC];
        Tiles { pa: z(), pb: z(), dp: z(), dsa: z(), dsb: z() }
    }
}

/// One task: kv pair `p` of batch `b` and every query pair that reads it (module docs).
#[inline(always)]
fn pair_task<T: Float>(x: &BwdIn<T>, b: usize, p: usize, tl: &mut Tiles<T>) -> TaskGrads<T> {
    let d = &x.d;
    let (dk, w, t, s) = (d.dk, d.dv, d.t, d.s);
    let (ka, kb) = pair(x.layout, d.hk, p);
    let js = &x.pairs_of[p];
    let mut g = TaskGrads {
        b,
        p,
        dk_a: vec![T::ZERO; s * dk],
        dk_b: vec![T::ZERO; s * dk],
        dv_pair: vec![T::ZERO; s * w],
        dq: vec![T::ZERO; js.len() * 2 * t * dk],
    };
    let k_a = &x.k[(b * d.hk + ka) * s * dk..][..s * dk];
    let k_b = &x.k[(b * d.hk + kb) * s * dk..][..s * dk];
    // kv heads a' and b' hold the same pair value; a' 's copy is read
    let v_p = &x.v2[(b * d.hk + ka) * s * w..][..s * w];
    let minus_lambda = T::ZERO - x.lambda;
    let mut s0 = 0;
    while s0 < s {
        let nb = (s - s0).min(BC);
        let (kab, kbb, vb) =
            (&k_a[s0 * dk..(s0 + nb) * dk], &k_b[s0 * dk..(s0 + nb) * dk], &v_p[s0 * w..(s0 + nb) * w]);
        for (i, &j) in js.iter().enumerate() {
            let (ha, hb) = pair(x.layout, d.hq, j);
            let (bha, bhb) = (b * d.hq + ha, b * d.hq + hb);
            let bj = b * (d.hq / 2) + j;
            // rows before s0 - q_offset see none of this block's keys
            let mut t0 = s0.saturating_sub(x.q_offset);
            while t0 < t {
                let rows = (t - t0).min(BR);
                let qa = &x.q[(bha * t + t0) * dk..][..rows * dk];
                let qb = &x.q[(bhb * t + t0) * dk..][..rows * dk];
                let dzb = &x.dz[(bj * t + t0) * w..][..rows * w];
                mm(rows, nb, dk, &mut tl.pa, BC, false, qa, dk, 1, kab, 1, dk, x.scale);
                mm(rows, nb, dk, &mut tl.pb, BC, false, qb, dk, 1, kbb, 1, dk, x.scale);
                mm(rows, nb, w, &mut tl.dp, BC, false, dzb, w, 1, vb, 1, w, T::ONE);
                for r in 0..rows {
                    let n = (t0 + r + x.q_offset + 1).min(s0 + nb).saturating_sub(s0);
                    let (ra, rb) = (bha * t + t0 + r, bhb * t + t0 + r);
                    let row = r * BC..r * BC + nb;
                    let (pa, pb) = (&mut tl.pa[row.clone()], &mut tl.pb[row.clone()]);
                    for (e, l) in [(&mut *pa, x.lse[ra]), (&mut *pb, x.lse[rb])] {
                        for v in e[..n].iter_mut() {
                            *v -= l;
                        }
                        T::exp_inplace(&mut e[..n]);
                        e[n..].fill(T::ZERO);
                    }
                    let (da, db) = (x.delta[ra], x.delta[rb]);
                    let (dp, dsa, dsb) = (&tl.dp[row.clone()], &mut tl.dsa[row.clone()], &mut tl.dsb[row]);
                    for c in 0..nb {
                        let gp = dp[c];
                        dsa[c] = pa[c] * (gp - da) * x.scale;
                        dsb[c] = pb[c] * (minus_lambda * gp - db) * x.scale;
                        pa[c] += minus_lambda * pb[c];
                    }
                }
                let dvb = &mut g.dv_pair[s0 * w..(s0 + nb) * w];
                mm(nb, w, rows, dvb, w, true, &tl.pa, 1, BC, dzb, w, 1, T::ONE);
                mm(nb, dk, rows, &mut g.dk_a[s0 * dk..(s0 + nb) * dk], dk, true, &tl.dsa, 1, BC, qa, dk, 1, T::ONE);
                mm(nb, dk, rows, &mut g.dk_b[s0 * dk..(s0 + nb) * dk], dk, true, &tl.dsb, 1, BC, qb, dk, 1, T::ONE);
                let dqa = &mut g.dq[((2 * i) * t + t0) * dk..][..rows * dk];
                mm(rows, dk, nb, dqa, dk, true, &tl.dsa, BC, 1, kab, dk, 1, T::ONE);
                let dqb = &mut g.dq[((2 * i + 1) * t + t0) * dk..][..rows * dk];
                mm(rows, dk, nb, dqb, dk, true, &tl.dsb, BC, 1, kbb, dk, 1, T::ONE);
                t0 += rows;
            }
        }
        s0 += nb;
    }
    g
}

mod simd {
    use super::*;

    pub(super) type TaskFn<T> = fn(&BwdIn<T>, usize, usize, &mut Tiles<T>) -> TaskGrads<T>;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn task_avx2<T: Float>(x: &BwdIn<T>, b: usize, p: usize, tl: &mut Tiles<T>) -> TaskGrads<T> {
        pair_task(x, b, p, tl)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn task_avx512<T: Float>(x: &BwdIn<T>, b: usize, p: usize, tl: &mut Tiles<T>) -> TaskGrads<T> {
        pair_task(x, b, p, tl)
    }

    /// The task compiled for the best instruction set this CPU has.
    pub(super) fn pick<T: Float>() -> TaskFn<T> {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
            if avx2 && std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports the enabled features (checked just above).
                return |x, b, p, tl| unsafe { task_avx512(x, b, p, tl) };
            }
            if avx2 {
                // SAFETY: the CPU supports the enabled features (checked just above).
                return |x, b, p, tl| unsafe { task_avx2(x, b, p, tl) };
            }
        }
        |x, b, p, tl| pair_task(x, b, p, tl)
    }
}

/// Whether the backward shares the maps' work in (batch, kv pair) tasks (enough of them to keep
/// every thread busy) rather than running the composition's backward.
fn shared_maps(d: &Dims) -> bool {
    d.dk > 0 && d.dv > 0 && d.t > 0 && d.b * d.hk / 2 >= ONE_PASS_TASKS_PER_THREAD * rayon::current_num_threads()
}

impl DiffAttn {
    /// Gradients `(dq, dk, dv, dλ)`; `shared`: the shared-map tasks, else the composition's
    /// backward (combination, flash, pair values).
    #[allow(clippy::type_complexity)]
    fn backward<T: Float>(
        &self,
        shared: bool,
        q: &[T],
        k: &[T],
        v: &[T],
        lambda: T,
        o: &[T],
        lse: &[T],
        dz: &[T],
    ) -> (Vec<T>, Vec<T>, Vec<T>, T) {
        let d = &self.d;
        let (dvr, w) = (d.dv / 2, d.dv);
        let mut dq = vec![T::ZERO; q.len()];
        let mut dk = vec![T::ZERO; k.len()];
        let mut dv = vec![T::ZERO; v.len()];
        // dλ = −Σ dz ∘ o_b, and the pair values
        let combine = self.combine();
        let mut dout = vec![T::ZERO; o.len()];
        let mut dl = [T::ZERO];
        combine.bwd(o, &[lambda], dz, &mut dout, &mut dl);
        let mut v2 = vec![T::ZERO; 2 * v.len()];
        self.pair_values().fwd(v, &mut v2);
        if !shared {
            let mut dv2 = vec![T::ZERO; v2.len()];
            flash_bwd(d, self.scale, self.q_offset, q, k, &v2, o, &dout, lse, &mut dq, &mut dk, &mut dv2);
            self.pair_values().bwd(&dv2, &mut dv);
            return (dq, dk, dv, dl[0]);
        }
        // delta per query head: dout_h · o_h, dout being dz for heads a and −λ·dz for heads b
        let mut delta = vec![T::ZERO; d.b * d.hq * d.t];
        delta.par_chunks_mut(d.t).enumerate().for_each(|(bh, dl)| {
            let rows = &dout[bh * d.t * w..(bh + 1) * d.t * w];
            let outs = &o[bh * d.t * w..(bh + 1) * d.t * w];
            for ((e, g), y) in dl.iter_mut().zip(rows.chunks(w)).zip(outs.chunks(w)) {
                *e = g.iter().zip(y).fold(T::ZERO, |acc, (&a, &b)| acc + a * b);
            }
        });
        let x = BwdIn {
            d: *d,
            layout: self.layout,
            lambda,
            scale: T::from_f64(self.scale),
            q_offset: self.q_offset,
            q,
            k,
            v2: &v2,
            dz,
            lse,
            delta: &delta,
            pairs_of: &self.pairs_of,
        };
        let task = simd::pick::<T>();
        let grads: Vec<TaskGrads<T>> = (0..d.b * d.hk / 2)
            .into_par_iter()
            .map_init(Tiles::new, |tl, bp| task(&x, bp / (d.hk / 2), bp % (d.hk / 2), tl))
            .collect();
        let (t, s, dkd) = (d.t, d.s, d.dk);
        for g in grads {
            let (ka, kb) = pair(self.layout, d.hk, g.p);
            dk[(g.b * d.hk + ka) * s * dkd..][..s * dkd].copy_from_slice(&g.dk_a);
            dk[(g.b * d.hk + kb) * s * dkd..][..s * dkd].copy_from_slice(&g.dk_b);
            let (va, vb) = ((g.b * d.hk + ka) * s * dvr, (g.b * d.hk + kb) * s * dvr);
            for (r, row) in g.dv_pair.chunks(w).enumerate() {
                dv[va + r * dvr..va + (r + 1) * dvr].copy_from_slice(&row[..dvr]);
                dv[vb + r * dvr..vb + (r + 1) * dvr].copy_from_slice(&row[dvr..]);
            }
            for (i, &j) in self.pairs_of[g.p].iter().enumerate() {
                let (ha, hb) = pair(self.layout, d.hq, j);
                for (slot, h) in [(2 * i, ha), (2 * i + 1, hb)] {
                    dq[(g.b * d.hq + h) * t * dkd..][..t * dkd].copy_from_slice(&g.dq[slot * t * dkd..][..t * dkd]);
                }
            }
        }
        (dq, dk, dv, dl[0])
    }
}

fn fwd_typed<T: Float>(
    op: &DiffAttn,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let d = &op.d;
    let (q, k, vl) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?, storage_slice::<T>(s3, l3)?);
    let (v, lambda) = vl.split_at(vl.len() - 1);
    let (o, lse, _) = op.attend(q, k, v);
    let mut z = vec![T::ZERO; o.len() / 2];
    op.combine().fwd(&o, lambda, &mut z);
    *op.saved.lock().unwrap() = Some((T::to_cpu_storage_owned(o), T::to_cpu_storage_owned(lse)));
    Ok((T::to_cpu_storage_owned(z), Shape::from_dims(&[d.b, d.hq / 2, d.t, d.dv])))
}

fn bwd_typed<T: Float>(
    op: &DiffAttn,
    q: &Tensor,
    k: &Tensor,
    vl: &Tensor,
    dz: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let saved = op.saved.lock().unwrap().take();
    let (dq, dk, dvl) = with_slice::<T, _>(q, |qs| {
        with_slice::<T, _>(k, |ks| {
            with_slice::<T, _>(vl, |vls| {
                with_slice::<T, _>(dz, |dzs| {
                    let (v, lambda) = vls.split_at(vls.len() - 1);
                    let recomputed;
                    let (o, lse): (&[T], &[T]) = match &saved {
                        Some((o, l)) => (o.as_slice::<T>()?, l.as_slice::<T>()?),
                        None => {
                            let (o, l, _) = op.attend(qs, ks, v);
                            recomputed = (o, l);
                            (&recomputed.0, &recomputed.1)
                        }
                    };
                    let (dq, dk, mut dv, dl) = op.backward(shared_maps(&op.d), qs, ks, v, lambda[0], o, lse, dzs);
                    dv.push(dl);
                    Ok((dq, dk, dv))
                })
            })
        })
    })?;
    // Keep the saved outputs for a possible second backward through the same graph.
    *op.saved.lock().unwrap() = saved;
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, q.shape(), dev)?,
        Tensor::from_vec(dk, k.shape(), dev)?,
        Tensor::from_vec(dvl, vl.shape(), dev)?,
    ))
}

impl CustomOp3 for DiffAttn {
    fn name(&self) -> &'static str {
        "difftx-diff-attention"
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
            dt => bail!("difftx-diff-attention: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        vl: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dz = grad_res.to_dtype(q.dtype())?;
        let (dq, dk, dvl) = match q.dtype() {
            DType::F32 => bwd_typed::<f32>(self, q, k, vl, &dz)?,
            DType::F64 => bwd_typed::<f64>(self, q, k, vl, &dz)?,
            dt => bail!("difftx-diff-attention: unsupported dtype {dt:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dvl)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared-map backward equals the composition's backward (which tests/diff_attention.rs
    /// checks against composed candle ops and finite differences) in f64, whichever path the
    /// thread count picks.
    #[test]
    fn shared_map_backward_equals_composed_backward() {
        let cases = [
            // (b, hq, hk, t, s, dk, dv, q_offset, layout)
            (2, 4, 4, 77, 77, 8, 8, 0, PairLayout::Interleaved),
            (1, 8, 4, 150, 150, 16, 16, 0, PairLayout::Halves), // GQA 2, two key tiles
            (1, 12, 4, 300, 300, 8, 12, 0, PairLayout::Halves), // GQA 3, three tiles, dv != dk
            (2, 4, 2, 37, 100, 5, 7, 63, PairLayout::Halves),   // KV offset, odd head dims
            (1, 4, 4, 1, 70, 8, 8, 69, PairLayout::Interleaved), // one row against a cache
            (1, 2, 2, 140, 290, 4, 4, 150, PairLayout::Interleaved), // offset not aligned to tiles
        ];
        for (b, hq, hk, t, s, dk, dv, off, layout) in cases {
            let d = Dims { b, hq, hk, t, s, dk, dv: 2 * dv };
            let op = DiffAttn {
                d,
                layout,
                scale: 0.3,
                q_offset: off,
                pairs_of: query_pairs_per_kv_pair(&d, layout).unwrap(),
                saved: Mutex::new(None),
            };
            let gen = |n: usize, p: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + p).sin()).collect() };
            let q = gen(b * hq * t * dk, 0.1);
            let k = gen(b * hk * s * dk, 0.2);
            let v = gen(b * hk * s * dv, 0.3);
            let dz = gen(b * hq / 2 * t * 2 * dv, 0.4);
            let (o, lse, _) = op.attend(&q, &k, &v);
            let shared = op.backward(true, &q, &k, &v, 0.6, &o, &lse, &dz);
            let composed = op.backward(false, &q, &k, &v, 0.6, &o, &lse, &dz);
            let what = format!("{d:?} {layout:?} offset {off}");
            for (name, a, w) in
                [("dq", &shared.0, &composed.0), ("dk", &shared.1, &composed.1), ("dv", &shared.2, &composed.2)]
            {
                let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
                let diff = a.iter().zip(w).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                assert!(scale > 0.0 && diff <= 1e-12 * scale, "{what}: {name} diff {diff} (scale {scale})");
            }
            assert_eq!(shared.3, composed.3, "{what}: dlambda");
        }
    }
}
