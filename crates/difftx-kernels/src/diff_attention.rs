//! The differential attentions with the combination inside, so that the backward shares work
//! between the two maps of a pair: diff-v1's ([`diff_attention`]) and diff-v2's
//! ([`diff_v2_attention`]).
//!
//! Layouts (row-major): `q` `[B, Hq, T, dk]`, `k` `[B, Hk, S, dk]`, `v` `[B, Hk, S, dv]`; query
//! head `h` reads kv head `h / (Hq / Hk)` (GQA).
//!
//! diff-v1: `λ` one element; out `z` `[B, Hq/2, T, 2dv]`. Query pair `j` is `(a(j), b(j))` and kv
//! pair `p` is `(a'(p), b'(p))` by the same [`PairLayout`] over the query and the kv heads; both
//! heads of a query pair must read the two heads of one kv pair, first to first (true for halves
//! at any GQA ratio and for interleaved pairs without GQA). The value of kv pair `p` is
//! `V_p = [v_{a'}, v_{b'}]` (`2dv` wide) and
//!
//! `z_j = softmax(scale q_a k_{a'}ᵀ) V_p − λ·softmax(scale q_b k_{b'}ᵀ) V_p`   (causal, KV offset)
//!
//! diff-v2: `λ` one per pair and position, `[B, Hq/2, T]`; out `z` `[B, Hq/2, T, dv]`. Query
//! pair `j` is `(2j, 2j+1)`, both heads read one kv head `g` (an even number of query heads per
//! kv head), and `z_{j,t} = softmax(scale q_a k_gᵀ)_t v_g − λ_{j,t}·softmax(scale q_b k_gᵀ)_t v_g`.
//!
//! Forward: one flash attention over all heads (diff-v1's on the pair values), then the
//! combination: the same kernels as the composition (`pair_values` →) `flash_attention` →
//! `diff_combine_pairs`.
//!
//! Backward, per task `(batch, kv pair)` (diff-v1) or `(batch, kv head)` (diff-v2), `V` the value
//! both maps multiply and `K_a`, `K_b` their keys (one and the same for diff-v2): with `P_a`,
//! `P_b` the two maps (recomputed from the saved log-sum-exps), `dz` the output gradient,
//! `delta_a = rowsum(dz ∘ o_a)`, `delta_b = −λ·rowsum(dz ∘ o_b)` (λ of the row's position):
//! * `dP = dz Vᵀ` once for both maps (map b's is `−λ·dP`),
//! * `dS_a = scale·P_a ∘ (dP − delta_a)`, `dS_b = scale·P_b ∘ (−λ·dP − delta_b)`,
//! * `dV += (P_a − λ·P_b)ᵀ dz` once for both maps,
//! * `dK_a += dS_aᵀ q_a`, `dK_b += dS_bᵀ q_b`, `dq_a += dS_a K_a`, `dq_b += dS_b K_b`,
//! * `dλ = −Σ dz ∘ o_b` (per position for diff-v2).
//!
//! Per pair and tile that is 10 tile-product units for diff-v1 (in units of `d`-wide products)
//! where flash's backward over the composed path does 14 (`dP` and `dV` are `2d` wide, once per
//! map; the baseline's two heads also do 10), and 8 for diff-v2 where the composition does 10. A
//! task owns its kv heads' `dK`, `dV` and the `dq` of the query pairs that read them: no races,
//! deterministic. With fewer than `ONE_PASS_TASKS_PER_THREAD` tasks per thread (long sequences
//! over few heads) the backward runs the composition's own backward (combination, flash, pair
//! values) instead, which splits the work finer.

// Kernels over raw slices naturally take many arguments.
#![allow(clippy::too_many_arguments)]

use crate::cpu::{storage_slice, with_slice, zeroed, zeros};
use crate::diff_combine::DiffCombinePairs;
use crate::flash::{flash_bwd, flash_fwd_new, key_block_rects, keys_seen, Dims, BC, BR, ONE_PASS_TASKS_PER_THREAD};
use crate::float::{exp_shifted_prefix, Float};
use crate::pair_values::PairValues;
use crate::tile::{mm_tile, transpose_into, TileProducts};
use crate::PairLayout;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::mem::MaybeUninit;
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
    products: TileProducts,
) -> Result<Tensor> {
    DiffAttn::apply(q, k, v, lambda, Maps::V1(layout), scale, q_offset, products)
}

