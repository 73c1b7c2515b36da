//! Fused causal attention (FlashAttention-2 style) with backward, on the CPU.
//!
//! Layouts (row-major, contiguous):
//! * `q`  `[B, Hq, T, dk]`, `k` `[B, Hk, S, dk]`, `v` `[B, Hk, S, dv]`, `out`/`dout` `[B, Hq, T, dv]`
//! * `lse` `[B, Hq, T]`: per query row `m + ln(l)` (log-sum-exp of the scaled scores), saved by the
//!   forward for the backward; `delta` `[B, Hq, T]`: `rowsum(dout * out)` (backward only).
//! * GQA: query head `h` reads kv head `h / (Hq / Hk)`.
//! * Causality with offset: query row `t` sits at absolute position `t + q_offset` and sees keys
//!   `s <= t + q_offset` (clipped to `S - 1`). Key blocks entirely in the future are skipped; in a
//!   diagonal block a row only exponentiates its visible prefix and zeroes the rest (no `-inf`
//!   arithmetic), and the tile products only cover the rectangles that hold visible scores
//!   (`causal_chunks`). There is no `N x N` map anywhere: the largest temporary is a `[BR, BC]`
//!   tile.
//!
//! Forward, per task `(b, h, block of BR query rows)`: loop over key blocks of `BC` keys;
//! `S = scale Q K^T` (`[BR, BC]`) and `O += P V` are tile products (`tile::mm_rows`, one thread
//! each; the parallelism is rayon over tasks); between them the online softmax keeps, per row,
//! the running max `m`, the running sum `l`, and rescales the unnormalised output row. At the end
//! `O /= l` and `lse = m + ln l`. With fewer than `DOT_ROWS` rows (decode, T = 1) the rows are
//! processed one at a time with dot products and axpys instead of tiles. With GQA (several query
//! heads per kv head) a task is `(b, kv head, block of BR / rep rows)` instead and stacks the
//! rows of all the kv head's query heads, so that each key and value tile is multiplied against
//! all of them in one product (`fwd_group_task`; the same arithmetic per row).
//!
//! Backward (FlashAttention-2 recompute, no atomics, deterministic):
//! * `delta_t = dout_t · out_t`.
//! * With at least `ONE_PASS_TASKS_PER_THREAD` (batch, kv head) pairs per thread (training
//!   shapes), one pass, per task `(b, kv head)`: for every key block, every query head of the
//!   group and every block of query rows that sees the key block, recompute
//!   `P = exp(scale Q K^T - lse)` and `dS = scale P (dO V^T - delta)` once, and accumulate
//!   `dV += P^T dO`, `dK += dS^T Q` and `dQ += dS K`; the task owns its kv head's dK, dV and its
//!   group's dQ, so nothing races (5 tile products per tile).
//! * Otherwise (long sequences over few heads) two passes split the work finer:
//!   pass 1, per task `(b, kv head, key block)`: the same recompute, accumulating `dV` and `dK`
//!   into the key block's own rows; pass 2, per task `(b, h, query block)`: the same recompute,
//!   accumulating `dQ += dS K` (7 tile products per tile).
//!
//! Memory beyond inputs/outputs is O(B·Hq·T) for `lse`/`delta` plus per-thread tiles.

// Kernels over raw slices naturally take many arguments.
#![allow(clippy::too_many_arguments)]

use crate::cpu::{storage_slice, zeroed, zeros, BEST_ISA};
use crate::float::{exp_down_columns, exp_shifted_prefix, exp_shifted_sum, max_down_columns, max_slice, Float};
use crate::tile::{mm_tile, transpose_into, TileProducts};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Mutex;

/// Query rows per forward / dq task.
pub(crate) const BR: usize = 128;
/// Keys per key block. 128 x 128 measured faster than 64 x 64 (fewer small gemm calls; with the
/// tile kernel of `tile.rs` the two measured alike on the Zen 4, docs/design.md §7.20).
pub(crate) const BC: usize = 128;
/// Below this many rows per task the forward uses dot products instead of tile products
/// (measured 2-3x faster for T = 1 decode).
const DOT_ROWS: usize = 4;
/// Causal flash attention with backward (dq, dk, dv).
///
/// q: [B, Hq, T, dk], k: [B, Hk, S, dk], v: [B, Hk, S, dv]; Hq % Hk == 0; query head i uses kv
/// head i / (Hq/Hk) (GQA). Query row t sits at absolute position t + q_offset and attends to key
/// positions s <= t + q_offset (S = q_offset + T for a KV cache; q_offset = 0 in training).
/// scores = q·k * scale. Returns out [B, Hq, T, dv]. f32 and f64; CPU only.
/// `products`: how the tiles are multiplied (bf16 values with f32 sums, or the dtype's own).
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    q_offset: usize,
    products: TileProducts,
) -> Result<Tensor> {
    let dims = check_shapes(q, k, v)?;
    if dims.s == 0 && dims.t > 0 {
        bail!("difftx_kernels::flash_attention: no keys (S = 0)");
    }
    let op = FlashAttn { scale, q_offset, products, lse: Mutex::new(None) };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) hk: usize,
    pub(crate) t: usize,
    pub(crate) s: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    /// How the tiles are multiplied (not a dimension, but what every task reads with them).
    pub(crate) products: TileProducts,
}

impl Dims {
    pub(crate) fn rep(&self) -> usize {
        self.hq / self.hk
    }
}

/// Query rows per chunk of a tile that crosses the causal diagonal (see [`causal_chunks`]).
/// Through gemm, half a tile measured faster than a quarter (more, smaller calls, each packing its
/// operands); the tile kernel of `tile.rs` packs nothing, and a quarter tile (62.5% of the
/// diagonal tile's products instead of 75%) measured faster on the Zen 4 (docs/design.md §7.20).
pub(crate) const DIAG_ROWS: usize = 32;

/// The rectangles of a causal tile that hold visible scores: query rows `t0 .. t0 + rows`
/// against keys `s0 .. s0 + nb`, as `(first row within the tile, rows, keys)`. A tile whose
/// first row sees all its keys is one rectangle; a tile crossing the diagonal is cut into chunks
/// of `DIAG_ROWS` rows, each as wide as the keys its last row sees (chunks that see none are
/// left out), so the tile products skip three quarters of the masked triangle's arithmetic: at
/// T = 256 the three 128-tiles shrink to 75% of their products (causal needs 67%).
#[inline(always)]
pub(crate) fn causal_chunks(
    t0: usize,
    rows: usize,
    s0: usize,
    nb: usize,
    q_offset: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let step = if keys_seen(t0, q_offset, s0, nb) == nb { rows.max(1) } else { DIAG_ROWS };
    (0..rows).step_by(step).filter_map(move |r0| {
        let rc = (rows - r0).min(step);
        let nc = keys_seen(t0 + r0 + rc - 1, q_offset, s0, nb);
        (nc > 0).then_some((r0, rc, nc))
    })
}

/// Every rectangle of visible scores between key block `s0 .. s0 + nb` and query rows `0 .. t`:
/// the `BR`-row tiles from the first row that sees the block, each cut by [`causal_chunks`], as
/// `(first row, rows, keys)` with the first row counted from 0.
#[inline(always)]
pub(crate) fn key_block_rects(
    s0: usize,
    nb: usize,
    t: usize,
    q_offset: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    (s0.saturating_sub(q_offset)..t).step_by(BR).flat_map(move |t0| {
        causal_chunks(t0, (t - t0).min(BR), s0, nb, q_offset).map(move |(r0, rc, nc)| (t0 + r0, rc, nc))
    })
}

