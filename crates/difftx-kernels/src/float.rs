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

/// `x ← exp(x − shift)` in place (`exp_fused`: for code compiled with FMA): one pass for the
/// subtraction and the exponentiation.
#[inline(always)]
pub(crate) fn exp_shifted<T: Float>(x: &mut [T], shift: T) {
    let mut it = x.chunks_exact_mut(LANES);
    for c in &mut it {
        for v in c.iter_mut() {
            *v = (*v - shift).exp_fused();
        }
    }
    exp_shifted_tail(it.into_remainder(), shift);
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
    /// passes they replace (subtract, `exp_fused`, `sum_slice`), at lengths around the lanes.
    #[test]
    fn one_pass_exp_helpers_equal_the_separate_passes() {
        fn check<T: Float + std::fmt::Debug>(gen: impl Fn(usize) -> T, shift: T) {
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 33, 130] {
                let x: Vec<T> = (0..n).map(&gen).collect();
                let passes: Vec<T> = x.iter().map(|&v| (v - shift).exp_fused()).collect();
                let (mut one, mut summed) = (x.clone(), x.clone());
                exp_shifted(&mut one, shift);
                let sum = exp_shifted_sum(&mut summed, shift);
                assert_eq!(one, passes, "exp_shifted, n = {n}");
                assert_eq!(summed, passes, "exp_shifted_sum values, n = {n}");
                assert_eq!(sum, sum_slice(&passes), "exp_shifted_sum, n = {n}");
            }
        }
        check(|i| (i as f32 * 0.37).sin() * 5.0, 1.25f32);
        check(|i| (i as f64 * 0.37).sin() * 5.0, 1.25f64);
    }
}