/// diff-v2's attention `z_{j,t} = A_{2j} v_g − λ_{j,t}·A_{2j+1} v_g` for every query pair `j`, `g`
/// the kv head both its heads read (see the module docs): `λ` has `B·(Hq/2)·T` elements
/// (`[B, Hq/2, T]` or `[B, Hq/2, T, 1]`), the output is `[B, Hq/2, T, dv]`. Backward for `q`, `k`,
/// `v` and `λ`. f32 and f64, one dtype; CPU only.
pub fn diff_v2_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lambda: &Tensor,
    scale: f64,
    q_offset: usize,
    products: TileProducts,
) -> Result<Tensor> {
    DiffAttn::apply(q, k, v, lambda, Maps::V2, scale, q_offset, products)
}

/// How the two maps of a query pair find their keys, value and λ.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Maps {
    /// diff-v1: query pair `(a, b)` reads kv pair `(a', b')` and its pair value `[v_a', v_b']`;
    /// one λ.
    V1(PairLayout),
    /// diff-v2: query pair `(2j, 2j+1)` reads one kv head, keys and value; λ per pair and position.
    V2,
}

impl Maps {
    /// How the query heads (and diff-v1's kv heads) form pairs.
    fn layout(self) -> PairLayout {
        match self {
            Maps::V1(layout) => layout,
            Maps::V2 => PairLayout::Interleaved,
        }
    }
}

/// The pair `(a, b)` number `j` of `n` heads.
fn pair(layout: PairLayout, n: usize, j: usize) -> (usize, usize) {
    match layout {
        PairLayout::Interleaved => (2 * j, 2 * j + 1),
        PairLayout::Halves => (j, j + n / 2),
    }
}

/// For every backward task's kv heads (diff-v1: a kv pair, diff-v2: one kv head), the query
/// pairs that read them; an error when a query pair's two heads do not read what `maps` needs.
fn query_pairs_per_task(d: &Dims, maps: Maps) -> Result<Vec<Vec<usize>>> {
    let rep = d.rep();
    let layout = maps.layout();
    let tasks = match maps {
        Maps::V1(_) => d.hk / 2,
        Maps::V2 => d.hk,
    };
    let mut pairs_of = vec![Vec::new(); tasks];
    for j in 0..d.hq / 2 {
        let (a, b) = pair(layout, d.hq, j);
        let (ka, kb) = (a / rep, b / rep);
        let task = match maps {
            Maps::V1(_) => (0..tasks).find(|&p| pair(layout, d.hk, p) == (ka, kb)),
            Maps::V2 => (ka == kb).then_some(ka),
        };
        match (task, maps) {
            (Some(p), _) => pairs_of[p].push(j),
            (None, Maps::V1(_)) => bail!(
                "difftx_kernels::diff_attention: with {layout:?} pairs, {} query heads and {} kv heads, query pair ({a}, {b}) reads kv heads ({ka}, {kb}), which are not a pair",
                d.hq,
                d.hk
            ),
            (None, Maps::V2) => bail!(
                "difftx_kernels::diff_v2_attention: {} query heads over {} kv heads: query pair ({a}, {b}) reads two kv heads ({ka}, {kb}); each kv head must serve an even number of query heads",
                d.hq,
                d.hk
            ),
        }
    }
    Ok(pairs_of)
}

struct DiffAttn {
    /// Flash attention's dims over all heads, `dv` the width of the value both maps multiply
    /// (diff-v1: the pair value's `2dv`).
    d: Dims,
    maps: Maps,
    scale: f64,
    q_offset: usize,
    /// Per backward task's kv heads, the query pairs that read them.
    pairs_of: Vec<Vec<usize>>,
    /// Saved by the forward for the backward: every head's output `[B, Hq, T, dv]` and
    /// log-sum-exp `[B, Hq, T]`.
    saved: Mutex<Option<(CpuStorage, CpuStorage)>>,
}

