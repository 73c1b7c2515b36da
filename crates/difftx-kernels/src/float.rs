//! Element types the kernels are generic over (f32, f64) and the few scalar helpers they need.
//!
//! `exp_inplace` is the hot transcendental: for f32 it is a branch-free polynomial (Cody-Waite
//! range reduction + degree-7 Taylor, max relative error ~2e-7) that LLVM vectorises; for f64 it
//! is the exact libm `exp` (f64 is only used for reference checks and finite differences).

use candle_core::WithDType;

pub(crate) trait Float: WithDType + Copy + Send + Sync + PartialOrd + 'static {
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    /// `exp` with fused multiply-adds, for code compiled with FMA (see [`fast_exp_f32_with`]).
    fn exp_fused(self) -> Self;
    fn sqrt(self) -> Self;
    fn ln(self) -> Self;
    fn maxf(self, o: Self) -> Self;
    /// `xs[i] = exp(xs[i])`; `-inf` maps to exactly 0.
    fn exp_inplace(xs: &mut [Self]);
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        fast_exp_f32(self)
    }
    #[inline(always)]
    fn exp_fused(self) -> Self {
        fast_exp_f32_with::<true>(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn maxf(self, o: Self) -> Self {
        if o > self {
            o
        } else {
            self
        }
    }
    #[inline(always)]
    fn exp_inplace(xs: &mut [Self]) {
        for x in xs.iter_mut() {
            *x = fast_exp_f32(*x);
        }
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn exp_fused(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn maxf(self, o: Self) -> Self {
        if o > self {
            o
        } else {
            self
        }
    }
    #[inline(always)]
    fn exp_inplace(xs: &mut [Self]) {
        for x in xs.iter_mut() {
            *x = f64::exp(*x);
        }
    }
}

/// `exp(x)` for f32 with separate multiplies and adds: [`fast_exp_f32_with::<false>`].
#[inline(always)]
pub(crate) fn fast_exp_f32(x: f32) -> f32 {
    fast_exp_f32_with::<false>(x)
}

/// `a·b + c`, as one fused multiply-add when `FUSED` (one rounding instead of two).
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Branch-free exp for f32. Inputs below -87 (including -inf) return 0, inputs above 88 saturate
/// at exp(88); NaN stays NaN. Written with selects and integer bit tricks only (no calls, no
/// saturating float->int casts) so loops over it vectorise: Cody-Waite range reduction and a
/// degree-7 Taylor polynomial (max relative error ~2e-7 either way). With `FUSED` every
/// multiply-add of the reduction and the polynomial is one FMA: 10 instructions fewer per vector
/// where the code is compiled with FMA (flash's and the differential ops' per-ISA variants);
/// elsewhere each `mul_add` would be a call into libm, so plain code uses `FUSED = false`.
#[allow(clippy::manual_clamp)] // f32::clamp keeps NaN; maxnum/minnum map it to a finite value
#[inline(always)]
pub(crate) fn fast_exp_f32_with<const FUSED: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer in the low bits
    let xc = x.max(-87.0).min(88.0); // maxnum/minnum: NaN becomes -87 here, restored below
    let t = madd::<FUSED>(xc, LOG2E, MAGIC);
    let n = t - MAGIC;
    // n as an i32, read from the bits (no saturating cast)
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    // r = x − n·ln 2 in two parts, |r| <= ~0.347.
    let r = madd::<FUSED>(-n, LN2_LO, madd::<FUSED>(-n, LN2_HI, xc));
    // exp(r) by Taylor to degree 7 (truncation error < 1e-8 on |r| <= 0.35), Horner's rule.
    const C: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    let mut p = C[0];
    for &c in &C[1..] {
        p = madd::<FUSED>(p, r, c);
    }
    // wrapping ops: overflow checks (dev/test profiles) would stop the loop from vectorising.
    let scale = f32::from_bits((ni.wrapping_add(127) as u32).wrapping_shl(23));
    let v = p * scale;
    let v = if x < -87.0 { 0.0 } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// Lanes of the reductions and the exponentiation loops below: one AVX-512 vector of f32. With 8
/// (one AVX2 vector) LLVM kept even the AVX-512 kernels' exp loops on 256-bit registers.
const LANES: usize = 16;

/// Maximum of a slice (`-inf` when empty), over `LANES` lanes so it vectorises.
#[inline(always)]
pub(crate) fn max_slice<T: Float>(x: &[T], init: T) -> T {
    let mut acc = [init; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for k in 0..LANES {
            acc[k] = acc[k].maxf(c[k]);
        }
    }
    let mut m = init;
    for &v in it.remainder() {
        m = m.maxf(v);
    }
    for a in acc {
        m = m.maxf(a);
    }
    m
}

/// `m[g] = max(m[g], max_j rows[j·n + g])` for the rows of `rows` (`[rows.len() / n, n]`, `n` =
/// `m.len()`), by `maxf` in row order. The running maxima of a block of columns stay in registers
/// down all the rows and are stored once: written row by row (`m[g] = m[g].maxf(x)`), LLVM stored
/// a vector of `m` only where a lane changed, a masked store, and the next row's load of it cannot
/// be forwarded from a masked store; that wait was ~40% of the flash forward's own time on the
/// Zen 4 (docs/design.md §7.36).
#[inline(always)]
pub(crate) fn max_down_columns<T: Float>(rows: &[T], m: &mut [T]) {
    let n = m.len();
    if n == 0 {
        return;
    }
    let mut g0 = 0;
    while g0 + 4 * LANES <= n {
        max_down_block::<T, { 4 * LANES }>(rows, n, g0, m);
        g0 += 4 * LANES;
    }
    while g0 + LANES <= n {
        max_down_block::<T, LANES>(rows, n, g0, m);
        g0 += LANES;
    }
    for g in g0..n {
        let mut acc = m[g];
        for row in rows.chunks_exact(n) {
            acc = acc.maxf(row[g]);
        }
        m[g] = acc;
    }
}

/// [`max_down_columns`] over the `W` columns from `g0`.
#[inline(always)]
fn max_down_block<T: Float, const W: usize>(rows: &[T], n: usize, g0: usize, m: &mut [T]) {
    let mut acc: [T; W] = std::array::from_fn(|l| m[g0 + l]);
    for row in rows.chunks_exact(n) {
        let r: &[T; W] = row[g0..g0 + W].try_into().unwrap();
        for l in 0..W {
            acc[l] = acc[l].maxf(r[l]);
        }
    }
    m[g0..g0 + W].copy_from_slice(&acc);
}

/// `rows[j·n + g] = exp_fused(rows[j·n + g] − m[g])` for every row `j`, and `sum[g]` the sum of
/// column `g`'s new values in row order (`n` = `m.len()` = `sum.len()`): the flash forward's
/// probabilities and their row sums from transposed scores. As in [`max_down_columns`], a block
/// of columns keeps its sums and maxima in registers down all the rows: row by row, every row
/// loaded and stored each column's sum again, a chain through memory from row to row.
#[inline(always)]
pub(crate) fn exp_down_columns<T: Float>(rows: &mut [T], m: &[T], sum: &mut [T]) {
    let n = m.len();
    assert_eq!(sum.len(), n, "exp_down_columns: one sum per column");
    if n == 0 {
        return;
    }
    let mut g0 = 0;
    while g0 + LANES <= n {
        let shift: [T; LANES] = std::array::from_fn(|l| m[g0 + l]);
        let mut acc = [T::ZERO; LANES];
        for row in rows.chunks_exact_mut(n) {
            let r: &mut [T; LANES] = (&mut row[g0..g0 + LANES]).try_into().unwrap();
            for l in 0..LANES {
                let e = (r[l] - shift[l]).exp_fused();
                r[l] = e;
                acc[l] += e;
            }
        }
        sum[g0..g0 + LANES].copy_from_slice(&acc);
        g0 += LANES;
    }
    for g in g0..n {
        let mut acc = T::ZERO;
        for row in rows.chunks_exact_mut(n) {
            let e = (row[g] - m[g]).exp_fused();
            row[g] = e;
            acc += e;
        }
        sum[g] = acc;
    }
}

/// Sum of a slice over `LANES` lanes.
#[inline(always)]
pub(crate) fn sum_slice<T: Float>(x: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for k in 0..LANES {
            acc[k] += c[k];
        }
    }
    let mut s = T::ZERO;
    for &v in it.remainder() {
        s += v;
    }
    for a in acc {
        s += a;
    }
    s
}

/// `exp_fused(x − shift)` of the last `x.len() < LANES` elements as one vector (the spare
/// lanes exponentiate −∞ to 0), so that the short tail of every row is not done one element at
/// a time: in a diagonal tile each row has one. Returns the results' sum, added in order.
#[inline(always)]
fn exp_shifted_tail<T: Float>(x: &mut [T], shift: T) -> T {
    let mut s = T::ZERO;
    if x.is_empty() {
        return s;
    }
    let mut e = [T::NEG_INF; LANES];
    e[..x.len()].copy_from_slice(x);
    for v in e.iter_mut() {
        *v = (*v - shift).exp_fused();
    }
    x.copy_from_slice(&e[..x.len()]);
    for &v in &e[..x.len()] {
        s += v;
    }
    s
}

/// `x[..n] ← exp_fused(x[..n] − shift)` and `x[n..] ← 0`: a row of recomputed probabilities whose
/// first `n` keys are visible. Whole `LANES`-lane chunks throughout, the one holding position `n`
/// exponentiated whole and its lanes from `n` on set to zero: the short prefix through
/// [`exp_shifted_tail`] copied it into a vector through `memcpy`, and the vector's load could
/// not be forwarded from the copy's stores, a wait in every row of a diagonal tile (~11% of the
/// flash backward's own time on the Zen 4, docs/design.md §7.36).
#[inline(always)]
pub(crate) fn exp_shifted_prefix<T: Float>(x: &mut [T], n: usize, shift: T) {
    let mut chunks = x.chunks_exact_mut(LANES);
    let mut at = 0;
    for c in &mut chunks {
        if at >= n {
            c.fill(T::ZERO);
        } else if at + LANES <= n {
            for v in c.iter_mut() {
                *v = (*v - shift).exp_fused();
            }
        } else {
            for (l, v) in c.iter_mut().enumerate() {
                let e = (*v - shift).exp_fused();
                *v = if at + l < n { e } else { T::ZERO };
            }
        }
        at += LANES;
    }
    for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
        *v = if at + l < n { (*v - shift).exp_fused() } else { T::ZERO };
    }
}

/// `x ← exp(x − shift)` in place (`exp_fused`), returning the sum of the results: one pass for
/// what the subtraction, the exponentiation and `sum_slice` do in three, with `sum_slice`'s lanes
/// and order (the same bits).
#[inline(always)]
pub(crate) fn exp_shifted_sum<T: Float>(x: &mut [T], shift: T) -> T {
    let mut acc = [T::ZERO; LANES];
    let mut it = x.chunks_exact_mut(LANES);
    for c in &mut it {
        for k in 0..LANES {
            let e = (c[k] - shift).exp_fused();
            c[k] = e;
            acc[k] += e;
        }
    }
    let mut s = exp_shifted_tail(it.into_remainder(), shift);
    for a in acc {
        s += a;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both forms (two roundings per multiply-add, or one) against libm's f64 `exp`.
    #[test]
    fn fast_exp_matches_libm() {
        for (name, exp) in [("plain", fast_exp_f32 as fn(f32) -> f32), ("fused", fast_exp_f32_with::<true>)] {
            let mut worst = 0.0f64;
            let mut x = -87.0f32;
            while x <= 88.0 {
                let got = exp(x) as f64;
                let want = (x as f64).exp();
                worst = worst.max(((got - want) / want).abs());
                x += 0.001_37;
            }
            assert!(worst < 5e-7, "{name}: worst relative error {worst}");
            assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{name}");
            assert_eq!(exp(-1000.0), 0.0, "{name}");
            assert_eq!(exp(0.0), 1.0, "{name}");
            assert!(exp(f32::NAN).is_nan(), "{name}");
        }
    }

    /// The one-pass helpers (`LANES`-lane body, vector tail) give the bits of the element-by-element
    /// passes they replace (subtract, `exp_fused`, `sum_slice`, zeros past a visible prefix), at
    /// lengths and prefixes around the lanes.
    #[test]
    fn one_pass_exp_helpers_equal_the_separate_passes() {
        fn check<T: Float + std::fmt::Debug>(gen: impl Fn(usize) -> T, shift: T) {
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 33, 130] {
                let x: Vec<T> = (0..n).map(&gen).collect();
                let passes: Vec<T> = x.iter().map(|&v| (v - shift).exp_fused()).collect();
                let mut summed = x.clone();
                let sum = exp_shifted_sum(&mut summed, shift);
                assert_eq!(summed, passes, "exp_shifted_sum values, n = {n}");
                assert_eq!(sum, sum_slice(&passes), "exp_shifted_sum, n = {n}");
                for visible in [0, 1, n / 2, n.saturating_sub(1), n] {
                    let mut prefix = x.clone();
                    exp_shifted_prefix(&mut prefix, visible, shift);
                    let want: Vec<T> =
                        passes.iter().enumerate().map(|(i, &e)| if i < visible { e } else { T::ZERO }).collect();
                    assert_eq!(prefix, want, "exp_shifted_prefix, n = {n}, visible = {visible}");
                }
            }
        }
        check(|i| (i as f32 * 0.37).sin() * 5.0, 1.25f32);
        check(|i| (i as f64 * 0.37).sin() * 5.0, 1.25f64);
    }

    /// `max_down_columns` gives the bits of `maxf` applied row by row, column by column, and
    /// `exp_down_columns` those of `exp_fused` and a sum per column added row by row, at widths
    /// around their 64- and 16-column blocks, with no rows, one row, and rows holding −∞ and NaN
    /// (a NaN never replaces a running maximum under `maxf`; a NaN running maximum stays).
    #[test]
    fn column_helpers_equal_the_row_by_row_passes() {
        fn check<T: Float + std::fmt::Debug>(gen: impl Fn(usize) -> T, bits: impl Fn(T) -> u64) {
            for n in [1, 5, 15, 16, 17, 63, 64, 65, 80, 130] {
                for rows in [0, 1, 3, 128] {
                    let s: Vec<T> = (0..rows * n).map(&gen).collect();
                    let init: Vec<T> = (0..n).map(|g| if g % 7 == 3 { T::NEG_INF } else { gen(g + 11) }).collect();
                    let mut want = init.clone();
                    for row in s.chunks_exact(n) {
                        for (x, &v) in want.iter_mut().zip(row) {
                            *x = x.maxf(v);
                        }
                    }
                    let mut got = init;
                    max_down_columns(&s, &mut got);
                    let all_bits = |v: &[T]| v.iter().map(|&x| bits(x)).collect::<Vec<u64>>();
                    assert_eq!(all_bits(&got), all_bits(&want), "max_down_columns, n = {n}, rows = {rows}");

                    let (mut want_p, mut want_sum) = (s.clone(), vec![T::ZERO; n]);
                    for row in want_p.chunks_exact_mut(n) {
                        for ((x, &m), p) in row.iter_mut().zip(&want).zip(want_sum.iter_mut()) {
                            *x = (*x - m).exp_fused();
                            *p += *x;
                        }
                    }
                    let (mut got_p, mut got_sum) = (s.clone(), vec![T::ONE; n]);
                    exp_down_columns(&mut got_p, &want, &mut got_sum);
                    assert_eq!(all_bits(&got_p), all_bits(&want_p), "exp_down_columns values, n = {n}, rows = {rows}");
                    assert_eq!(
                        all_bits(&got_sum),
                        all_bits(&want_sum),
                        "exp_down_columns sums, n = {n}, rows = {rows}"
                    );
                }
            }
        }
        let f32_at = |i: usize| match i % 23 {
            5 => f32::NAN,
            9 => f32::NEG_INFINITY,
            _ => (i as f32 * 0.37).sin() * 5.0,
        };
        check(f32_at, |x: f32| x.to_bits() as u64);
        check(|i| f32_at(i) as f64, |x: f64| x.to_bits());
    }
}
