//! Small matrix products for the attention kernels' tiles, without packing.
//!
//! The attention kernels multiply tiles of at most `BR × BC` scores by heads of `d` values
//! (32 on bench-s). Through `gemm` every such product packs both operands first and, when the
//! output is `d` wide, runs a micro-kernel 32 rows tall (`x2x6`); on the Zen 4 that packing was
//! ~14% of diff-v2's backward task and `x2x6` 41% (docs/design.md §7.20).
//! [`mm_rows`] takes `B` with contiguous rows instead, as every tile product has it or can have
//! it after one transpose of a key block: each step over `k` loads a piece of one row of `B`
//! (two or four vectors) and broadcasts one value of `A` per output row (12 or 6 rows: 24
//! accumulators either way), so neither operand is copied. f32 on AVX-512F only; every other
//! type or CPU goes to `gemm` (single-threaded: the parallelism is over the kernels' tasks).
//! [`mm_rows_bf16`] is the same walk over bf16 pairs (`vdpbf16ps`, two values of `k` per lane)
//! for `--precision bf16` ([`TileProducts::Bf16`]): its operands are converted per call.

use crate::bf16_matmul::{bf16_bits, bf16_pair, bf16_to_f32, to_bf16, to_bf16_pairs};
use crate::float::Float;
use std::any::TypeId;

/// How the attention kernels multiply their tiles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TileProducts {
    /// In the tensors' own dtype.
    #[default]
    Native,
    /// bf16 values with f32 sums (`tile::mm_rows_bf16`) for f32 tensors, as `--precision bf16`
    /// multiplies in the linear layers; f64 tensors stay native.
    Bf16,
}

/// A tile product as `products` says: [`mm_rows`], or [`mm_rows_bf16`] for f32 values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn mm_tile<T: Float>(
    products: TileProducts,
    m: usize,
    n: usize,
    k: usize,
    c: &mut [T],
    ldc: usize,
    acc: bool,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    ldb: usize,
    beta: T,
) {
    if products == TileProducts::Bf16 && TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (checked above): the casts only rename the element type.
        let (c, a, b, beta) = unsafe {
            (
                std::slice::from_raw_parts_mut(c.as_mut_ptr() as *mut f32, c.len()),
                std::slice::from_raw_parts(a.as_ptr() as *const f32, a.len()),
                std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len()),
                *(&beta as *const T as *const f32),
            )
        };
        return mm_rows_bf16(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta);
    }
    mm_rows(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta)
}