impl DiffAttn {
    fn apply(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        lambda: &Tensor,
        maps: Maps,
        scale: f64,
        q_offset: usize,
        products: TileProducts,
    ) -> Result<Tensor> {
        let name = match maps {
            Maps::V1(_) => "difftx_kernels::diff_attention",
            Maps::V2 => "difftx_kernels::diff_v2_attention",
        };
        let dt = q.dtype();
        if !matches!(dt, DType::F32 | DType::F64) {
            bail!("{name}: unsupported dtype {dt:?} (f32, f64 only)");
        }
        if k.dtype() != dt || v.dtype() != dt || lambda.dtype() != dt {
            bail!("{name}: q, k, v and lambda must share one dtype");
        }
        let (b, hq, t, dk) = q.dims4()?;
        let (bk, hk, s, dk2) = k.dims4()?;
        let (bv, hv, sv, dv) = v.dims4()?;
        if bk != b || bv != b || hv != hk || sv != s || dk2 != dk {
            bail!(
                "{name}: shapes q {:?}, k {:?}, v {:?} do not fit [B, Hq, T, dk], [B, Hk, S, dk], [B, Hk, S, dv]",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        let kv_even = matches!(maps, Maps::V2) || hk % 2 == 0;
        if hq % 2 != 0 || !kv_even || hk == 0 || hq % hk != 0 {
            bail!("{name}: {hq} query heads and {hk} kv heads cannot form pairs (Hq even and a multiple of Hk; Hk even for diff-v1)");
        }
        let n_lambda = match maps {
            Maps::V1(_) => 1,
            Maps::V2 => b * (hq / 2) * t,
        };
        if lambda.elem_count() != n_lambda {
            bail!("{name}: lambda must have {n_lambda} elements, got shape {:?}", lambda.dims());
        }
        if s == 0 && t > 0 {
            bail!("{name}: no keys (S = 0)");
        }
        let width = match maps {
            Maps::V1(_) => 2 * dv,
            Maps::V2 => dv,
        };
        let d = Dims { b, hq, hk, t, s, dk, dv: width, products };
        let pairs_of = query_pairs_per_task(&d, maps)?;
        let op = DiffAttn { d, maps, scale, q_offset, pairs_of, saved: Mutex::new(None) };
        // candle's custom ops take three inputs: λ rides at the end of v's flattened data.
        let v_lambda = Tensor::cat(&[&v.flatten_all()?, &lambda.flatten_all()?], 0)?;
        q.contiguous()?.apply_op3(&k.contiguous()?, &v_lambda, op)
    }

    fn pair_values(&self) -> PairValues {
        PairValues { b: self.d.b, h: self.d.hk, s: self.d.s, d: self.d.dv / 2, layout: self.maps.layout() }
    }

    /// The value both maps of a pair multiply, per kv head: diff-v1's pair values, diff-v2's `v`.
    fn values<'a, T: Float>(&self, v: &'a [T]) -> Cow<'a, [T]> {
        match self.maps {
            Maps::V1(_) => Cow::Owned(self.pair_values().fwd(v)),
            Maps::V2 => Cow::Borrowed(v),
        }
    }

    fn combine(&self) -> DiffCombinePairs {
        let (d, p) = (&self.d, self.d.hq / 2);
        let (outer, inner) = match self.maps.layout() {
            PairLayout::Interleaved => (d.b * p, d.t * d.dv),
            PairLayout::Halves => (d.b, p * d.t * d.dv),
        };
        let width = match self.maps {
            Maps::V1(_) => 0,
            Maps::V2 => d.dv,
        };
        DiffCombinePairs { outer, inner, width }
    }

    /// Every head's output and log-sum-exp.
    fn attend<T: Float>(&self, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<T>) {
        flash_fwd_new(&self.d, self.scale, self.q_offset, q, k, &self.values(v))
    }

    /// The backward tasks' kv heads `(a, b)` for task `u` (diff-v2: one head twice).
    fn task_kv(&self, u: usize) -> (usize, usize) {
        match self.maps {
            Maps::V1(layout) => pair(layout, self.d.hk, u),
            Maps::V2 => (u, u),
        }
    }

