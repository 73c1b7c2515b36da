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

use crate::float::Float;
use std::any::TypeId;

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
    let last = |rs: usize, cs: usize, r: usize, c: usize| (r - 1) * rs + (c - 1) * cs;
    assert!(n <= ldc && last(ldc, 1, m, n) < c.len(), "mm_rows: C out of bounds");
    if k == 0 {
        if !acc {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(T::ZERO);
            }
        }
        return;
    }
    assert!(last(a_rs, a_cs, m, k) < a.len(), "mm_rows: A out of bounds");
    assert!(last(ldb, 1, k, n) < b.len(), "mm_rows: B out of bounds");
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

/// `dst[c * ld + r] = src[r * cols + c]`: `src` `[rows, cols]` row-major into `dst` `[cols, ld]`
/// (`rows <= ld`), the other columns of `dst` left as they are.
#[inline(always)]
pub(crate) fn transpose_into<T: Copy>(src: &[T], rows: usize, cols: usize, dst: &mut [T], ld: usize) {
    assert!(rows <= ld && src.len() >= rows * cols && dst.len() >= cols * ld, "transpose_into: out of bounds");
    for (r, row) in src.chunks_exact(cols.max(1)).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * ld + r] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Output rows per micro-tile: 12 rows of two vectors are 24 accumulators, with the two
    /// vectors of B's row and a broadcast in 3 of the other 8 of the 32 registers.
    const MR: usize = 12;
    /// Output rows per micro-tile of a 64-column panel: 6 rows of four vectors.
    const MR_WIDE: usize = 6;

    pub(super) fn available() -> bool {
        static AVX512: OnceLock<bool> = OnceLock::new();
        *AVX512.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
    }

    /// [`super::mm_rows`]'s operands as checked pointers (`c`, `a` and `b` at a tile's first
    /// element inside the kernel).
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        pub(super) k: usize,
        pub(super) c: *mut f32,
        pub(super) ldc: usize,
        pub(super) acc: bool,
        pub(super) a: *const f32,
        pub(super) a_rs: usize,
        pub(super) a_cs: usize,
        pub(super) b: *const f32,
        pub(super) ldb: usize,
        pub(super) beta: f32,
    }

    /// The `m × n` product of `ops`, tile by tile.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn mm_rows(m: usize, n: usize, ops: Operands) {
        // lanes of vector v of a panel w columns wide
        let masks = |w: usize| {
            let lanes = |v: usize| w.saturating_sub(16 * v).min(16);
            [0, 1, 2, 3].map(|v| if lanes(v) >= 16 { 0xffff } else { ((1u32 << lanes(v)) - 1) as __mmask16 })
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
                let t = Tile { ops: at, masks: masks(w) };
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
    struct Tile {
        ops: Operands,
        masks: [__mmask16; 4],
    }

    impl Tile {
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
                    bv[v] = _mm512_maskz_loadu_ps(masks[v], bp.add(16 * v));
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*ap.add(r * ops.a_rs));
                    for (acc, &bv) in sr.iter_mut().zip(&bv) {
                        *acc = _mm512_fmadd_ps(x, bv, *acc);
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

    /// Awkward shapes (tails of the 12-row tiles and of the 16-lane vectors, one column, k = 1),
    /// both layouts of A, accumulate or overwrite, padding between rows of C and B that must
    /// stay untouched: against the f64 product of the same f32 values.
    #[test]
    fn matches_f64_product_on_awkward_shapes() {
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
        ] {
            for a_transposed in [false, true] {
                for acc in [false, true] {
                    let (ldc, ldb) = (n + 3, n + 5);
                    let (a_rs, a_cs) = if a_transposed { (1, m + 2) } else { (k + 1, 1) };
                    let a = values((m - 1) * a_rs + (k - 1) * a_cs + 1, 1);
                    let b = values(k * ldb, 2);
                    let c0 = values(m * ldc, 3);
                    let mut c = c0.clone();
                    mm_rows(m, n, k, &mut c, ldc, acc, &a, a_rs, a_cs, &b, ldb, 0.7f32);
                    let mut want: Vec<f64> = c0.iter().map(|&x| x as f64).collect();
                    naive(m, n, k, &mut want, ldc, acc, &a, a_rs, a_cs, &b, ldb, 0.7f32 as f64);
                    for i in 0..m {
                        for j in 0..ldc {
                            let (got, want) = (c[i * ldc + j] as f64, want[i * ldc + j]);
                            if j >= n {
                                assert_eq!(c[i * ldc + j], c0[i * ldc + j], "padding written at ({i}, {j})");
                            } else {
                                let tol = 1e-6 * (k as f64).sqrt() * (1.0 + want.abs());
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{m}x{n}x{k} acc {acc} at ({i}, {j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