/// `C = (acc ? C : 0) + beta · A B`: `C` is `m × n` row-major with row stride `ldc`; `A` is
/// `m × k` with element `(i, p)` at `a[i * a_rs + p * a_cs]`; `B` is `k × n` with row `p` at
/// `b[p * ldb ..][.. n]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn mm_rows<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [T],
    ldc: usize,
    acc: bool,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    ldb: usize,
    beta: T,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(n <= ldc && last(ldc, 1, m, n) < c.len(), "mm_rows: C out of bounds");
    if k == 0 {
        if !acc {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(T::ZERO);
            }
        }
        return;
    }
    assert_operands_inside("mm_rows", (m, n, k), (a.len(), a_rs, a_cs), (b.len(), ldb));
    #[cfg(target_arch = "x86_64")]
    if TypeId::of::<T>() == TypeId::of::<f32>() && avx512::available() {
        // SAFETY: T is f32 (checked above), so the casts only rename the element type; the
        // kernel reads and writes inside the slices (asserted above); the CPU has AVX-512F.
        unsafe {
            let ops = avx512::Operands {
                k,
                c: c.as_mut_ptr() as *mut f32,
                ldc,
                acc,
                a: a.as_ptr() as *const f32,
                a_rs,
                a_cs,
                b: b.as_ptr() as *const f32,
                ldb,
                beta: *(&beta as *const T as *const f32),
            };
            avx512::mm_rows(m, n, ops);
        }
        return;
    }
    // SAFETY: every element gemm reads or writes is inside the slices (asserted above), and `c`
    // does not alias `a` or `b` (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            acc,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            1,
            ldb as isize,
            T::ONE,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Panics unless `A` (`m × k`, strides `a_rs`, `a_cs`, in `a_len` values) and `B` (`k × n`, row
/// stride `ldb`, in `b_len` values) lie inside their slices (m, n, k > 0).
fn assert_operands_inside(
    op: &str,
    (m, n, k): (usize, usize, usize),
    (a_len, a_rs, a_cs): (usize, usize, usize),
    (b_len, ldb): (usize, usize),
) {
    assert!(last(a_rs, a_cs, m, k) < a_len, "{op}: A out of bounds");
    assert!(last(ldb, 1, k, n) < b_len, "{op}: B out of bounds");
}

/// The index of the last element of a `r × c` matrix with strides `rs`, `cs` (r, c > 0).
fn last(rs: usize, cs: usize, r: usize, c: usize) -> usize {
    (r - 1) * rs + (c - 1) * cs
}

thread_local! {
    /// [`mm_rows_bf16_amx`]'s converted operands (`A`, `B`), kept between calls.
    static AMX_OPERANDS: std::cell::RefCell<(Vec<u32>, Vec<u32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// [`mm_rows_bf16_pairs`]'s converted operands (`A`, `B`), kept between calls.
    static PAIRS: std::cell::RefCell<(Vec<u32>, Vec<u32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// [`mm_rows_bf16_rounded`]'s rounded copies of `A` and `B`, kept between calls.
    static ROUNDED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// [`mm_rows`] with bf16 products, f32 only: every value of `A` and `B` is rounded to bf16 (to
/// nearest, ties to even, as [`crate::bf16_matmul`] rounds) and the products are summed in f32:
/// the attention kernels' tiles under `--precision bf16`. Where the bf16 backend is AMX, on AMX
/// tiles ([`mm_rows_bf16_amx`]: Intel's `vdpbf16ps` issues at half the rate of its f32 FMAs'
/// products, so there the pairs below ran the attention kernels 1.4-2× slower than f32 tiles,
/// docs/design.md §7.38); elsewhere with AVX512_BF16 on pairs ([`mm_rows_bf16_pairs`]); without
/// either, rounded copies through [`mm_rows`] (the same products, summed in another order).
#[allow(clippy::too_many_arguments)]
pub(crate) fn mm_rows_bf16(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if amx::available() {
        return mm_rows_bf16_amx(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta);
    }
    mm_rows_bf16_pairs(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta)
}

/// [`mm_rows_bf16`] with AVX512_BF16: both operands are first converted into pairs along `k`
/// (`vdpbf16ps` multiplies two values of `k` per lane, half the instructions of f32 FMAs; a
/// tile's operands are small and in L1, so converting them per call costs a fraction of the
/// product). Without AVX512_BF16, [`mm_rows_bf16_rounded`].
#[allow(clippy::too_many_arguments)]
fn mm_rows_bf16_pairs(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
) {
    if m == 0 || n == 0 || k == 0 {
        return mm_rows(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta);
    }
    assert!(n <= ldc && last(ldc, 1, m, n) < c.len(), "mm_rows_bf16: C out of bounds");
    assert_operands_inside("mm_rows_bf16", (m, n, k), (a.len(), a_rs, a_cs), (b.len(), ldb));
    #[cfg(target_arch = "x86_64")]
    if avx512::bf16_available() {
        let pairs = k.div_ceil(2);
        PAIRS.with(|buf| {
            let (ap, bp) = &mut *buf.borrow_mut();
            // B's pair row p holds rows 2p and 2p + 1 (zero for a missing last row).
            bp.resize(pairs * n, 0);
            for (p, run) in bp.chunks_exact_mut(n).enumerate() {
                let row = |r: usize| &b[r * ldb..r * ldb + n];
                // SAFETY: the CPU has AVX512_BF16 (checked above); the rows hold n values each.
                unsafe { to_bf16_pairs(row(2 * p), (2 * p + 1 < k).then(|| row(2 * p + 1)), run) };
            }
            // A's pair (i, p) at ap[i * a_prs + p * a_pcs].
            ap.resize(m * pairs, 0);
            let (a_prs, a_pcs) = if a_cs == 1 {
                // Rows contiguous: a row's bf16 values, read as u32, are its pairs.
                for (i, run) in ap.chunks_exact_mut(pairs).enumerate() {
                    // SAFETY: u16 has no stricter alignment than u32, and the run holds 2·pairs
                    // u16 (k, and one of padding when k is odd).
                    let halves = unsafe { std::slice::from_raw_parts_mut(run.as_mut_ptr() as *mut u16, 2 * pairs) };
                    halves[2 * pairs - 1] = 0;
                    // SAFETY: as above (AVX512_BF16); the source row holds k values.
                    unsafe { to_bf16(&a[i * a_rs..i * a_rs + k], &mut halves[..k]) };
                }
                (pairs, 1)
            } else if a_rs == 1 {
                // Columns contiguous (a transposed operand): columns 2p and 2p + 1 give the pairs
                // of every row, 16 rows per step.
                for (p, run) in ap.chunks_exact_mut(m).enumerate() {
                    let col = |j: usize| &a[j * a_cs..j * a_cs + m];
                    // SAFETY: as above; the columns hold m values each.
                    unsafe { to_bf16_pairs(col(2 * p), (2 * p + 1 < k).then(|| col(2 * p + 1)), run) };
                }
                (1, m)
            } else {
                for (i, run) in ap.chunks_exact_mut(pairs).enumerate() {
                    for (p, x) in run.iter_mut().enumerate() {
                        let hi = if 2 * p + 1 < k { a[i * a_rs + (2 * p + 1) * a_cs] } else { 0.0 };
                        *x = bf16_pair(a[i * a_rs + 2 * p * a_cs], hi);
                    }
                }
                (pairs, 1)
            };
            let ops = avx512::Operands {
                k: pairs,
                c: c.as_mut_ptr(),
                ldc,
                acc,
                a: ap.as_ptr(),
                a_rs: a_prs,
                a_cs: a_pcs,
                b: bp.as_ptr(),
                ldb: n,
                beta,
            };
            // SAFETY: the kernel reads pairs (i < m, p < pairs) of `ap` and (p, j < n) of `bp`,
            // all written above, and writes C inside `c` (asserted above); the CPU has
            // AVX512_BF16 and AVX-512F.
            unsafe { avx512::mm_rows_bf16(m, n, ops) };
        });
        return;
    }
    mm_rows_bf16_rounded(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta)
}

/// [`mm_rows_bf16`] without AVX512_BF16: copies of `A` and `B` rounded to bf16 (into buffers
/// reused between calls) through the f32 kernel.
#[allow(clippy::too_many_arguments)]
fn mm_rows_bf16_rounded(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
) {
    let round = |x: f32| bf16_to_f32(bf16_bits(x));
    ROUNDED.with(|buf| {
        let (ar, br) = &mut *buf.borrow_mut();
        ar.clear();
        ar.extend((0..m * k).map(|x| round(a[(x / k) * a_rs + (x % k) * a_cs])));
        br.clear();
        br.extend((0..k * n).map(|x| round(b[(x / n) * ldb + x % n])));
        mm_rows(m, n, k, c, ldc, acc, ar, k, 1, br, n, beta)
    })
}

/// [`mm_rows_bf16`] on AMX tiles. Both operands are converted per call into the layouts the
/// tiles load, zero padded to whole blocks of 32 (rows of `A`, columns of `B`, values of `k`):
/// `A` as `[k / 32][rows][32]` bf16 and `B` as panels of 16 columns of pairs along `k`,
/// `[columns / 16][k / 2][16]` u32 (the linear layers' packing of B), so that every 16-row tile
/// is 1 KiB of consecutive memory. Each 32 × 32 block of `C` is the linear layers' tile kernel
/// (`bf16_matmul::amx::block`: four accumulator tiles, `tdpbf16ps` giving 16 × 16 outputs over
/// 32 values of `k` per instruction) into a scratch block, added into `C` as the other
/// paths do (`C = (acc ? C : 0) + beta·sum`, one FMA), only its valid part. Zero padding adds
/// nothing, so the sums are those of the rounded values, in AMX's order.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn mm_rows_bf16_amx(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
) {
    if m == 0 || n == 0 || k == 0 {
        return mm_rows(m, n, k, c, ldc, acc, a, a_rs, a_cs, b, ldb, beta);
    }
    assert!(amx::available(), "mm_rows_bf16_amx: no AMX here");
    assert!(n <= ldc && last(ldc, 1, m, n) < c.len(), "mm_rows_bf16_amx: C out of bounds");
    assert_operands_inside("mm_rows_bf16_amx", (m, n, k), (a.len(), a_rs, a_cs), (b.len(), ldb));
    let (mp, np) = (m.div_ceil(amx::BLOCK) * amx::BLOCK, n.div_ceil(amx::BLOCK) * amx::BLOCK);
    let blocks = k.div_ceil(amx::BLOCK);
    let pairs = blocks * amx::BLOCK / 2;
    AMX_OPERANDS.with(|buf| {
        let (ap, bp) = &mut *buf.borrow_mut();
        // A's pair q of k block `blk` in row i at ap[(blk * mp + i) * 16 + q] (as u32: two bf16);
        // every value is written below (padding included), so growing is the only resize cost.
        ap.resize(blocks * mp * 16, 0);
        if a_cs == 1 {
            // SAFETY: AMX implies AVX512_BF16 (`amx::available`); A's rows hold k values each
            // (asserted above); `ap` holds blocks · mp runs of 16.
            unsafe { amx::pack_a_rows(a, a_rs, m, k, mp, ap) };
        } else if a_rs == 1 {
            // SAFETY: as above, A's columns holding m values each.
            unsafe { amx::pack_a_columns(a, a_cs, m, k, mp, ap) };
        } else {
            for i in 0..mp {
                for q in 0..pairs {
                    let at = |p: usize| if i < m && p < k { a[i * a_rs + p * a_cs] } else { 0.0 };
                    ap[((q / 16) * mp + i) * 16 + q % 16] = bf16_pair(at(2 * q), at(2 * q + 1));
                }
            }
        }
        // B's pair row p, column 16·panel + j at bp[(panel * pairs + p) * 16 + j].
        bp.resize(np / 16 * pairs * 16, 0);
        // SAFETY: as above, B's k rows holding n values each; `bp` holds np / 16 panels.
        unsafe { amx::pack_b_rows(b, ldb, n, k, np, bp) };
        // The linear layers' tile kernel, on A's bf16 values: a 32-row block starts 32 · 32
        // values into a k block, and the k blocks are `mp` rows of 32 apart.
        // SAFETY: u16 has no stricter alignment than u32; `ap` holds 2·len u16.
        let a16 = unsafe { std::slice::from_raw_parts(ap.as_ptr() as *const u16, 2 * ap.len()) };
        let mut sums = amx::Block([0.0; amx::BLOCK * amx::BLOCK]);
        // SAFETY: AMX is available (asserted above).
        unsafe { crate::bf16_matmul::amx::ensure_configured() };
        for ib in 0..mp / amx::BLOCK {
            let rows = (m - ib * amx::BLOCK).min(amx::BLOCK);
            for jb in 0..np / amx::BLOCK {
                let w = (n - jb * amx::BLOCK).min(amx::BLOCK);
                // SAFETY: the packed operands hold every tile the block loads (whole blocks,
                // padded above); the tiles are configured on this thread; `sums` is one block of
                // rows of 32; C's rows i0..i0+rows, columns j0..j0+w are inside `c` (asserted
                // above).
                unsafe {
                    crate::bf16_matmul::amx::block(
                        &a16[ib * amx::BLOCK * amx::BLOCK..],
                        mp * amx::BLOCK,
                        bp,
                        blocks * amx::BLOCK,
                        jb * amx::BLOCK,
                        sums.0.as_mut_ptr(),
                        amx::BLOCK,
                        false,
                    );
                    amx::add_into(
                        &sums,
                        rows,
                        w,
                        c.as_mut_ptr().add(ib * amx::BLOCK * ldc + jb * amx::BLOCK),
                        ldc,
                        acc,
                        beta,
                    );
                }
            }
        }
    })
}

/// `dst[c * ld + r] = src[r * cols + c]`: `src` `[rows, cols]` row-major into `dst` `[cols, ld]`
/// (`rows <= ld`), the other columns of `dst` left as they are. f32 with AVX-512F goes 16 × 16
/// values at a time through registers: element by element, each value was a scalar store `ld`
/// apart, a third of the flash forward's own time and of diff-v1's backward task's on the Zen 4
/// once the column maxima were in registers (docs/design.md §7.36).
#[inline(always)]
pub(crate) fn transpose_into<T: Copy + 'static>(src: &[T], rows: usize, cols: usize, dst: &mut [T], ld: usize) {
    assert!(rows <= ld && src.len() >= rows * cols && dst.len() >= cols * ld, "transpose_into: out of bounds");
    #[cfg(target_arch = "x86_64")]
    if TypeId::of::<T>() == TypeId::of::<f32>() && avx512::available() {
        // SAFETY: T is f32 (checked above); the kernel reads rows × cols values of src and writes
        // rows values of each of dst's first cols rows, inside both slices (asserted above); the
        // CPU has AVX-512F.
        unsafe { avx512::transpose(src.as_ptr() as *const f32, rows, cols, dst.as_mut_ptr() as *mut f32, ld) };
        return;
    }
    for (r, row) in src.chunks_exact(cols.max(1)).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * ld + r] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// The mask of a vector's first `n` lanes (all 16 for `n` ≥ 16).
    #[inline(always)]
    pub(crate) fn lane_mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// [`super::transpose_into`] for f32: blocks of 16 × 16 loaded row by row (masked at the
    /// edges), transposed in registers, stored column by column.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(src: *const f32, rows: usize, cols: usize, dst: *mut f32, ld: usize) {
        for r0 in (0..rows).step_by(16) {
            let rn = (rows - r0).min(16);
            for c0 in (0..cols).step_by(16) {
                let cn = (cols - c0).min(16);
                let at = |i: usize| src.add((r0 + i) * cols + c0);
                let mut v: [__m512; 16] = if rn == 16 && cn == 16 {
                    std::array::from_fn(|i| _mm512_loadu_ps(at(i)))
                } else {
                    std::array::from_fn(|i| {
                        if i < rn {
                            _mm512_maskz_loadu_ps(lane_mask(cn), at(i))
                        } else {
                            _mm512_setzero_ps()
                        }
                    })
                };
                transpose16(&mut v);
                for (j, &vj) in v.iter().enumerate().take(cn) {
                    _mm512_mask_storeu_ps(dst.add((c0 + j) * ld + r0), lane_mask(rn), vj);
                }
            }
        }
    }

    /// In-register transpose of a 16×16 f32 matrix (one row per vector).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn transpose16(r: &mut [__m512; 16]) {
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let (lo, hi) = (
            |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
            |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
        );
        for g in 0..4 {
            let b = 4 * g;
            r[b] = lo(t[b], t[b + 2]);
            r[b + 1] = hi(t[b], t[b + 2]);
            r[b + 2] = lo(t[b + 1], t[b + 3]);
            r[b + 3] = hi(t[b + 1], t[b + 3]);
        }
        for g in 0..2 {
            let b = 8 * g;
            for i in 0..4 {
                t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
                t[b + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(r[b + i], r[b + 4 + i]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
            r[8 + i] = _mm512_shuffle_f32x4::<0xdd>(t[i], t[8 + i]);
        }
    }

    /// Output rows per micro-tile: 12 rows of two vectors are 24 accumulators, with the two
    /// vectors of B's row and a broadcast in 3 of the other 8 of the 32 registers.
    const MR: usize = 12;
    /// Output rows per micro-tile of a 64-column panel: 6 rows of four vectors.
    const MR_WIDE: usize = 6;

    pub(super) fn available() -> bool {
        static AVX512: OnceLock<bool> = OnceLock::new();
        *AVX512.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
    }

    pub(super) fn bf16_available() -> bool {
        static AVX512_BF16: OnceLock<bool> = OnceLock::new();
        *AVX512_BF16.get_or_init(|| available() && std::is_x86_feature_detected!("avx512bf16"))
    }

    /// [`super::mm_rows`]'s operands as checked pointers (`c`, `a` and `b` at a tile's first
    /// element inside the kernel); `E` is what one step over `k` reads of `A` and `B`: an f32
    /// value, or a pair of bf16 values packed in a u32 (then `k` counts pairs).
    pub(super) struct Operands<E> {
        pub(super) k: usize,
        pub(super) c: *mut f32,
        pub(super) ldc: usize,
        pub(super) acc: bool,
        pub(super) a: *const E,
        pub(super) a_rs: usize,
        pub(super) a_cs: usize,
        pub(super) b: *const E,
        pub(super) ldb: usize,
        pub(super) beta: f32,
    }

    impl<E> Clone for Operands<E> {
        fn clone(&self) -> Self {
            *self
        }
    }

    impl<E> Copy for Operands<E> {}

    /// One step of a tile: broadcast a value of `A`, multiply a vector of `B`, add.
    pub(super) trait Step {
        type Elem;
        /// The vector of `B` at `p` (`mask`: its lanes).
        unsafe fn load(p: *const Self::Elem, mask: __mmask16) -> __m512;
        /// `A`'s value at `p` in every lane.
        unsafe fn broadcast(p: *const Self::Elem) -> __m512;
        /// `acc + x·b`, lane by lane.
        unsafe fn madd(acc: __m512, x: __m512, b: __m512) -> __m512;
    }

    /// f32 values: one FMA per value of k.
    pub(super) struct F32;

    impl Step for F32 {
        type Elem = f32;
        #[inline(always)]
        unsafe fn load(p: *const f32, mask: __mmask16) -> __m512 {
            _mm512_maskz_loadu_ps(mask, p)
        }
        #[inline(always)]
        unsafe fn broadcast(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }
        #[inline(always)]
        unsafe fn madd(acc: __m512, x: __m512, b: __m512) -> __m512 {
            _mm512_fmadd_ps(x, b, acc)
        }
    }

    /// Pairs of bf16 values along k: one `vdpbf16ps` (two products per lane) per pair.
    pub(super) struct Bf16Pairs;

    impl Step for Bf16Pairs {
        type Elem = u32;
        #[inline(always)]
        unsafe fn load(p: *const u32, mask: __mmask16) -> __m512 {
            _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, p as *const i32))
        }
        #[inline(always)]
        unsafe fn broadcast(p: *const u32) -> __m512 {
            _mm512_castsi512_ps(_mm512_set1_epi32(*p as i32))
        }
        #[inline(always)]
        unsafe fn madd(acc: __m512, x: __m512, b: __m512) -> __m512 {
            _mm512_dpbf16_ps(
                acc,
                std::mem::transmute::<__m512, __m512bh>(x),
                std::mem::transmute::<__m512, __m512bh>(b),
            )
        }
    }

    /// The `m × n` product of `ops`, tile by tile, in f32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn mm_rows(m: usize, n: usize, ops: Operands<f32>) {
        panels::<F32>(m, n, ops)
    }

    /// The `m × n` product of `ops` on bf16 pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn mm_rows_bf16(m: usize, n: usize, ops: Operands<u32>) {
        panels::<Bf16Pairs>(m, n, ops)
    }

    /// The `m × n` product of `ops`, tile by tile.
    #[inline(always)]
    unsafe fn panels<S: Step>(m: usize, n: usize, ops: Operands<S::Elem>) {
        // lanes of vector v of a panel w columns wide
        let masks = |w: usize| {
            let lanes = |v: usize| w.saturating_sub(16 * v).min(16);
            [0, 1, 2, 3].map(|v| lane_mask(lanes(v)))
        };
        let mut j0 = 0;
        while j0 < n {
            // Panels of 64 columns in tiles of 6 rows while more than 32 columns are left (a
            // broadcast of A feeds four vectors: measured 2-3% faster backward kernels than
            // tiles of 12 rows by 32 columns alone), then one of 32 or fewer in tiles of 12.
            let wide = n - j0 > 32;
            let w = (n - j0).min(if wide { 64 } else { 32 });
            let mut i0 = 0;
            while i0 < m {
                let rows = (m - i0).min(if wide { MR_WIDE } else { MR });
                let at =
                    Operands { c: ops.c.add(i0 * ops.ldc + j0), a: ops.a.add(i0 * ops.a_rs), b: ops.b.add(j0), ..ops };
                let t = Tile::<S> { ops: at, masks: masks(w) };
                match (rows, wide, w > 16) {
                    (12, false, true) => t.run::<12, 2>(),
                    (12, false, false) => t.run::<12, 1>(),
                    (6, true, _) => t.run::<6, 4>(),
                    (r, true, _) => t.run_short_wide(r),
                    (r, false, two) => t.run_short(r, two),
                }
                i0 += rows;
            }
            j0 += w;
        }
    }

    /// One micro-tile: `R` rows of C, `V` vectors wide from column `j0` (`masks`: each vector's lanes).
    struct Tile<S: Step> {
        ops: Operands<S::Elem>,
        masks: [__mmask16; 4],
    }

    impl<S: Step> Tile<S> {
        /// The last rows of a block (fewer than `MR`), one monomorphised tile per count.
        #[inline(always)]
        unsafe fn run_short(&self, rows: usize, two: bool) {
            macro_rules! short {
                ($($r:literal)*) => {
                    match (rows, two) {
                        $(($r, true) => self.run::<$r, 2>(), ($r, false) => self.run::<$r, 1>(),)*
                        _ => unreachable!("a short tile has 1 to 11 rows"),
                    }
                };
            }
            short!(1 2 3 4 5 6 7 8 9 10 11)
        }

        /// The last rows of a wide panel (fewer than `MR_WIDE`).
        #[inline(always)]
        unsafe fn run_short_wide(&self, rows: usize) {
            match rows {
                1 => self.run::<1, 4>(),
                2 => self.run::<2, 4>(),
                3 => self.run::<3, 4>(),
                4 => self.run::<4, 4>(),
                5 => self.run::<5, 4>(),
                _ => unreachable!("a short wide tile has 1 to 5 rows"),
            }
        }

        #[inline(always)]
        unsafe fn run<const R: usize, const V: usize>(&self) {
            let mut s = [[_mm512_setzero_ps(); V]; R];
            let (ops, masks) = (self.ops, self.masks);
            let (mut ap, mut bp) = (ops.a, ops.b);
            for _ in 0..ops.k {
                let mut bv = [_mm512_setzero_ps(); V];
                for v in 0..V {
                    bv[v] = S::load(bp.add(16 * v), masks[v]);
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let x = S::broadcast(ap.add(r * ops.a_rs));
                    for (acc, &bv) in sr.iter_mut().zip(&bv) {
                        *acc = S::madd(*acc, x, bv);
                    }
                }
                ap = ap.add(ops.a_cs);
                bp = bp.add(ops.ldb);
            }
            let beta = _mm512_set1_ps(ops.beta);
            for (r, sr) in s.iter().enumerate() {
                let cr = ops.c.add(r * ops.ldc);
                for (v, &sum) in sr.iter().enumerate() {
                    let out = if ops.acc {
                        _mm512_fmadd_ps(beta, sum, _mm512_maskz_loadu_ps(masks[v], cr.add(16 * v)))
                    } else {
                        _mm512_mul_ps(beta, sum)
                    };
                    _mm512_mask_storeu_ps(cr.add(16 * v), masks[v], out);
                }
            }
        }
    }
}