    /// Elements of the op's `v` input (before λ at its end).
    fn value_len(&self) -> usize {
        let d = &self.d;
        let width = match self.maps {
            Maps::V1(_) => d.dv / 2,
            Maps::V2 => d.dv,
        };
        d.b * d.hk * d.s * width
    }
}

/// Where one backward task writes: the gradients of its kv heads and of the query heads that
/// read them, slices of the op's gradient buffers that no other task touches.
struct TaskOut<'a, T> {
    b: usize,
    u: usize,
    /// `[S, dk]` each; `dk_b` is `None` when both maps read one kv head (its gradient goes to `dk_a`).
    dk_a: &'a mut [T],
    dk_b: Option<&'a mut [T]>,
    /// `[S, dv]` per kv head: diff-v1's two heads (halves of the pair value's gradient), diff-v2's one.
    dv: Vec<&'a mut [T]>,
    /// `[T, dk]` heads a and b of every query pair reading these kv heads.
    dq: Vec<(&'a mut [T], &'a mut [T])>,
}

impl<'a, T: Float> TaskOut<'a, MaybeUninit<T>> {
    /// The task's slices zero-filled (the kernels accumulate into them).
    fn zeroed(self) -> TaskOut<'a, T> {
        TaskOut {
            b: self.b,
            u: self.u,
            dk_a: zeroed(self.dk_a),
            dk_b: self.dk_b.map(zeroed),
            dv: self.dv.into_iter().map(zeroed).collect(),
            dq: self.dq.into_iter().map(|(a, b)| (zeroed(a), zeroed(b))).collect(),
        }
    }
}

/// Inputs of the shared-map backward.
struct BwdIn<'a, T> {
    d: Dims,
    layout: PairLayout,
    /// One element, or one per pair and position `[B, Hq/2, T]`.
    lambda: &'a [T],
    scale: T,
    q_offset: usize,
    q: &'a [T],
    k: &'a [T],
    /// `[B, Hk, S, dv]`: the value both maps multiply, per kv head.
    v: &'a [T],
    dz: &'a [T],
    lse: &'a [T],
    /// `[B, Hq, T]`: `rowsum(dz ∘ o_a)` for heads a, `−λ·rowsum(dz ∘ o_b)` for heads b.
    delta: &'a [T],
    pairs_of: &'a [Vec<usize>],
}

impl<T: Float> BwdIn<'_, T> {
    /// λ of pair `bj` (batch-major) at query row `row`.
    #[inline(always)]
    fn lambda_at(&self, bj: usize, row: usize) -> T {
        if self.lambda.len() == 1 {
            self.lambda[0]
        } else {
            self.lambda[bj * self.d.t + row]
        }
    }
}

/// Per-thread `[BR, BC]` tiles, overwritten in place so that a task's working set stays close
/// to flash's two tiles (it spilled out of a 512 KiB L2 with five): both maps' scores /
/// probabilities, then map a's becomes `P_a − λ·P_b` and map b's `dS_b`; the shared `dP`, then
/// `dS_a`.
struct Tiles<T> {
    pa: Vec<T>,
    pb: Vec<T>,
    dp: Vec<T>,
    /// The key block's keys `[dk, BC]` (map a's, map b's) and values `[dv, BC]` transposed, so
    /// that every tile product reads its right-hand side by rows ([`mm_rows`]).
    kt_a: Vec<T>,
    kt_b: Vec<T>,
    vt: Vec<T>,
}

impl<T: Float> Tiles<T> {
    fn new(d: &Dims) -> Self {
        let z = |rows: usize| vec![T::ZERO; rows * BC];
        Tiles { pa: z(BR), pb: z(BR), dp: z(BR), kt_a: z(d.dk), kt_b: z(d.dk), vt: z(d.dv) }
    }
}