/// How many keys of block `s0 .. s0 + nb` query row `row` sees (causal, KV-cache offset).
#[inline(always)]
pub(crate) fn keys_seen(row: usize, q_offset: usize, s0: usize, nb: usize) -> usize {
    (row + q_offset + 1).saturating_sub(s0).min(nb)
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
    Ok(Dims { b, hq, hk, t, s, dk, dv, products: TileProducts::Native })
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

/// Per-thread scratch tiles. `rows` below is the tallest stack of query rows a task works on:
/// `BR`, or a grouped forward's `group_rows · rep` where that is more.
pub(crate) struct Scratch<T> {
    /// One row's scores (`BC`) in the row-at-a-time forward.
    s: Vec<T>,
    /// `[rows, dk]`: the row-at-a-time forward's scaled query row (its first `dk`), the grouped
    /// forward's stacked query rows.
    qs: Vec<T>,
    /// `[rows, dv]`: the grouped forward's unnormalised output rows.
    o: Vec<T>,
    /// The tiled forward's online-softmax state.
    online: OnlineSoftmax<T>,
    /// The score / probability tile (the tiled forward's `[BC, rows]`, transposed; the
    /// backward's `[BR, BC]`) and the backward's `[BR, BC]` dP / dS tile.
    st: Vec<T>,
    dpt: Vec<T>,
    /// The tiled forward's stacked query rows transposed, `[dk, rows]`, and the backward's key
    /// block's keys `[dk, BC]` and values `[dv, BC]` transposed, so that every tile product reads
    /// its right-hand side by rows ([`mm_rows`]); `kv_block` says which block `kt` and `vt` hold
    /// (`(kv head, first key)`: keys from there to the block's end).
    qt: Vec<T>,
    kt: Vec<T>,
    vt: Vec<T>,
    kv_block: Option<(usize, usize)>,
}

impl<T: Float> Scratch<T> {
    fn new(d: &Dims) -> Self {
        // the grouped forward's stacked rows (none without it)
        let stack = if grouped(d) { group_rows(d) * d.rep() } else { 0 };
        let rows = BR.max(stack);
        Scratch {
            s: vec![T::ZERO; BC],
            qs: vec![T::ZERO; stack.max(1) * d.dk],
            o: vec![T::ZERO; stack * d.dv],
            online: OnlineSoftmax::new(rows),
            st: vec![T::ZERO; rows * BC],
            dpt: vec![T::ZERO; BR * BC],
            qt: vec![T::ZERO; d.dk * rows],
            kt: vec![T::ZERO; d.dk * BC],
            vt: vec![T::ZERO; d.dv * BC],
            kv_block: None,
        }
    }
}

/// The online softmax's state of a tiled forward task, one value per stacked query row: the
/// running max `m` and sum `l`, and per key block the new running max `m_new`, the block's sum of
/// probabilities `p_sum` and the factor `alpha` the row's output so far is rescaled by.
pub(crate) struct OnlineSoftmax<T> {
    m: Vec<T>,
    l: Vec<T>,
    m_new: Vec<T>,
    p_sum: Vec<T>,
    alpha: Vec<T>,
}

impl<T: Float> OnlineSoftmax<T> {
    fn new(rows: usize) -> Self {
        let z = || vec![T::ZERO; rows];
        OnlineSoftmax { m: z(), l: z(), m_new: z(), p_sum: z(), alpha: z() }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.

/// What a forward task reads besides its query rows: the call's sizes, scale and KV-cache
/// offset, and its kv head's keys `[S, dk]` and values `[S, dv]`.
#[derive(Clone, Copy)]
pub(crate) struct KvHead<'a, T> {
    d: &'a Dims,
    scale: T,
    q_offset: usize,
    kh: &'a [T],
    vh: &'a [T],
}

impl<'a, T> KvHead<'a, T> {
    /// Flat kv head `kv` (`b·Hk + g`) of `k` `[B, Hk, S, dk]` and `v` `[B, Hk, S, dv]`.
    fn of(d: &'a Dims, scale: T, q_offset: usize, k: &'a [T], v: &'a [T], kv: usize) -> Self {
        let kh = &k[kv * d.s * d.dk..(kv + 1) * d.s * d.dk];
        let vh = &v[kv * d.s * d.dv..(kv + 1) * d.s * d.dv];
        KvHead { d, scale, q_offset, kh, vh }
    }
}

/// One forward task: rows `t0 .. t0 + lse.len()` of one (batch, query head).
/// `qh` is that head's `[T, dk]`, `kv` its kv head's keys and values;
/// writes `out` (`[rows, dv]`) and `lse` (`[rows]`).
#[inline(always)]
fn fwd_task<T: Float>(kv: &KvHead<T>, t0: usize, qh: &[T], out: &mut [T], lse: &mut [T], sc: &mut Scratch<T>) {
    if lse.len() >= DOT_ROWS {
        fwd_task_tiled(kv, t0, qh, out, lse, sc)
    } else {
        fwd_task_rows(kv, t0, qh, out, lse, sc)
    }
}

/// Online-softmax update of one score row `s` (`n` valid entries of `nb`, the rest masked):
/// turns `s[..nb]` into unnormalised probabilities against the new running max, updates `m`
/// and `l`, and returns the factor the row's output accumulator must be rescaled by.
#[inline(always)]
fn online_softmax_row<T: Float>(s: &mut [T], n: usize, m: &mut T, l: &mut T) -> T {
    let mx = max_slice(&s[..n], *m);
    let psum = exp_shifted_sum(&mut s[..n], mx);
    s[n..].fill(T::ZERO);
    let alpha = (*m - mx).exp(); // 0 on the first block (m = -inf), 1 when the max is unchanged
    *l = *l * alpha + psum;
    *m = mx;
    alpha
}

/// Tiled forward (rows >= DOT_ROWS): [`online_tiles`] over the task's rows, then `O /= l` and
/// `lse = m + ln l`.
#[inline(always)]
fn fwd_task_tiled<T: Float>(kv: &KvHead<T>, t0: usize, qh: &[T], out: &mut [T], lse: &mut [T], sc: &mut Scratch<T>) {
    let (dk, dv) = (kv.d.dk, kv.d.dv);
    let rows = lse.len();
    let qb = &qh[t0 * dk..(t0 + rows) * dk];
    online_tiles(kv, t0, rows, 1, qb, out, &mut sc.online, &mut sc.st, &mut sc.qt);
    let (m, l) = (&sc.online.m, &sc.online.l);
    for i in 0..rows {
        let inv = T::ONE / l[i];
        for x in out[i * dv..(i + 1) * dv].iter_mut() {
            *x *= inv;
        }
        lse[i] = m[i] + l[i].ln();
    }
}

/// The key loop of the tiled forwards: query rows `t0 .. t0 + rows`, each stacked `rep` times in
/// a row (`q` `[rows·rep, dk]`, stacked row `i·rep + h` at query row `t0 + i`), against every key
/// block they see. Per block, `Sᵀ = scale K Qᵀ` and `O += P V` are tile products over the
/// rectangles of [`causal_chunks`] (a rectangle of rows is one of the stack), with the online
/// softmax in between; leaves the unnormalised output `o` `[rows·rep, dv]` and each stacked row's
/// running max and sum in `state`. `st` holds a `[keys, rows·rep]` tile.
///
/// The scores are kept transposed, one key per tile row and one query row per column, so that
/// the softmax's max and sum over keys run down the columns: each vector lane serves its own
/// query row and no row is ever reduced across lanes (row by row, every 128-key row ended in a
/// horizontal max and a 16-lane sum; this layout measured the forward ~20% faster at bench-s
/// shapes, docs/design.md §7.18). `P V` reads the probabilities as a column-major `P`.
#[inline(always)]
fn online_tiles<T: Float>(
    kv: &KvHead<T>,
    t0: usize,
    rows: usize,
    rep: usize,
    q: &[T],
    o: &mut [T],
    state: &mut OnlineSoftmax<T>,
    st: &mut [T],
    qt: &mut [T],
) {
    let KvHead { d, scale, q_offset, kh, vh } = *kv;
    let (dk, dv) = (d.dk, d.dv);
    let n = rows * rep;
    transpose_into(q, n, dk, qt, n);
    state.m[..n].fill(T::NEG_INF);
    state.l[..n].fill(T::ZERO);
    let kend = (t0 + rows + q_offset).min(d.s);
    if kend == 0 {
        o.fill(T::ZERO); // no keys (S = 0): no block writes o
    }
    let mut s0 = 0;
    while s0 < kend {
        let s1 = (s0 + BC).min(kend);
        for (r0, rc, nc) in causal_chunks(t0, rows, s0, s1 - s0, q_offset) {
            let (g0, gc) = (r0 * rep, rc * rep);
            let og = &mut o[g0 * dv..(g0 + gc) * dv];
            let (m, l) = (&mut state.m[g0..g0 + gc], &mut state.l[g0..g0 + gc]);
            let (m_new, p_sum, alpha) = (&mut state.m_new[..gc], &mut state.p_sum[..gc], &mut state.alpha[..gc]);
            let st = &mut st[..nc * gc];
            // Sᵀ[j, g] = scale * k_{s0 + j} . q_g
            mm_tile(d.products, nc, gc, dk, st, gc, false, &kh[s0 * dk..(s0 + nc) * dk], dk, 1, &qt[g0..], n, scale);
            // A diagonal chunk masks the keys past each row's own position: row r sees c + r
            // keys (c < 0: the chunk's first rows see none of this block), so key j is masked
            // for the rows r <= j − c, a prefix of its tile row.
            let c = (t0 + r0 + q_offset + 1) as isize - s0 as isize;
            for (j, sj) in st.chunks_exact_mut(gc).enumerate() {
                let masked = (j as isize + 1 - c).clamp(0, rc as isize) as usize;
                sj[..masked * rep].fill(T::NEG_INF);
            }
            // The new running max, then P = exp(S − max) with each row's sum (masked keys give 0).
            m_new.copy_from_slice(m);
            max_down_columns(st, m_new);
            exp_down_columns(st, m_new, p_sum);
            // alpha is 0 on the first block (m = -inf) and 1 where the max is unchanged
            for g in 0..gc {
                alpha[g] = (m[g] - m_new[g]).exp();
                l[g] = l[g] * alpha[g] + p_sum[g];
                m[g] = m_new[g];
            }
            // Every row sees key 0, so the first block writes every output row: O = P V there
            // (o is not filled first), O = alpha O + P V after.
            let first = s0 == 0;
            if !first {
                for (og, &a) in og.chunks_exact_mut(dv).zip(alpha.iter()) {
                    if a != T::ONE {
                        for x in og.iter_mut() {
                            *x *= a;
                        }
                    }
                }
            }
            // P read column-major from Sᵀ
            mm_tile(d.products, gc, dv, nc, og, dv, !first, st, 1, gc, &vh[s0 * dv..(s0 + nc) * dv], dv, T::ONE);
        }
        s0 = s1;
    }
}

/// Row-at-a-time forward for a handful of rows (decode, T = 1): dot products and axpys, no tiles.
#[inline(always)]
fn fwd_task_rows<T: Float>(kv: &KvHead<T>, t0: usize, qh: &[T], out: &mut [T], lse: &mut [T], sc: &mut Scratch<T>) {
    let KvHead { d, scale, q_offset, kh, vh } = *kv;
    let (dk, dv) = (d.dk, d.dv);
    for (i, (o, lse)) in out.chunks_exact_mut(dv).zip(lse.iter_mut()).enumerate() {
        let t = t0 + i;
        let kend = (t + q_offset + 1).min(d.s);
        let qs = &mut sc.qs[..dk];
        for (x, &y) in qs.iter_mut().zip(&qh[t * dk..(t + 1) * dk]) {
            *x = y * scale;
        }
        o.fill(T::ZERO);
        let (mut m, mut l) = (T::NEG_INF, T::ZERO);
        let mut s0 = 0;
        while s0 < kend {
            let s1 = (s0 + BC).min(kend);
            let n = s1 - s0;
            for (j, x) in sc.s[..n].iter_mut().enumerate() {
                *x = dot(qs, &kh[(s0 + j) * dk..(s0 + j + 1) * dk]);
            }
            let alpha = online_softmax_row(&mut sc.s[..n], n, &mut m, &mut l);
            if alpha != T::ONE {
                for x in o.iter_mut() {
                    *x *= alpha;
                }
            }
            for (j, &p) in sc.s[..n].iter().enumerate() {
                axpy(o, p, &vh[(s0 + j) * dv..(s0 + j + 1) * dv]);
            }
            s0 = s1;
        }
        let inv = T::ONE / l;
        for x in o.iter_mut() {
            *x *= inv;
        }
        *lse = m + l.ln();
    }
}

/// Whether the forward stacks the query heads that read one kv head (GQA) into one task, so that
/// each key and value tile is multiplied against all of them in one product: more than one
/// query head per kv head, and enough rows for tiles.
fn grouped(d: &Dims) -> bool {
    d.rep() > 1 && d.t >= DOT_ROWS
}

/// Query rows per head of a grouped forward task: the group's `rep` heads stacked make about
/// `BR` rows, the tile height of the ungrouped path.
fn group_rows(d: &Dims) -> usize {
    (BR / d.rep()).max(DOT_ROWS).min(d.t.max(1))
}

/// One grouped forward task: rows `t0 .. t0 + rows` of every query head of one (batch, kv head)
/// (`qg`: the group's `rep` heads, each `[T, dk]`), written to `parts[h]` (head `h`'s output
/// rows and log-sum-exps). The heads' rows are stacked interleaved, stacked row `i·rep + h`
/// being row `t0 + i` of head `h`, for [`online_tiles`]: the same arithmetic per row as
/// [`fwd_task_tiled`].
#[inline(always)]
fn fwd_group_task<T: Float>(
    kv: &KvHead<T>,
    t0: usize,
    qg: &[T],
    parts: &mut [(&mut [T], &mut [T])],
    sc: &mut Scratch<T>,
) {
    let d = kv.d;
    let (dk, dv, rep) = (d.dk, d.dv, d.rep());
    let rows = parts[0].1.len();
    let n = rows * rep;
    for i in 0..rows {
        for h in 0..rep {
            let src = (h * d.t + t0 + i) * dk;
            sc.qs[(i * rep + h) * dk..(i * rep + h + 1) * dk].copy_from_slice(&qg[src..src + dk]);
        }
    }
    let o = &mut sc.o[..n * dv];
    online_tiles(kv, t0, rows, rep, &sc.qs[..n * dk], o, &mut sc.online, &mut sc.st, &mut sc.qt);
    let (m, l) = (&sc.online.m, &sc.online.l);
    for (h, (out, lse)) in parts.iter_mut().enumerate() {
        for i in 0..rows {
            let g = i * rep + h;
            let inv = T::ONE / l[g];
            for (y, &x) in out[i * dv..(i + 1) * dv].iter_mut().zip(&o[g * dv..(g + 1) * dv]) {
                *y = x * inv;
            }
            lse[i] = m[g] + l[g].ln();
        }
    }
}

/// Forward over all heads into new buffers: `out` `[B, Hq, T, dv]` and `lse` `[B, Hq, T]`, with
/// no fill before the tasks: each task zero-fills its own rows (in its cache) just before its
/// kernel writes them.
pub(crate) fn flash_fwd_new<T: Float>(
    d: &Dims,
    scale: f64,
    q_offset: usize,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<T>) {
    let (n_out, n_lse) = (d.b * d.hq * d.t * d.dv, d.b * d.hq * d.t);
    if no_forward_tasks(d) {
        // Nothing would initialise the buffers.
        return (vec![T::ZERO; n_out], vec![T::ZERO; n_lse]);
    }
    let (mut out, mut lse) = (Vec::with_capacity(n_out), Vec::with_capacity(n_lse));
    flash_fwd_at(
        BEST_ISA,
        grouped(d),
        d,
        scale,
        q_offset,
        q,
        k,
        v,
        &mut out.spare_capacity_mut()[..n_out],
        &mut lse.spare_capacity_mut()[..n_lse],
    );
    // SAFETY: with t, dv and b·hq positive, flash_fwd_at's tasks cover every row of every head
    // of both buffers (out is [B·Hq, T, dv], lse [B·Hq, T], cut alike) and zero-fill each
    // before writing it.
    unsafe {
        out.set_len(n_out);
        lse.set_len(n_lse);
    }
    (out, lse)
}

/// Whether the forward has no rows to compute (no tasks run, nothing is written).
fn no_forward_tasks(d: &Dims) -> bool {
    d.t == 0 || d.dv == 0 || d.b * d.hq == 0
}

/// The forward into `out` and `lse` (every value written unless [`no_forward_tasks`]), with the
/// instruction-set level capped at `isa` (see `BEST_ISA`); `group`: the grouped tasks (tests run
/// the per-head ones on GQA shapes too).
fn flash_fwd_at<T: Float>(
    isa: u8,
    group: bool,
    d: &Dims,
    scale: f64,
    q_offset: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [MaybeUninit<T>],
    lse: &mut [MaybeUninit<T>],
) {
    if no_forward_tasks(d) {
        return;
    }
    assert!(out.len() == d.b * d.hq * d.t * d.dv && lse.len() == d.b * d.hq * d.t, "flash_fwd: output sizes");
    let scale = T::from_f64(scale);
    if group {
        // Tasks (batch, kv head, block of group_rows rows), each running every query head of
        // its kv head (`fwd_group_task`).
        let (rep, rows_per) = (d.rep(), group_rows(d));
        let blocks = d.t.div_ceil(rows_per);
        // Each head's output and lse cut into row blocks; heads b·Hq + g·rep .. + rep form group
        // b·Hk + g, so consecutive runs of `rep` heads are the groups.
        let mut heads: Vec<_> = out
            .chunks_mut(d.t * d.dv)
            .zip(lse.chunks_mut(d.t))
            .map(|(o, l)| o.chunks_mut(rows_per * d.dv).zip(l.chunks_mut(rows_per)))
            .collect();
        let mut tasks = Vec::with_capacity(d.b * d.hk * blocks);
        for (bg, group_heads) in heads.chunks_mut(rep).enumerate() {
            for blk in 0..blocks {
                let parts: Vec<_> = group_heads.iter_mut().map(|h| h.next().expect("one block per task")).collect();
                tasks.push((bg, blk * rows_per, parts));
            }
        }
        tasks.reverse(); // heaviest (latest) query blocks first
        let (_, kernel) = simd::pick_fwd::<T>(isa);
        tasks.into_par_iter().for_each_init(
            || Scratch::new(d),
            |sc, (bg, t0, parts)| {
                let qg = &q[bg * rep * d.t * d.dk..(bg + 1) * rep * d.t * d.dk];
                // Each task's rows are zero-filled here, in its own cache, not in a pass before.
                let mut parts: Vec<_> = parts.into_iter().map(|(o, l)| (zeroed(o), zeroed(l))).collect();
                kernel(&KvHead::of(d, scale, q_offset, k, v, bg), t0, qg, &mut parts, sc);
            },
        );
        return;
    }
    let rows_per = if d.t <= BR { d.t } else { BR };
    let mut tasks = Vec::with_capacity(d.b * d.hq * d.t.div_ceil(rows_per));
    for (bh, (oc, lc)) in out.chunks_mut(d.t * d.dv).zip(lse.chunks_mut(d.t)).enumerate() {
        for (blk, (o, l)) in oc.chunks_mut(rows_per * d.dv).zip(lc.chunks_mut(rows_per)).enumerate() {
            tasks.push((bh, blk * rows_per, o, l));
        }
    }
    tasks.reverse(); // heaviest (latest) query blocks first
    let (kernel, _) = simd::pick_fwd::<T>(isa);
    tasks.into_par_iter().for_each_init(
        || Scratch::new(d),
        |sc, (bh, t0, o, l)| {
            let (b, h) = (bh / d.hq, bh % d.hq);
            let kv = b * d.hk + h / d.rep();
            let qh = &q[bh * d.t * d.dk..(bh + 1) * d.t * d.dk];
            kernel(&KvHead::of(d, scale, q_offset, k, v, kv), t0, qh, zeroed(o), zeroed(l), sc);
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

/// Recomputes the probability tile of query rows `t0 .. t0 + rows` of head `bh` against keys
/// `s0 .. s0 + nb`: `st[i, j] = exp(scale q_i . k_j - lse_i)` for causally visible `j`, else 0;
/// then `dpt[i, j] = scale * p_ij * (dout_i . v_j - delta_i)` (= dS, the score gradient).
#[inline(always)]
fn bwd_tile<T: Float>(
    x: &BwdIn<T>,
    bh: usize,
    t0: usize,
    rows: usize,
    kv: usize,
    s0: usize,
    nb: usize,
    sc: &mut Scratch<T>,
) {
    let d = &x.d;
    let (dk, dv) = (d.dk, d.dv);
    let r0 = bh * d.t + t0;
    let qb = &x.q[r0 * dk..(r0 + rows) * dk];
    let gb = &x.dout[r0 * dv..(r0 + rows) * dv];
    // The key block transposed once for all the query heads and rows that see it: every key
    // of the block from s0 (a rectangle's nb keys are a prefix of them).
    if sc.kv_block != Some((kv, s0)) {
        let n = (d.s - s0).min(BC);
        transpose_into(&x.k[(kv * d.s + s0) * dk..(kv * d.s + s0 + n) * dk], n, dk, &mut sc.kt, BC);
        transpose_into(&x.v[(kv * d.s + s0) * dv..(kv * d.s + s0 + n) * dv], n, dv, &mut sc.vt, BC);
        sc.kv_block = Some((kv, s0));
    }
    let (st, dpt) = (&mut sc.st, &mut sc.dpt);
    mm_tile(x.d.products, rows, nb, dk, st, BC, false, qb, dk, 1, &sc.kt, BC, x.scale);
    mm_tile(x.d.products, rows, nb, dv, dpt, BC, false, gb, dv, 1, &sc.vt, BC, T::ONE);
    for i in 0..rows {
        let n = keys_seen(t0 + i, x.q_offset, s0, nb);
        let (lse, delta) = (x.lse[r0 + i], x.delta[r0 + i]);
        let p = &mut st[i * BC..i * BC + nb];
        exp_shifted_prefix(p, n, lse);
        let ds = &mut dpt[i * BC..i * BC + nb];
        for (g, &pj) in ds.iter_mut().zip(p.iter()) {
            *g = pj * (*g - delta) * x.scale;
        }
    }
}

/// One tile of query rows `t0 .. t0 + rows` of head `bh` against keys `s0 .. s0 + nb` of kv head
/// `kv`: recomputes `P` and `dS` into the scratch tiles (`bwd_tile`) and accumulates the key
/// block's `dV += P^T dO` into `dvb` and `dK += dS^T Q` into `dkb`.
#[inline(always)]
fn tile_dk_dv<T: Float>(
    x: &BwdIn<T>,
    bh: usize,
    t0: usize,
    rows: usize,
    kv: usize,
    s0: usize,
    nb: usize,
    dkb: &mut [T],
    dvb: &mut [T],
    sc: &mut Scratch<T>,
) {
    let (dk, dv) = (x.d.dk, x.d.dv);
    bwd_tile(x, bh, t0, rows, kv, s0, nb, sc);
    let r0 = bh * x.d.t + t0;
    // dV[j, :] += sum_i P[i, j] dO[i, :]   (A = P^T: element (j, i) at st[i * BC + j])
    mm_tile(x.d.products, nb, dv, rows, dvb, dv, true, &sc.st, 1, BC, &x.dout[r0 * dv..(r0 + rows) * dv], dv, T::ONE);
    // dK[j, :] += sum_i dS[i, j] Q[i, :]
    mm_tile(x.d.products, nb, dk, rows, dkb, dk, true, &sc.dpt, 1, BC, &x.q[r0 * dk..(r0 + rows) * dk], dk, T::ONE);
}

/// Pass 1 task: key rows `s0 .. s0 + nb` of kv head `(b, g)`; accumulates `dkb` `[nb, dk]` and
/// `dvb` `[nb, dv]` over every query head of the group and every query row that sees the block:
/// `dV += P^T dO`, `dK += dS^T Q`.
#[inline(always)]
fn bwd_kv_task<T: Float>(
    x: &BwdIn<T>,
    b: usize,
    g: usize,
    s0: usize,
    nb: usize,
    dkb: &mut [T],
    dvb: &mut [T],
    sc: &mut Scratch<T>,
) {
    let d = &x.d;
    dkb.fill(T::ZERO);
    dvb.fill(T::ZERO);
    let kv = b * d.hk + g;
    for h in g * d.rep()..(g + 1) * d.rep() {
        let bh = b * d.hq + h;
        for (t0, rows, nc) in key_block_rects(s0, nb, d.t, x.q_offset) {
            let (dkc, dvc) = (&mut dkb[..nc * d.dk], &mut dvb[..nc * d.dv]);
            tile_dk_dv(x, bh, t0, rows, kv, s0, nc, dkc, dvc, sc);
        }
    }
}

/// Pass 2 task: `dq` rows `t0 .. t0 + rows` of head `bh`; `dqb` is `[rows, dk]`: `dQ += dS K`.
#[inline(always)]
fn bwd_q_task<T: Float>(x: &BwdIn<T>, bh: usize, t0: usize, dqb: &mut [T], sc: &mut Scratch<T>) {
    let d = &x.d;
    let dk = d.dk;
    let rows = dqb.len() / dk;
    dqb.fill(T::ZERO);
    let kv = (bh / d.hq) * d.hk + (bh % d.hq) / d.rep();
    let kend = (t0 + rows + x.q_offset).min(d.s);
    let mut s0 = 0;
    while s0 < kend {
        let nb = (kend - s0).min(BC);
        for (r0, rc, nc) in causal_chunks(t0, rows, s0, nb, x.q_offset) {
            bwd_tile(x, bh, t0 + r0, rc, kv, s0, nc, sc);
            let kb = &x.k[(kv * d.s + s0) * dk..(kv * d.s + s0 + nc) * dk];
            mm_tile(
                x.d.products,
                rc,
                dk,
                nc,
                &mut dqb[r0 * dk..(r0 + rc) * dk],
                dk,
                true,
                &sc.dpt,
                BC,
                1,
                kb,
                dk,
                T::ONE,
            );
        }
        s0 += nb;
    }
}

/// One-pass task: kv head `(b, g)` with every query head of its group. Each probability tile is
/// recomputed once and feeds `dV += P^T dO`, `dK += dS^T Q` and `dQ += dS K` (the two passes
/// recompute it twice and take `dO V^T` twice: 5 tile products per tile instead of 7). `dqg` is
/// the group's `[rep, T, dk]`, `dkh` / `dvh` the kv head's `[S, dk]` / `[S, dv]`. Every output
/// element sums its terms in the two passes' order (dK, dV: query heads, then query blocks; dQ:
/// key blocks ascending), so only the tiles' row grouping differs.
#[inline(always)]
fn bwd_group_task<T: Float>(
    x: &BwdIn<T>,
    b: usize,
    g: usize,
    dqg: &mut [T],
    dkh: &mut [T],
    dvh: &mut [T],
    sc: &mut Scratch<T>,
) {
    let d = &x.d;
    let (dk, dv) = (d.dk, d.dv);
    dqg.fill(T::ZERO);
    dkh.fill(T::ZERO);
    dvh.fill(T::ZERO);
    let kv = b * d.hk + g;
    let mut s0 = 0;
    while s0 < d.s {
        let nb = (d.s - s0).min(BC);
        let (dkb, dvb) = (&mut dkh[s0 * dk..(s0 + nb) * dk], &mut dvh[s0 * dv..(s0 + nb) * dv]);
        let kb = &x.k[(kv * d.s + s0) * dk..(kv * d.s + s0 + nb) * dk];
        for (i, h) in (g * d.rep()..(g + 1) * d.rep()).enumerate() {
            let bh = b * d.hq + h;
            for (t0, rows, nc) in key_block_rects(s0, nb, d.t, x.q_offset) {
                tile_dk_dv(x, bh, t0, rows, kv, s0, nc, &mut dkb[..nc * dk], &mut dvb[..nc * dv], sc);
                let dqb = &mut dqg[(i * d.t + t0) * dk..(i * d.t + t0 + rows) * dk];
                mm_tile(x.d.products, rows, dk, nc, dqb, dk, true, &sc.dpt, BC, 1, &kb[..nc * dk], dk, T::ONE);
            }
        }
        s0 += nb;
    }
}

/// Whether the backward runs as one pass over (batch, kv head) tasks: when there are enough of
/// them to keep every thread busy (they cost the same, so a few per thread balance). With fewer
/// (long sequences, few heads) the two passes split the work by blocks instead.
fn one_pass(d: &Dims) -> bool {
    d.dk > 0 && d.b * d.hk >= ONE_PASS_TASKS_PER_THREAD * rayon::current_num_threads()
}

/// See [`one_pass`].
pub(crate) const ONE_PASS_TASKS_PER_THREAD: usize = 4;

/// Backward over all heads. Writes `dq` `[B,Hq,T,dk]`, `dk` `[B,Hk,S,dk]`, `dv` `[B,Hk,S,dv]`.
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
    flash_bwd_at(BEST_ISA, one_pass(d), d, scale, q_offset, q, k, v, out, dout, lse, dq, dk, dv)
}

/// `flash_bwd` with the instruction-set level capped at `isa` (see `BEST_ISA`), in one pass
/// over (batch, kv head) tasks or in two passes over blocks (see [`one_pass`]).
fn flash_bwd_at<T: Float>(
    isa: u8,
    one_pass: bool,
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
    let mut delta = zeros::<T>(d.b * d.hq * d.t);
    delta
        .par_iter_mut()
        .zip(out.par_chunks(d.dv).zip(dout.par_chunks(d.dv)))
        .with_min_len(256)
        .for_each(|(o, (a, b))| *o = dot(a, b));
    let x = BwdIn { d: *d, scale: T::from_f64(scale), q_offset, q, k, v, dout, lse, delta: &delta };
    let (kv_kernel, q_kernel, group_kernel) = simd::pick_bwd::<T>(isa);
    if one_pass && d.dk > 0 {
        let tasks: Vec<_> = dq
            .chunks_mut(d.rep() * d.t * d.dk)
            .zip(dk.chunks_mut(d.s * d.dk).zip(dv.chunks_mut(d.s * d.dv)))
            .enumerate()
            .collect();
        tasks.into_par_iter().for_each_init(
            || Scratch::new(d),
            |sc, (bg, (dqg, (dkh, dvh)))| group_kernel(&x, bg / d.hk, bg % d.hk, dqg, dkh, dvh, sc),
        );
        return;
    }
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
            let nb = dvb.len() / d.dv;
            tasks.push((bg / d.hk, bg % d.hk, blk * BC, nb, dkb, dvb));
        }
    }
    tasks
        .into_par_iter()
        .for_each_init(|| Scratch::new(d), |sc, (b, g, s0, nb, dkb, dvb)| kv_kernel(&x, b, g, s0, nb, dkb, dvb, sc));
}

// ---------------------------------------------------------------------------------------------
// Runtime dispatch: the same generic bodies compiled for AVX2+FMA / AVX-512 when available.

mod simd {
    use super::*;

    pub(super) type FwdFn<T> = fn(&KvHead<T>, usize, &[T], &mut [T], &mut [T], &mut Scratch<T>);
    pub(super) type GroupFwdFn<T> = fn(&KvHead<T>, usize, &[T], &mut [(&mut [T], &mut [T])], &mut Scratch<T>);
    pub(super) type KvFn<T> = fn(&BwdIn<T>, usize, usize, usize, usize, &mut [T], &mut [T], &mut Scratch<T>);
    pub(super) type QFn<T> = fn(&BwdIn<T>, usize, usize, &mut [T], &mut Scratch<T>);
    pub(super) type GroupFn<T> = fn(&BwdIn<T>, usize, usize, &mut [T], &mut [T], &mut [T], &mut Scratch<T>);

    macro_rules! variants {
        ($feat:literal, $fwd:ident, $fwd_group:ident, $kv:ident, $q:ident, $group:ident) => {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $fwd<T: Float>(
                kv: &KvHead<T>,
                t0: usize,
                qh: &[T],
                out: &mut [T],
                lse: &mut [T],
                sc: &mut Scratch<T>,
            ) {
                fwd_task(kv, t0, qh, out, lse, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $fwd_group<T: Float>(
                kv: &KvHead<T>,
                t0: usize,
                qg: &[T],
                parts: &mut [(&mut [T], &mut [T])],
                sc: &mut Scratch<T>,
            ) {
                fwd_group_task(kv, t0, qg, parts, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $kv<T: Float>(
                x: &BwdIn<T>,
                b: usize,
                g: usize,
                s0: usize,
                nb: usize,
                dkb: &mut [T],
                dvb: &mut [T],
                sc: &mut Scratch<T>,
            ) {
                bwd_kv_task(x, b, g, s0, nb, dkb, dvb, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $q<T: Float>(x: &BwdIn<T>, bh: usize, t0: usize, dqb: &mut [T], sc: &mut Scratch<T>) {
                bwd_q_task(x, bh, t0, dqb, sc)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $group<T: Float>(
                x: &BwdIn<T>,
                b: usize,
                g: usize,
                dqg: &mut [T],
                dkh: &mut [T],
                dvh: &mut [T],
                sc: &mut Scratch<T>,
            ) {
                bwd_group_task(x, b, g, dqg, dkh, dvh, sc)
            }
        };
    }
    variants!("avx2,fma", fwd_avx2, fwd_group_avx2, kv_avx2, q_avx2, group_avx2);
    variants!("avx512f,avx2,fma", fwd_avx512, fwd_group_avx512, kv_avx512, q_avx512, group_avx512);

    /// The forward tasks (per head, grouped) for the best instruction set this CPU has.
    pub(super) fn pick_fwd<T: Float>(max: u8) -> (FwdFn<T>, GroupFwdFn<T>) {
        let level = crate::cpu::isa_level(max);
        #[cfg(target_arch = "x86_64")]
        if level == 2 {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            return (
                |kv, t0, qh, o, l, sc| unsafe { fwd_avx512(kv, t0, qh, o, l, sc) },
                |kv, t0, qg, p, sc| unsafe { fwd_group_avx512(kv, t0, qg, p, sc) },
            );
        }
        #[cfg(target_arch = "x86_64")]
        if level == 1 {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            return (
                |kv, t0, qh, o, l, sc| unsafe { fwd_avx2(kv, t0, qh, o, l, sc) },
                |kv, t0, qg, p, sc| unsafe { fwd_group_avx2(kv, t0, qg, p, sc) },
            );
        }
        (|kv, t0, qh, o, l, sc| fwd_task(kv, t0, qh, o, l, sc), |kv, t0, qg, p, sc| fwd_group_task(kv, t0, qg, p, sc))
    }

    pub(super) fn pick_bwd<T: Float>(max: u8) -> (KvFn<T>, QFn<T>, GroupFn<T>) {
        let level = crate::cpu::isa_level(max);
        #[cfg(target_arch = "x86_64")]
        if level == 2 {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            return (
                |x, b, g, s0, nb, dkb, dvb, sc| unsafe { kv_avx512(x, b, g, s0, nb, dkb, dvb, sc) },
                |x, bh, t0, dqb, sc| unsafe { q_avx512(x, bh, t0, dqb, sc) },
                |x, b, g, dqg, dkh, dvh, sc| unsafe { group_avx512(x, b, g, dqg, dkh, dvh, sc) },
            );
        }
        #[cfg(target_arch = "x86_64")]
        if level == 1 {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            return (
                |x, b, g, s0, nb, dkb, dvb, sc| unsafe { kv_avx2(x, b, g, s0, nb, dkb, dvb, sc) },
                |x, bh, t0, dqb, sc| unsafe { q_avx2(x, bh, t0, dqb, sc) },
                |x, b, g, dqg, dkh, dvh, sc| unsafe { group_avx2(x, b, g, dqg, dkh, dvh, sc) },
            );
        }
        (
            |x, b, g, s0, nb, dkb, dvb, sc| bwd_kv_task(x, b, g, s0, nb, dkb, dvb, sc),
            |x, bh, t0, dqb, sc| bwd_q_task(x, bh, t0, dqb, sc),
            |x, b, g, dqg, dkh, dvh, sc| bwd_group_task(x, b, g, dqg, dkh, dvh, sc),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// candle glue.

struct FlashAttn {
    scale: f64,
    q_offset: usize,
    products: TileProducts,
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
    let d = Dims { products: op.products, ..dims_of(l1.dims(), l2.dims(), l3.dims())? };
    let (q, k, v) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?, storage_slice::<T>(s3, l3)?);
    let (out, lse) = flash_fwd_new(&d, op.scale, op.q_offset, q, k, v);
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
    let d = Dims { products: op.products, ..dims_of(q.dims(), k.dims(), v.dims())? };
    let mut dq = zeros::<T>(q.elem_count());
    let mut dk = zeros::<T>(k.elem_count());
    let mut dv = zeros::<T>(v.elem_count());
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
                                recomputed = flash_fwd_new(&d, op.scale, op.q_offset, qs, ks, vs).1;
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
        crate::profile::timed_attention(crate::profile::Pass::Forward, || match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::F64 => fwd_typed::<f64>(self, s1, l1, s2, l2, s3, l3),
            dt => bail!("difftx-flash-attention: unsupported dtype {dt:?}"),
        })
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
        let (dq, dk, dv) = crate::profile::timed_attention(crate::profile::Pass::Backward, || match q.dtype() {
            DType::F32 => bwd_typed::<f32>(self, q, k, v, res, &grad),
            DType::F64 => bwd_typed::<f64>(self, q, k, v, res, &grad),
            dt => bail!("difftx-flash-attention: unsupported dtype {dt:?}"),
        })?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::as_uninit;
    use candle_core::Device;

    /// `bwd` without a saved log-sum-exp (recompute fallback) gives the same gradients.
    #[test]
    fn bwd_recomputes_missing_lse() -> Result<()> {
        let dev = Device::Cpu;
        let vals = |n: usize, s: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.7 + s).sin()).collect() };
        let q = Tensor::from_vec(vals(2 * 4 * 9 * 5, 0.1), (2, 4, 9, 5), &dev)?;
        let k = Tensor::from_vec(vals(2 * 2 * 9 * 5, 0.2), (2, 2, 9, 5), &dev)?;
        let v = Tensor::from_vec(vals(2 * 2 * 9 * 3, 0.3), (2, 2, 9, 3), &dev)?;
        let g = Tensor::from_vec(vals(2 * 4 * 9 * 3, 0.4), (2, 4, 9, 3), &dev)?;
        let op = FlashAttn { scale: 0.4, q_offset: 0, products: TileProducts::Native, lse: Mutex::new(None) };
        let out = q.apply_op3_no_bwd(&k, &v, &op)?;
        assert!(op.lse.lock().unwrap().is_some());
        let (a, b, c) = op.bwd(&q, &k, &v, &out, &g)?;
        let op2 = FlashAttn { scale: 0.4, q_offset: 0, products: TileProducts::Native, lse: Mutex::new(None) };
        let (a2, b2, c2) = op2.bwd(&q, &k, &v, &out, &g)?;
        for (x, y) in [(a, a2), (b, b2), (c, c2)] {
            let d = (x.unwrap() - y.unwrap())?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(d < 1e-14, "diff {d}");
        }
        Ok(())
    }

    /// A tile's rectangles cover every visible score once and are as narrow as their last row
    /// allows, on and off the diagonal, with and without a cache offset.
    #[test]
    fn causal_chunks_cover_exactly_the_visible_scores() {
        for (t0, s0, q_offset) in [(0, 0, 0), (128, 0, 0), (128, 128, 0), (0, 128, 140), (5, 100, 63), (3, 0, 200)] {
            for rows in [1, 2, 63, 64, 65, 77, 128] {
                for nb in [1, 5, 64, 100, 128] {
                    // written out here, not through `keys_seen`, so that the test checks it too
                    let seen = |i: usize| (t0 + i + q_offset + 1).saturating_sub(s0).min(nb);
                    let mut next_row = 0;
                    for (r0, rc, nc) in causal_chunks(t0, rows, s0, nb, q_offset) {
                        let case = (t0, rows, s0, nb, q_offset, r0, rc, nc);
                        // rows before this chunk that were skipped see no key of the block
                        assert!((next_row..r0).all(|i| seen(i) == 0), "{case:?}");
                        assert!(rc > 0 && rc <= DIAG_ROWS.max(rows) && r0 + rc <= rows, "{case:?}");
                        assert_eq!(nc, seen(r0 + rc - 1), "{case:?}");
                        if nc < nb || seen(r0) < nb {
                            assert!(rc <= DIAG_ROWS, "a diagonal chunk is at most DIAG_ROWS tall: {case:?}");
                        }
                        next_row = r0 + rc;
                    }
                    assert!((next_row..rows).all(|i| seen(i) == 0), "rows left out see keys");
                }
            }
        }
        // the chunks of bench-s' diagonal tile: four quarter-height rectangles
        assert_eq!(
            causal_chunks(128, 128, 128, 128, 0).collect::<Vec<_>>(),
            [(0, 32, 32), (32, 32, 64), (64, 32, 96), (96, 32, 128)]
        );
        assert_eq!(causal_chunks(128, 128, 0, 128, 0).collect::<Vec<_>>(), [(0, 128, 128)]);
    }

    /// The forward into new buffers (each task zero-fills its own rows) gives the bits of the
    /// forward into buffers filled first (here with NaN, so an unwritten value would show), on
    /// grouped, per-head, row-at-a-time and empty shapes.
    #[test]
    fn new_buffers_equal_filled_buffers() {
        let cases = [
            Dims { b: 2, hq: 8, hk: 2, t: 150, s: 150, dk: 16, dv: 24, products: TileProducts::Native },
            Dims { b: 1, hq: 4, hk: 4, t: 130, s: 140, dk: 12, dv: 20, products: TileProducts::Native },
            Dims { b: 2, hq: 2, hk: 1, t: 3, s: 9, dk: 8, dv: 8, products: TileProducts::Native },
            Dims { b: 1, hq: 2, hk: 1, t: 5, s: 5, dk: 4, dv: 0, products: TileProducts::Native },
            Dims { b: 1, hq: 2, hk: 1, t: 0, s: 0, dk: 4, dv: 4, products: TileProducts::Native },
        ];
        for d in cases {
            let off = d.s - d.t;
            let gen = |n: usize, p: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.37 + p).sin()).collect() };
            let (q, k, v) = (
                gen(d.b * d.hq * d.t * d.dk, 0.1),
                gen(d.b * d.hk * d.s * d.dk, 0.2),
                gen(d.b * d.hk * d.s * d.dv, 0.3),
            );
            let (mut out, mut lse) = (vec![f32::NAN; d.b * d.hq * d.t * d.dv], vec![f32::NAN; d.b * d.hq * d.t]);
            // SAFETY: flash_fwd_at writes only initialised values.
            flash_fwd_at(BEST_ISA, grouped(&d), &d, 0.3, off, &q, &k, &v, unsafe { as_uninit(&mut out) }, unsafe {
                as_uninit(&mut lse)
            });
            let (out_new, lse_new) = flash_fwd_new(&d, 0.3, off, &q, &k, &v);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            if d.dv > 0 {
                assert!(out.iter().chain(&lse).all(|x| x.is_finite()), "{d:?}: a value left unwritten");
                assert_eq!((bits(&out_new), bits(&lse_new)), (bits(&out), bits(&lse)), "{d:?}");
            } else {
                assert_eq!((out_new.len(), lse_new, bits(&out)), (0, vec![0.0; lse.len()], vec![]), "{d:?}");
            }
        }
    }

    /// Every instruction-set variant (baseline, AVX2, AVX-512) computes the same thing; the
    /// public path only ever runs the best one the CPU has.
    #[test]
    fn all_isa_variants_agree() {
        let d = Dims { b: 1, hq: 4, hk: 2, t: 150, s: 170, dk: 12, dv: 20, products: TileProducts::Native };
        let off = 20;
        let gen = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.37 + s).sin()).collect() };
        let q = gen(d.b * d.hq * d.t * d.dk, 0.1);
        let k = gen(d.b * d.hk * d.s * d.dk, 0.2);
        let v = gen(d.b * d.hk * d.s * d.dv, 0.3);
        let g = gen(d.b * d.hq * d.t * d.dv, 0.4);
        let run = |isa: u8| {
            let mut out = vec![0f32; g.len()];
            let mut lse = vec![0f32; d.b * d.hq * d.t];
            // SAFETY: flash_fwd_at writes only initialised values.
            flash_fwd_at(isa, grouped(&d), &d, 0.3, off, &q, &k, &v, unsafe { as_uninit(&mut out) }, unsafe {
                as_uninit(&mut lse)
            });
            let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
            let (mut dq1, mut dk1, mut dv1) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
            flash_bwd_at(isa, false, &d, 0.3, off, &q, &k, &v, &out, &g, &lse, &mut dq, &mut dk, &mut dv);
            flash_bwd_at(isa, true, &d, 0.3, off, &q, &k, &v, &out, &g, &lse, &mut dq1, &mut dk1, &mut dv1);
            [out, lse, dq, dk, dv, dq1, dk1, dv1]
        };
        let base = run(0);
        for isa in 0..=BEST_ISA {
            let got = run(isa);
            // the ISA variants against the baseline one; both backward paths against its two passes
            let pairs = got.iter().zip(&base).chain(got[5..].iter().zip(&base[2..5]));
            for (i, (a, b)) in pairs.enumerate() {
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(diff <= 1e-5 * scale, "isa {isa}, output {i}: diff {diff} (scale {scale})");
            }
        }
    }

    /// The grouped forward (a kv head's query heads stacked in one task) equals the per-head
    /// forward in f64, at every instruction-set level: GQA ratios 2 to 64 (a stack taller than
    /// `BR`), rows not a multiple of a group's block, several key blocks, a cache offset, few rows.
    #[test]
    fn grouped_forward_equals_per_head_forward() {
        let cases = [
            // (b, hq, hk, t, s, dk, dv, q_offset)
            (2, 8, 2, 150, 150, 16, 24, 0),
            (1, 6, 2, 77, 140, 5, 7, 63),
            (1, 4, 1, 5, 9, 8, 8, 4),
            (1, 64, 1, 40, 40, 4, 4, 0),
            (3, 2, 1, 300, 300, 8, 8, 0),
        ];
        for (b, hq, hk, t, s, dk, dv, off) in cases {
            let d = Dims { b, hq, hk, t, s, dk, dv, products: TileProducts::Native };
            assert!(grouped(&d), "{d:?}");
            let gen = |n: usize, p: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + p).sin()).collect() };
            let (q, k, v) = (gen(b * hq * t * dk, 0.1), gen(b * hk * s * dk, 0.2), gen(b * hk * s * dv, 0.3));
            for isa in 0..=BEST_ISA {
                let run = |group: bool| {
                    let (mut out, mut lse) = (vec![0f64; b * hq * t * dv], vec![0f64; b * hq * t]);
                    // SAFETY: as above.
                    flash_fwd_at(isa, group, &d, 0.3, off, &q, &k, &v, unsafe { as_uninit(&mut out) }, unsafe {
                        as_uninit(&mut lse)
                    });
                    [out, lse]
                };
                for (name, (a, w)) in ["out", "lse"].iter().zip(run(true).iter().zip(&run(false))) {
                    let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
                    let diff = a.iter().zip(w).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                    assert!(diff <= 1e-14 * scale, "{d:?} offset {off} isa {isa}: {name} diff {diff} (scale {scale})");
                }
            }
        }
    }

    /// The one-pass backward equals the two passes (which tests/flash.rs checks against composed
    /// ops and finite differences) in f64 on awkward shapes, whichever the thread count picks.
    #[test]
    fn one_pass_backward_equals_two_passes() {
        let cases = [
            // (b, hq, hk, t, s, dk, dv, q_offset)
            (2, 6, 2, 77, 77, 16, 32, 0),     // GQA 3, T not a multiple of the tile
            (1, 4, 1, 300, 300, 8, 16, 0),    // MQA, three query and key tiles, the last partial
            (1, 2, 1, 150, 290, 16, 32, 140), // cache offset not aligned to tiles, T > tile
            (3, 2, 2, 37, 100, 5, 7, 63),     // odd head dims, T < S
            (2, 4, 2, 1, 70, 8, 16, 69),      // one row against a cache
            (1, 2, 2, 3, 9, 3, 5, 6),         // few rows
        ];
        for (b, hq, hk, t, s, dk, dv, off) in cases {
            let d = Dims { b, hq, hk, t, s, dk, dv, products: TileProducts::Native };
            let gen = |n: usize, p: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + p).sin()).collect() };
            let q = gen(b * hq * t * dk, 0.1);
            let k = gen(b * hk * s * dk, 0.2);
            let v = gen(b * hk * s * dv, 0.3);
            let g = gen(b * hq * t * dv, 0.4);
            let (out, lse) = flash_fwd_new(&d, 0.3, off, &q, &k, &v);
            let grads = |one: bool| {
                let (mut dq, mut dk, mut dv) = (vec![0f64; q.len()], vec![0f64; k.len()], vec![0f64; v.len()]);
                flash_bwd_at(BEST_ISA, one, &d, 0.3, off, &q, &k, &v, &out, &g, &lse, &mut dq, &mut dk, &mut dv);
                [dq, dk, dv]
            };
            for (name, (a, w)) in ["dq", "dk", "dv"].iter().zip(grads(true).iter().zip(&grads(false))) {
                let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
                let diff = a.iter().zip(w).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                assert!(diff <= 1e-13 * scale, "{:?} offset {off}: {name} diff {diff} (scale {scale})", d);
            }
        }
    }
}
