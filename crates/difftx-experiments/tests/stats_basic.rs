use difftx_experiments::stats::*;

#[test]
fn mean_std_ci_match_hand_computation() {
    let xs = [1.0, 2.0, 3.0, 4.0];
    assert!((mean(&xs) - 2.5).abs() < 1e-12);
    // sum of squares about the mean = 5, / 3
    assert!((sample_std(&xs) - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
    let s = summarize(&xs);
    let h = 3.182 * (5.0f64 / 3.0).sqrt() / 2.0;
    let (lo, hi) = s.ci95.unwrap();
    assert!((lo - (2.5 - h)).abs() < 1e-9 && (hi - (2.5 + h)).abs() < 1e-9);
    assert_eq!(s.n, 4);
    assert!(summarize(&[1.0]).ci95.is_none());
    assert!(mean(&[]).is_nan());
    assert!(sample_std(&[3.0]).is_nan());
}

#[test]
fn t_table_values() {
    assert!((t_critical_95(1) - 12.706).abs() < 1e-9);
    assert!((t_critical_95(2) - 4.303).abs() < 1e-9);
    assert!((t_critical_95(30) - 2.042).abs() < 1e-9);
    assert!((t_critical_95(10_000) - 1.96).abs() < 1e-9);
    assert!(t_critical_95(0).is_nan());
    // decreasing in df
    for df in 1..200 {
        assert!(t_critical_95(df + 1) <= t_critical_95(df));
    }
}

#[test]
fn verdicts_follow_the_ci() {
    let up = summarize(&[0.5, 0.6, 0.55]);
    let down = summarize(&[-0.5, -0.6, -0.55]);
    let zero = summarize(&[-0.5, 0.6, 0.1]);
    assert_eq!(verdict(&up, Direction::Higher), Verdict::Reproduced);
    assert_eq!(verdict(&up, Direction::Lower), Verdict::NotReproduced);
    assert_eq!(verdict(&down, Direction::Lower), Verdict::Reproduced);
    assert_eq!(verdict(&down, Direction::Higher), Verdict::NotReproduced);
    assert_eq!(verdict(&zero, Direction::Higher), Verdict::Inconclusive);
    assert_eq!(verdict(&summarize(&[1.0]), Direction::Higher), Verdict::Inconclusive);
    assert_eq!(paired_differences(&[3.0, f64::NAN, 5.0], &[1.0, 2.0, 1.0]), vec![2.0, 4.0]);
    assert_eq!(up.display(2).split(" ± ").count(), 2);
}