/// One task: kv heads `kv = (a', b')` of batch `g.b` (task `g.u`) and every query pair that
/// reads them (module docs). The gradient slices in `g` must hold zeros.
#[inline(always)]
fn pair_task<T: Float>(x: &BwdIn<T>, kv: (usize, usize), g: &mut TaskOut<T>, tl: &mut Tiles<T>) {
    let d = &x.d;
    let (dk, w, t, s) = (d.dk, d.dv, d.t, d.s);
    let (b, (ka, kb)) = (g.b, kv);
    let js = &x.pairs_of[g.u];
    // the value's gradient [S, w], split among the kv heads at the end
    let mut dv = vec![T::ZERO; s * w];
    let k_a = &x.k[(b * d.hk + ka) * s * dk..][..s * dk];
    let k_b = &x.k[(b * d.hk + kb) * s * dk..][..s * dk];
    // diff-v1's kv heads a' and b' hold the same pair value; a' 's copy is read
    let v_p = &x.v[(b * d.hk + ka) * s * w..][..s * w];
    let mut s0 = 0;
    while s0 < s {
        let nb = (s - s0).min(BC);
        let (kab, kbb, vb) =
            (&k_a[s0 * dk..(s0 + nb) * dk], &k_b[s0 * dk..(s0 + nb) * dk], &v_p[s0 * w..(s0 + nb) * w]);
        transpose_into(kab, nb, dk, &mut tl.kt_a, BC);
        if kb != ka {
            transpose_into(kbb, nb, dk, &mut tl.kt_b, BC);
        }
        transpose_into(vb, nb, w, &mut tl.vt, BC);
        let kt_b = if kb != ka { &tl.kt_b } else { &tl.kt_a };
        for (i, &j) in js.iter().enumerate() {
            let (ha, hb) = pair(x.layout, d.hq, j);
            let (bha, bhb) = (b * d.hq + ha, b * d.hq + hb);
            let bj = b * (d.hq / 2) + j;
            // the rectangles of visible scores (`t0`, `rows`, `nb` are a rectangle's)
            for (t0, rows, nb) in key_block_rects(s0, nb, t, x.q_offset) {
                let qa = &x.q[(bha * t + t0) * dk..][..rows * dk];
                let qb = &x.q[(bhb * t + t0) * dk..][..rows * dk];
                let dzb = &x.dz[(bj * t + t0) * w..][..rows * w];
                mm_tile(d.products, rows, nb, dk, &mut tl.pa, BC, false, qa, dk, 1, &tl.kt_a, BC, x.scale);
                mm_tile(d.products, rows, nb, dk, &mut tl.pb, BC, false, qb, dk, 1, kt_b, BC, x.scale);
                mm_tile(d.products, rows, nb, w, &mut tl.dp, BC, false, dzb, w, 1, &tl.vt, BC, T::ONE);
                for r in 0..rows {
                    let n = keys_seen(t0 + r, x.q_offset, s0, nb);
                    let (ra, rb) = (bha * t + t0 + r, bhb * t + t0 + r);
                    let row = r * BC..r * BC + nb;
                    let (pa, pb) = (&mut tl.pa[row.clone()], &mut tl.pb[row.clone()]);
                    for (e, l) in [(&mut *pa, x.lse[ra]), (&mut *pb, x.lse[rb])] {
                        exp_shifted_prefix(e, n, l);
                    }
                    let minus_lambda = T::ZERO - x.lambda_at(bj, t0 + r);
                    let (da, db) = (x.delta[ra], x.delta[rb]);
                    // dp becomes dS_a, pb dS_b, pa P_a − λ·P_b
                    let dp = &mut tl.dp[row];
                    for c in 0..nb {
                        let (gp, pbc) = (dp[c], pb[c]);
                        dp[c] = pa[c] * (gp - da) * x.scale;
                        pb[c] = pbc * (minus_lambda * gp - db) * x.scale;
                        pa[c] += minus_lambda * pbc;
                    }
                }
                let dvb = &mut dv[s0 * w..(s0 + nb) * w];
                mm_tile(d.products, nb, w, rows, dvb, w, true, &tl.pa, 1, BC, dzb, w, T::ONE);
                let (dsa, dsb) = (&tl.dp, &tl.pb);
                mm_tile(
                    d.products,
                    nb,
                    dk,
                    rows,
                    &mut g.dk_a[s0 * dk..(s0 + nb) * dk],
                    dk,
                    true,
                    dsa,
                    1,
                    BC,
                    qa,
                    dk,
                    T::ONE,
                );
                let dk_b = g.dk_b.as_deref_mut().unwrap_or(&mut *g.dk_a);
                mm_tile(
                    d.products,
                    nb,
                    dk,
                    rows,
                    &mut dk_b[s0 * dk..(s0 + nb) * dk],
                    dk,
                    true,
                    dsb,
                    1,
                    BC,
                    qb,
                    dk,
                    T::ONE,
                );
                let (dq_a, dq_b) = &mut g.dq[i];
                mm_tile(
                    d.products,
                    rows,
                    dk,
                    nb,
                    &mut dq_a[t0 * dk..(t0 + rows) * dk],
                    dk,
                    true,
                    dsa,
                    BC,
                    1,
                    kab,
                    dk,
                    T::ONE,
                );
                mm_tile(
                    d.products,
                    rows,
                    dk,
                    nb,
                    &mut dq_b[t0 * dk..(t0 + rows) * dk],
                    dk,
                    true,
                    dsb,
                    BC,
                    1,
                    kbb,
                    dk,
                    T::ONE,
                );
            }
        }
        s0 += nb;
    }
    // diff-v1: the pair value's halves to kv heads a' and b'; diff-v2: the one kv head's
    let part = w / g.dv.len();
    for (r, row) in dv.chunks(w).enumerate() {
        for (head, half) in g.dv.iter_mut().zip(row.chunks(part)) {
            head[r * part..(r + 1) * part].copy_from_slice(half);
        }
    }
}

