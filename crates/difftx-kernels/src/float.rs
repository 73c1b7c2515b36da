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
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn maxf(self, o: Self) -> Self {
        if o > self { o } else { self }
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
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn maxf(self, o: Self) -> Self {
        if o > self { o } else { self }
    }
    #[inline(always)]
    fn exp_inplace(xs: &mut [Self]) {
        for x in xs.iter_mut() {
            *x = f64::exp(*x);
        }
    }
}

/// Branch-free exp for f32. Inputs below -87 (including -inf) return 0, inputs above 88 saturate
/// at exp(88); NaN stays NaN. Written without calls or branches so loops over it vectorise.
#[inline(always)]
pub(crate) fn fast_exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting rounds to nearest
    let xc = x.clamp(-87.0, 88.0);
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO; // |r| <= ~0.347
    // exp(r) by Taylor to degree 7 (truncation error < 1e-8 on |r| <= 0.35).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    let v = p * scale;
    if x < -87.0 { 0.0 } else if x != x { x } else { v }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let got = fast_exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(fast_exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp_f32(-1000.0), 0.0);
        assert_eq!(fast_exp_f32(0.0), 1.0);
        assert!(fast_exp_f32(f32::NAN).is_nan());
    }
}