/// [`mm_rows_bf16_amx`]'s block of sums and its epilogue; the tile kernel and configuration are
/// the linear layers' ([`crate::bf16_matmul`]).
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::avx512::lane_mask;
    use crate::bf16_matmul::{bf16_backend, Bf16Backend};
    use std::arch::x86_64::*;

    /// Rows and columns of a block of C (2 × 2 tiles), and values of k per step.
    pub(super) const BLOCK: usize = 32;

    /// A block of C's sums, row-major (rows of 32), aligned for [`add_into`]'s loads.
    #[repr(C, align(64))]
    pub(super) struct Block(pub(super) [f32; BLOCK * BLOCK]);

    /// Whether the bf16 backend is AMX (`DIFFTX_BF16_BACKEND=avx512_bf16` says it is not).
    pub(super) fn available() -> bool {
        bf16_backend() == Some(Bf16Backend::Amx)
    }

    /// `row[j..j + 16]` (fewer where `lanes` says so, the rest as zeros) rounded to bf16, one
    /// value per 32-bit lane (the low half). Lanes past `lanes` are not read.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn halves(row: *const f32, lanes: __mmask16) -> __m512i {
        let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, row)));
        _mm512_cvtepu16_epi32(v)
    }

    /// The pairs of two rounded runs (`lo` in the low halves, `hi` in the high ones).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pairs_of(lo: __m512i, hi: __m512i) -> __m512i {
        _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16))
    }

    /// `A` with contiguous rows (element `(i, p)` at `a[i * a_rs + p]`) into the tiles' layout:
    /// row `i`'s values `32·blk ..` as the 16 pairs at `ap[(blk * mp + i) * 16 ..]`, zero past
    /// `k` and for the rows `m .. mp`. One pass of masked loads and stores, the conversion inline:
    /// through [`crate::bf16_matmul::to_bf16`] a call per 32 values cost as much as the
    /// conversion (docs/design.md §7.39).
    ///
    /// # Safety
    /// The CPU has AVX512_BF16; rows `i < m` of `a` hold `k` values; `ap` holds
    /// `k.div_ceil(32) · mp · 16` values.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pack_a_rows(a: &[f32], a_rs: usize, m: usize, k: usize, mp: usize, ap: &mut [u32]) {
        let blocks = k.div_ceil(BLOCK);
        debug_assert!(ap.len() >= blocks * mp * 16);
        for blk in 0..blocks {
            let (lo, w) = (blk * BLOCK, k - blk * BLOCK);
            let (m0, m1) = (lane_mask(w), lane_mask(w.saturating_sub(16)));
            for i in 0..mp {
                let out = ap.as_mut_ptr().add((blk * mp + i) * 16) as *mut __m512i;
                if i >= m {
                    _mm512_storeu_si512(out, _mm512_setzero_si512());
                    continue;
                }
                // Masked-off lanes are not read: the addresses past the row need not exist.
                let row = a.as_ptr().wrapping_add(i * a_rs + lo);
                let l = _mm512_maskz_loadu_ps(m0, row);
                let h = _mm512_maskz_loadu_ps(m1, row.wrapping_add(16));
                // The second operand fills the low half (values 0..16).
                _mm512_storeu_si512(out, std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(h, l)));
            }
        }
    }

    /// `A` with contiguous columns (a transposed operand: element `(i, p)` at `a[i + p * a_cs]`)
    /// into the layout of [`pack_a_rows`]: for 16 rows and one block of 32 values of `k`, the
    /// columns `2q` and `2q + 1` give pair `q` of the 16 rows (one vector), and a 16 × 16
    /// transpose in registers puts each row's 16 pairs in one vector.
    ///
    /// # Safety
    /// The CPU has AVX512_BF16; columns `p < k` of `a` hold `m` values; `ap` as in
    /// [`pack_a_rows`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pack_a_columns(a: &[f32], a_cs: usize, m: usize, k: usize, mp: usize, ap: &mut [u32]) {
        let blocks = k.div_ceil(BLOCK);
        debug_assert!(ap.len() >= blocks * mp * 16 && mp.is_multiple_of(16));
        for i0 in (0..mp).step_by(16) {
            let rows = lane_mask(m.saturating_sub(i0));
            for blk in 0..blocks {
                let mut t = [_mm512_setzero_ps(); 16];
                if rows != 0 {
                    for (q, tq) in t.iter_mut().enumerate() {
                        let p = blk * BLOCK + 2 * q;
                        let col = |p: usize| {
                            if p < k {
                                halves(a.as_ptr().wrapping_add(p * a_cs + i0), rows)
                            } else {
                                _mm512_setzero_si512()
                            }
                        };
                        *tq = _mm512_castsi512_ps(pairs_of(col(p), col(p + 1)));
                    }
                    // Bits only: the transpose moves 32-bit lanes.
                    super::avx512::transpose16(&mut t);
                }
                for (r, &tr) in t.iter().enumerate() {
                    let out = ap.as_mut_ptr().add((blk * mp + i0 + r) * 16);
                    _mm512_storeu_si512(out as *mut __m512i, _mm512_castps_si512(tr));
                }
            }
        }
    }

    /// `B` with contiguous rows (row `p` at `b[p * ldb ..][.. n]`) into panels of 16 columns of
    /// pairs along `k`: pair row `p`, column `16·panel + j` at `bp[(panel * pairs + p) * 16 + j]`
    /// (`pairs`: `k` rounded up to 32, halved), zero past `k` and `n` (up to `np`). Each pair of
    /// rows is read once from start to end into every panel.
    ///
    /// # Safety
    /// The CPU has AVX512_BF16; rows `p < k` of `b` hold `n` values; `bp` holds
    /// `np / 16 · pairs · 16` values.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pack_b_rows(b: &[f32], ldb: usize, n: usize, k: usize, np: usize, bp: &mut [u32]) {
        let pairs = k.div_ceil(BLOCK) * BLOCK / 2;
        debug_assert!(bp.len() >= np / 16 * pairs * 16);
        for p in 0..pairs {
            let row = |r: usize, j0: usize, lanes: __mmask16| {
                if r < k && lanes != 0 {
                    halves(b.as_ptr().wrapping_add(r * ldb + j0), lanes)
                } else {
                    _mm512_setzero_si512()
                }
            };
            for panel in 0..np / 16 {
                let j0 = panel * 16;
                let lanes = lane_mask(n.saturating_sub(j0));
                let v = pairs_of(row(2 * p, j0, lanes), row(2 * p + 1, j0, lanes));
                _mm512_storeu_si512(bp.as_mut_ptr().add((panel * pairs + p) * 16) as *mut __m512i, v);
            }
        }
    }

    /// `C = (acc ? C : 0) + beta·sums` over the block's first `rows` rows and `w` columns (`c`:
    /// its first element, rows `ldc` apart).
    ///
    /// # Safety
    /// The CPU has AVX-512F; those rows and columns of C are writable.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn add_into(sums: &Block, rows: usize, w: usize, c: *mut f32, ldc: usize, acc: bool, beta: f32) {
        let beta = _mm512_set1_ps(beta);
        let masks = [lane_mask(w), lane_mask(w.saturating_sub(16))];
        for r in 0..rows {
            let cr = c.add(r * ldc);
            for (v, &mask) in masks.iter().enumerate() {
                if mask == 0 {
                    continue;
                }
                let s = _mm512_load_ps(sums.0.as_ptr().add(r * BLOCK + 16 * v));
                let out = if acc {
                    _mm512_fmadd_ps(beta, s, _mm512_maskz_loadu_ps(mask, cr.add(16 * v)))
                } else {
                    _mm512_mul_ps(beta, s)
                };
                _mm512_mask_storeu_ps(cr.add(16 * v), mask, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `C = (acc ? C : 0) + beta·A·B` in f64 from the same strided operands.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        m: usize,
        n: usize,
        k: usize,
        c: &mut [f64],
        ldc: usize,
        acc: bool,
        a: &[f32],
        a_rs: usize,
        a_cs: usize,
        b: &[f32],
        ldb: usize,
        beta: f64,
    ) {
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| a[i * a_rs + p * a_cs] as f64 * b[p * ldb + j] as f64).sum();
                let c0 = if acc { c[i * ldc + j] } else { 0.0 };
                c[i * ldc + j] = c0 + beta * s;
            }
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Awkward shapes (tails of the 12-row tiles and of the 16-lane vectors, one column, k = 1,
    /// odd k), A by rows, by columns or with neither stride 1, accumulate or overwrite, padding
    /// between rows of C and B that must stay untouched: `product` against the f64 product of
    /// the same values after `round`, within `rel` per sqrt(k).
    fn check_awkward_shapes(product: Product, round: fn(f32) -> f32, rel: f64) {
        for &(m, n, k) in &[
            (1, 1, 1),
            (12, 32, 32),
            (13, 33, 7),
            (5, 16, 128),
            (128, 32, 128),
            (27, 17, 3),
            (128, 128, 32),
            (11, 70, 40),
            (7, 100, 5),
            (6, 64, 9),
            (64, 128, 33),
        ] {
            for a_layout in 0..3 {
                for acc in [false, true] {
                    let (ldc, ldb) = (n + 3, n + 5);
                    let (a_rs, a_cs) = match a_layout {
                        0 => (k + 1, 1),
                        1 => (1, m + 2),
                        _ => (2 * k + 1, 2),
                    };
                    let a = values((m - 1) * a_rs + (k - 1) * a_cs + 1, 1);
                    let b = values(k * ldb, 2);
                    let c0 = values(m * ldc, 3);
                    let mut c = c0.clone();
                    product(m, n, k, &mut c, ldc, acc, &a, a_rs, a_cs, &b, ldb, 0.7f32);
                    let (ar, br): (Vec<f32>, Vec<f32>) =
                        (a.iter().map(|&x| round(x)).collect(), b.iter().map(|&x| round(x)).collect());
                    let mut want: Vec<f64> = c0.iter().map(|&x| x as f64).collect();
                    naive(m, n, k, &mut want, ldc, acc, &ar, a_rs, a_cs, &br, ldb, 0.7f32 as f64);
                    for i in 0..m {
                        for j in 0..ldc {
                            let (got, want) = (c[i * ldc + j] as f64, want[i * ldc + j]);
                            if j >= n {
                                assert_eq!(c[i * ldc + j], c0[i * ldc + j], "padding written at ({i}, {j})");
                            } else {
                                let tol = rel * (k as f64).sqrt() * (1.0 + want.abs());
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{m}x{n}x{k} A layout {a_layout} acc {acc} at ({i}, {j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    type Product = fn(usize, usize, usize, &mut [f32], usize, bool, &[f32], usize, usize, &[f32], usize, f32);

    #[test]
    fn matches_f64_product_on_awkward_shapes() {
        check_awkward_shapes(mm_rows::<f32>, |x| x, 1e-6);
    }

    /// The bf16 products equal the f64 products of the rounded values up to f32 sums: a kernel
    /// that skipped the rounding, a pair, or the padding of an odd k would be off by ~1e-3.
    #[test]
    fn bf16_matches_f64_product_of_rounded_values() {
        check_awkward_shapes(mm_rows_bf16, |x| bf16_to_f32(bf16_bits(x)), 1e-6);
        // Each path this CPU has: AMX tiles, AVX512_BF16 pairs.
        #[cfg(target_arch = "x86_64")]
        if amx::available() {
            check_awkward_shapes(mm_rows_bf16_amx, |x| bf16_to_f32(bf16_bits(x)), 1e-6);
        }
        check_awkward_shapes(mm_rows_bf16_pairs, |x| bf16_to_f32(bf16_bits(x)), 1e-6);
        // The path of CPUs without AVX512_BF16, whatever this one has.
        check_awkward_shapes(mm_rows_bf16_rounded, |x| bf16_to_f32(bf16_bits(x)), 1e-6);
    }

    /// `transpose_into` (16 × 16 blocks in registers for f32 where the CPU has AVX-512F, element
    /// by element otherwise) writes every value where it belongs and nothing past `rows` in each
    /// row of `dst`: shapes with partial blocks in either direction, one row or column, none, and
    /// `ld` wider than `rows`.
    #[test]
    fn transpose_into_puts_every_value_in_place() {
        fn check<T: Copy + PartialEq + std::fmt::Debug + 'static>(of: impl Fn(f32) -> T, pad: T) {
            for (rows, cols, ld) in [
                (1, 1, 1),
                (3, 5, 7),
                (16, 16, 16),
                (17, 33, 40),
                (128, 32, 128),
                (5, 40, 5),
                (0, 3, 4),
                (31, 16, 33),
                (16, 1, 20),
            ] {
                let src: Vec<T> = values(rows * cols, (rows * 100 + cols) as u64).into_iter().map(&of).collect();
                let mut dst = vec![pad; cols * ld];
                transpose_into(&src, rows, cols, &mut dst, ld);
                for c in 0..cols {
                    for r in 0..ld {
                        let want = if r < rows { src[r * cols + c] } else { pad };
                        assert_eq!(dst[c * ld + r], want, "({rows}, {cols}, ld {ld}): dst[{c}][{r}]");
                    }
                }
            }
        }
        check(|x| x, f32::MAX);
        check(|x| x as f64, f64::MAX);
    }
}