mod simd {
    use super::*;

    pub(super) type TaskFn<T> = fn(&BwdIn<T>, (usize, usize), &mut TaskOut<T>, &mut Tiles<T>);

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn task_avx2<T: Float>(x: &BwdIn<T>, kv: (usize, usize), g: &mut TaskOut<T>, tl: &mut Tiles<T>) {
        pair_task(x, kv, g, tl)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn task_avx512<T: Float>(x: &BwdIn<T>, kv: (usize, usize), g: &mut TaskOut<T>, tl: &mut Tiles<T>) {
        pair_task(x, kv, g, tl)
    }

    /// The task compiled for the best instruction set this CPU has.
    pub(super) fn pick<T: Float>() -> TaskFn<T> {
        match crate::cpu::isa_level(crate::cpu::BEST_ISA) {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            #[cfg(target_arch = "x86_64")]
            2 => |x, kv, g, tl| unsafe { task_avx512(x, kv, g, tl) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            1 => |x, kv, g, tl| unsafe { task_avx2(x, kv, g, tl) },
            _ => |x, kv, g, tl| pair_task(x, kv, g, tl),
        }
    }
}

impl DiffAttn {
    /// Whether the backward shares the maps' work in (batch, kv heads) tasks (enough of them to
    /// keep every thread busy) rather than running the composition's backward.
    fn shared_maps(&self) -> bool {
        let d = &self.d;
        d.dk > 0
            && d.dv > 0
            && d.t > 0
            && d.b * self.pairs_of.len() >= ONE_PASS_TASKS_PER_THREAD * rayon::current_num_threads()
    }

    /// Gradients `(dq, dk, dv, dλ)`; `shared`: the shared-map tasks, else the composition's
    /// backward (combination, flash, pair values).
    #[allow(clippy::type_complexity)]
    fn backward<T: Float>(
        &self,
        shared: bool,
        q: &[T],
        k: &[T],
        v: &[T],
        lambda: &[T],
        o: &[T],
        lse: &[T],
        dz: &[T],
    ) -> (Vec<T>, Vec<T>, Vec<T>, Vec<T>) {
        let d = &self.d;
        let w = d.dv;
        let combine = self.combine();
        let mut dl = zeros::<T>(lambda.len());
        let values = self.values(v);
        if !shared {
            let (mut dq, mut dk, mut dv) = (zeros::<T>(q.len()), zeros::<T>(k.len()), zeros::<T>(v.len()));
            // the combination's backward: every head's output gradient and dλ = −Σ dz ∘ o_b
            let mut dout = zeros::<T>(o.len());
            combine.bwd(o, lambda, dz, &mut dout, &mut dl);
            match self.maps {
                Maps::V1(_) => {
                    let mut dv2 = zeros::<T>(values.len());
                    flash_bwd(d, self.scale, self.q_offset, q, k, &values, o, &dout, lse, &mut dq, &mut dk, &mut dv2);
                    self.pair_values().bwd(&dv2, &mut dv);
                }
                Maps::V2 => flash_bwd(d, self.scale, self.q_offset, q, k, v, o, &dout, lse, &mut dq, &mut dk, &mut dv),
            }
            return (dq, dk, dv, dl);
        }
        // dλ, and delta per query head and position, rowsum(dout_h ∘ o_h) with dout being dz for
        // heads a and −λ·dz for heads b, without forming dout: [B, Hq, T] is [outer, 2, inner/w]
        // like the outputs
        let mut delta = zeros::<T>(d.b * d.hq * d.t);
        combine.bwd_row_sums(o, lambda, dz, w, &mut delta, &mut dl);
        let x = BwdIn {
            d: *d,
            layout: self.maps.layout(),
            lambda,
            scale: T::from_f64(self.scale),
            q_offset: self.q_offset,
            q,
            k,
            v: &values,
            dz,
            lse,
            delta: &delta,
            pairs_of: &self.pairs_of,
        };
        // Hand every task its heads' gradient slices, uninitialised: each task zero-fills its own
        // (in its cache) before accumulating into them, instead of a fill pass over all three
        // first. dv has room for dλ, which the caller appends.
        let (t, s, dkd, units) = (d.t, d.s, d.dk, self.pairs_of.len());
        let dv_head = v.len() / (d.b * d.hk);
        let (mut dq, mut dk) = (Vec::with_capacity(q.len()), Vec::with_capacity(k.len()));
        let mut dv = Vec::with_capacity(v.len() + lambda.len());
        let mut dq_heads: Vec<_> = dq.spare_capacity_mut()[..q.len()].chunks_mut(t * dkd).map(Some).collect();
        let mut dk_heads: Vec<_> = dk.spare_capacity_mut()[..k.len()].chunks_mut(s * dkd).map(Some).collect();
        let mut dv_heads: Vec<_> = dv.spare_capacity_mut()[..v.len()].chunks_mut(dv_head).map(Some).collect();
        fn take<'a, T>(heads: &mut [Option<&'a mut [T]>], i: usize) -> &'a mut [T] {
            heads[i].take().expect("every head belongs to one task")
        }
        let mut outs = Vec::with_capacity(d.b * units);
        for b in 0..d.b {
            for u in 0..units {
                let (ka, kb) = self.task_kv(u);
                let (kva, kvb) = (b * d.hk + ka, b * d.hk + kb);
                let dk_a = take(&mut dk_heads, kva);
                let dk_b = (ka != kb).then(|| take(&mut dk_heads, kvb));
                let mut dvs = vec![take(&mut dv_heads, kva)];
                if ka != kb {
                    dvs.push(take(&mut dv_heads, kvb));
                }
                let dqs = self.pairs_of[u]
                    .iter()
                    .map(|&j| {
                        let (ha, hb) = pair(self.maps.layout(), d.hq, j);
                        (take(&mut dq_heads, b * d.hq + ha), take(&mut dq_heads, b * d.hq + hb))
                    })
                    .collect();
                outs.push(TaskOut { b, u, dk_a, dk_b, dv: dvs, dq: dqs });
            }
        }
        // Every head of the three went to a task (the buffers are initialised by the tasks alone).
        let all_taken = |heads: &[Option<_>]| heads.iter().all(Option::is_none);
        assert!(all_taken(&dq_heads) && all_taken(&dk_heads) && all_taken(&dv_heads), "a gradient head without a task");
        let task = simd::pick::<T>();
        outs.into_par_iter().for_each_init(|| Tiles::new(d), |tl, g| task(&x, self.task_kv(g.u), &mut g.zeroed(), tl));
        // SAFETY: the chunks cover each buffer's length (q, k, v hold whole heads of t·dk, s·dk
        // and dv_head values), every chunk went to one task (asserted above), and each task
        // zero-filled all of its chunks (TaskOut::zeroed) before writing them.
        unsafe {
            dq.set_len(q.len());
            dk.set_len(k.len());
            dv.set_len(v.len());
        }
        (dq, dk, dv, dl)
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
    let (v, lambda) = vl.split_at(op.value_len());
    let (o, lse) = op.attend(q, k, v);
    let z = op.combine().fwd(&o, lambda);
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
                    let (v, lambda) = vls.split_at(op.value_len());
                    let recomputed;
                    let (o, lse): (&[T], &[T]) = match &saved {
                        Some((o, l)) => (o.as_slice::<T>()?, l.as_slice::<T>()?),
                        None => {
                            recomputed = op.attend(qs, ks, v);
                            (&recomputed.0, &recomputed.1)
                        }
                    };
                    let (dq, dk, mut dv, dl) = op.backward(op.shared_maps(), qs, ks, v, lambda, o, lse, dzs);
                    dv.extend_from_slice(&dl);
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
        crate::profile::timed_attention(crate::profile::Pass::Forward, || match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::F64 => fwd_typed::<f64>(self, s1, l1, s2, l2, s3, l3),
            dt => bail!("difftx-diff-attention: unsupported dtype {dt:?}"),
        })
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
        let (dq, dk, dvl) = crate::profile::timed_attention(crate::profile::Pass::Backward, || match q.dtype() {
            DType::F32 => bwd_typed::<f32>(self, q, k, vl, &dz),
            DType::F64 => bwd_typed::<f64>(self, q, k, vl, &dz),
            dt => bail!("difftx-diff-attention: unsupported dtype {dt:?}"),
        })?;
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
        let (il, hv) = (Maps::V1(PairLayout::Interleaved), Maps::V1(PairLayout::Halves));
        let cases = [
            // (b, hq, hk, t, s, dk, dv, q_offset, maps)
            (2, 4, 4, 77, 77, 8, 8, 0, il),
            (1, 8, 4, 150, 150, 16, 16, 0, hv),     // GQA 2, two key tiles
            (1, 12, 4, 300, 300, 8, 12, 0, hv),     // GQA 3, three tiles, dv != dk
            (2, 4, 2, 37, 100, 5, 7, 63, hv),       // KV offset, odd head dims
            (1, 4, 4, 1, 70, 8, 8, 69, il),         // one row against a cache
            (1, 2, 2, 140, 290, 4, 4, 150, il),     // offset not aligned to tiles
            (2, 8, 2, 150, 150, 8, 8, 0, Maps::V2), // diff-v2: two pairs per kv head, two tiles
            (1, 2, 1, 37, 100, 5, 7, 63, Maps::V2), // diff-v2: KV offset, odd dims, dv != dk
            (1, 12, 3, 1, 70, 8, 8, 69, Maps::V2),  // diff-v2: one row against a cache
        ];
        for (b, hq, hk, t, s, dk, dv, off, maps) in cases {
            let width = if maps == Maps::V2 { dv } else { 2 * dv };
            let d = Dims { b, hq, hk, t, s, dk, dv: width, products: TileProducts::Native };
            let op = DiffAttn {
                d,
                maps,
                scale: 0.3,
                q_offset: off,
                pairs_of: query_pairs_per_task(&d, maps).unwrap(),
                saved: Mutex::new(None),
            };
            let gen = |n: usize, p: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + p).sin()).collect() };
            let q = gen(b * hq * t * dk, 0.1);
            let k = gen(b * hk * s * dk, 0.2);
            let v = gen(b * hk * s * dv, 0.3);
            let dz = gen(b * hq / 2 * t * width, 0.4);
            let lambda: Vec<f64> = match maps {
                Maps::V2 => gen(b * hq / 2 * t, 0.5).iter().map(|x| 0.5 + 0.4 * x).collect(),
                Maps::V1(_) => vec![0.6],
            };
            let (o, lse) = op.attend(&q, &k, &v);
            let shared = op.backward(true, &q, &k, &v, &lambda, &o, &lse, &dz);
            let composed = op.backward(false, &q, &k, &v, &lambda, &o, &lse, &dz);
            let what = format!("{d:?} {maps:?} offset {off}");
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
