use difftx_experiments::efficiency::*;

fn law(n: f64) -> f64 {
    3.0 - 0.2 * n.ln()
}

#[test]
fn log_linear_fit_recovers_the_law() {
    let pts: Vec<(f64, f64)> = [1e6, 2e6, 4e6, 8e6, 8e6].iter().map(|&n| (n, law(n))).collect();
    let (a, b) = fit_log_linear(&pts).unwrap();
    assert!((a - 3.0).abs() < 1e-9 && (b + 0.2).abs() < 1e-12, "{a} {b}");
    // least squares through noisy points: symmetric noise around the law at two sizes
    let noisy = [(1e6, law(1e6) + 0.1), (1e6, law(1e6) - 0.1), (1e7, law(1e7) + 0.05), (1e7, law(1e7) - 0.05)];
    let (a, b) = fit_log_linear(&noisy).unwrap();
    assert!((a - 3.0).abs() < 1e-9 && (b + 0.2).abs() < 1e-12, "{a} {b}");
}

#[test]
fn fit_errors() {
    assert!(fit_log_linear(&[]).is_err());
    let e = fit_log_linear(&[(1e6, 2.0), (1e6, 2.1)]).unwrap_err();
    assert!(e.to_string().contains("2 distinct"), "{e}");
    assert!(fit_log_linear(&[(0.0, 2.0), (1e6, 2.1)]).is_err());
    assert!(fit_log_linear(&[(1e5, f64::NAN), (1e6, 2.1)]).is_err());
}

#[test]
fn param_ratio_recovers_a_known_ratio() {
    let base: Vec<(f64, f64)> = [1e6, 2e6, 4e6, 8e6].iter().map(|&n| (n, law(n))).collect();
    for ratio in [0.65, 1.0, 1.3] {
        // the other family at size N has the baseline's loss at N / ratio
        let other: Vec<(f64, f64)> = [1.5e6, 3e6, 6e6].iter().map(|&n| (n, law(n / ratio))).collect();
        let r = param_ratio(&base, &other).unwrap();
        assert!((r - ratio).abs() < 1e-6, "{r} vs {ratio}");
    }
    // geometric mean of per-point ratios: 0.5 and 2.0 -> 1.0
    let other = [(1e6, law(1e6 / 0.5)), (4e6, law(4e6 / 2.0))];
    assert!((param_ratio(&base, &other).unwrap() - 1.0).abs() < 1e-9);
}

#[test]
fn param_ratio_errors() {
    let base: Vec<(f64, f64)> = [1e6, 2e6].iter().map(|&n| (n, law(n))).collect();
    assert!(param_ratio(&base, &[]).is_err());
    assert!(param_ratio(&[(1e6, 2.0)], &base).is_err());
    // loss rising with size: no meaningful inversion
    let rising = [(1e6, 2.0), (2e6, 2.5)];
    let e = param_ratio(&rising, &base).unwrap_err();
    assert!(e.to_string().contains("slope"), "{e}");
    let flat = [(1e6, 2.0), (2e6, 2.0)];
    assert!(param_ratio(&flat, &base).is_err());
    assert!(param_ratio(&base, &[(-1.0, 2.0)]).is_err());
}

/// A falling curve of loss against tokens: loss = 4 − 0.25·ln(t) at t = step·k.
fn curve(scale: f64, tokens: &[f64]) -> Vec<(f64, f64)> {
    tokens.iter().map(|&t| (t, 4.0 - 0.25 * (t / scale).ln())).collect()
}

#[test]
fn token_ratio_at_a_known_crossing() {
    let ts: Vec<f64> = (1..=10).map(|k| k as f64 * 1e6).collect();
    let base = curve(1.0, &ts);
    // piecewise-linear other curve crossing the baseline's final loss between its points 5 and 6
    let lb = base.last().unwrap().1;
    let other = vec![(1e6, lb + 1.0), (5e6, lb + 0.2), (6e6, lb - 0.2), (10e6, lb - 0.5)];
    let r = token_ratio(&base, &other).unwrap();
    assert!((r - 5.5e6 / 10e6).abs() < 1e-9, "{r}");
    // the same law needing 65% of the tokens, sampled densely enough to hit the crossing exactly
    let dense: Vec<f64> = (1..=1000).map(|k| k as f64 * 1e4).collect();
    let other = curve(0.65, &dense);
    let r = token_ratio(&base, &other).unwrap();
    assert!((r - 0.65).abs() < 1e-6, "{r}");
    // unsorted input is sorted first
    let mut shuffled = other.clone();
    shuffled.reverse();
    assert!((token_ratio(&base, &shuffled).unwrap() - r).abs() < 1e-12);
}

#[test]
fn token_ratio_when_the_other_never_catches_up() {
    let ts: Vec<f64> = (1..=10).map(|k| k as f64 * 1e6).collect();
    let base = curve(1.0, &ts);
    // the other family is the same law needing twice the tokens: it ends at the baseline's loss at
    // 5e6 tokens, so the ratio is 10e6 / 5e6 = 2 (> 1: needs more tokens)
    let other = curve(2.0, &ts);
    let r = token_ratio(&base, &other).unwrap();
    assert!((r - 2.0).abs() < 1e-9, "{r}");
    // the other ends worse than the baseline's first point: the baseline "reaches" it at its first
    // point (1e6 tokens), so the ratio 2e6 / 1e6 is only a lower bound
    let bad = vec![(1e6, 10.0), (2e6, 9.0)];
    assert!((token_ratio(&base, &bad).unwrap() - 2.0).abs() < 1e-12);
    // no usable points: None
    assert_eq!(token_ratio(&base, &[(f64::NAN, 1.0), (0.0, 2.0)]), None);
    assert_eq!(token_ratio(&[], &base), None);
    assert_eq!(token_ratio(&base, &[]), None);
    // identical curves: ratio 1
    assert!((token_ratio(&base, &base).unwrap() - 1.0).abs() < 1e-12);
}
