//! Parameter and token efficiency (the paper's Fig. 3 claim: "DIFF Transformer requires only about
//! 65% of model size or training tokens needed by Transformer").
//!
//! - [`fit_log_linear`]: least-squares fit of `loss = a + b·ln(params)` over model sizes.
//! - [`param_ratio`]: the other family's size over the baseline size that reaches the same loss on
//!   the baseline's fitted law, as a geometric mean over the other family's sizes (0.65 = "matches
//!   the baseline's loss with 65% of its parameters").
//! - [`token_ratio`]: where the other family's loss curve first reaches the baseline's final loss,
//!   over the baseline's final token count (< 1: fewer tokens needed); when it never does, the
//!   other family's final tokens over where the baseline reaches the other's final loss (> 1).

use anyhow::{bail, Result};

/// Least squares of `loss = a + b·ln(params)` over `(params, loss)` points; returns `(a, b)`.
/// Errors on non-positive or non-finite values and on fewer than two distinct sizes.
pub fn fit_log_linear(points: &[(f64, f64)]) -> Result<(f64, f64)> {
    if let Some(p) = points.iter().find(|(n, l)| !(n.is_finite() && *n > 0.0 && l.is_finite())) {
        bail!("efficiency: point ({}, {}) needs a positive finite size and a finite loss", p.0, p.1);
    }
    let mut sizes: Vec<f64> = points.iter().map(|p| p.0).collect();
    sizes.sort_by(|a, b| a.total_cmp(b));
    sizes.dedup();
    if sizes.len() < 2 {
        bail!("efficiency: a log-linear fit needs at least 2 distinct model sizes, got {}", sizes.len());
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0.ln()).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0.ln() - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0.ln() - mx).powi(2)).sum();
    let b = sxy / sxx;
    Ok((my - b * mx, b))
}

/// Parameter ratio of `other` against `baseline` (both `(params, loss)` points): fits the
/// baseline's law, maps each of the other family's losses L to the baseline size with that loss,
/// `N_b* = exp((L − a)/b)`, and returns the geometric mean of `N_other / N_b*`. Below 1 the other
/// family needs fewer parameters for the same loss. Errors when the baseline's fit fails, its
/// slope is not negative (loss must fall with size), or `other` is empty or invalid.
pub fn param_ratio(baseline: &[(f64, f64)], other: &[(f64, f64)]) -> Result<f64> {
    let (a, b) = fit_log_linear(baseline)?;
    if b >= 0.0 {
        bail!("efficiency: the baseline's loss does not fall with model size (slope {b:.4} per ln-parameter)");
    }
    if other.is_empty() {
        bail!("efficiency: no points for the other family");
    }
    if let Some(p) = other.iter().find(|(n, l)| !(n.is_finite() && *n > 0.0 && l.is_finite())) {
        bail!("efficiency: point ({}, {}) needs a positive finite size and a finite loss", p.0, p.1);
    }
    // ln(N / N_b*) = ln N − (L − a)/b, averaged: the log of the geometric mean
    let mean_log = other.iter().map(|(n, l)| n.ln() - (l - a) / b).sum::<f64>() / other.len() as f64;
    Ok(mean_log.exp())
}

/// Sorted, finite copy of a `(tokens, loss)` curve.
fn clean_curve(curve: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut c: Vec<(f64, f64)> =
        curve.iter().copied().filter(|(t, l)| t.is_finite() && *t > 0.0 && l.is_finite()).collect();
    c.sort_by(|x, y| x.0.total_cmp(&y.0));
    c
}

/// Tokens at which `curve` first reaches (≤) `target`, by linear interpolation between the two
/// points around the crossing; the first point's tokens when it is already at or below target.
fn first_crossing(curve: &[(f64, f64)], target: f64) -> Option<f64> {
    let first = curve.first()?;
    if first.1 <= target {
        return Some(first.0);
    }
    curve.windows(2).find(|w| w[1].1 <= target).map(|w| {
        let ((t0, l0), (t1, l1)) = (w[0], w[1]);
        // l0 > target >= l1, so l0 > l1
        t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    })
}

/// Token ratio of `other` against `baseline`, from `(tokens, validation loss)` curves.
/// If the other family's curve reaches the baseline's final loss, returns the tokens at which it
/// first does (linear interpolation between points; the first point's tokens if it starts at or
/// below it, so then the ratio is an upper bound) over the baseline's final tokens: < 1 means the
/// other family needs fewer tokens. Otherwise, finds the tokens T where the baseline first reaches
/// the other's final loss and returns `other_final_tokens / T` (> 1: the other needs more; a lower
/// bound when the baseline starts below that loss). Non-finite or non-positive-token points are
/// dropped; None when a curve has no usable point or neither crossing exists (with two non-empty
/// curves one always does: the curve that ends lower reaches the other's final loss).
pub fn token_ratio(baseline: &[(f64, f64)], other: &[(f64, f64)]) -> Option<f64> {
    let (b, o) = (clean_curve(baseline), clean_curve(other));
    let (&(tb, lb), &(to, lo)) = (b.last()?, o.last()?);
    if let Some(t) = first_crossing(&o, lb) {
        return Some(t / tb);
    }
    first_crossing(&b, lo).map(|t| to / t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_line_is_recovered() {
        let pts: Vec<(f64, f64)> = [1e6, 3e6, 1e7].iter().map(|&n: &f64| (n, 4.0 - 0.25 * n.ln())).collect();
        let (a, b) = fit_log_linear(&pts).unwrap();
        assert!((a - 4.0).abs() < 1e-9 && (b + 0.25).abs() < 1e-12, "{a} {b}");
    }

    #[test]
    fn crossing_interpolates() {
        let c = [(1.0, 3.0), (3.0, 1.0)];
        assert!((first_crossing(&c, 2.0).unwrap() - 2.0).abs() < 1e-12);
        assert_eq!(first_crossing(&c, 3.5), Some(1.0));
        assert_eq!(first_crossing(&c, 0.5), None);
    }
}
