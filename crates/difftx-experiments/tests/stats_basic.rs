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

#[test]
fn t80_table_values() {
    assert!((t_quantile_80(1) - 1.376).abs() < 1e-9);
    assert!((t_quantile_80(2) - 1.061).abs() < 1e-9);
    assert!((t_quantile_80(30) - 0.854).abs() < 1e-9);
    assert!((t_quantile_80(10_000) - 0.842).abs() < 1e-9);
    assert!(t_quantile_80(0).is_nan());
    for df in 1..200 {
        assert!(t_quantile_80(df + 1) <= t_quantile_80(df));
        assert!(t_quantile_80(df) < t_critical_95(df));
    }
}

#[test]
fn min_detectable_effect_known_values() {
    // n = 3 (df 2), differences 1, 2, 3: s = 1
    let s = summarize(&[1.0, 2.0, 3.0]);
    let mde = min_detectable_effect(&s).unwrap();
    assert!((mde - (4.303 + 1.061) / 3f64.sqrt()).abs() < 1e-9, "{mde}");
    // n = 5 (df 4): s = sqrt(2.5)
    let s = summarize(&[0.0, 1.0, 2.0, 3.0, 4.0]);
    let want = (2.776 + 0.941) * 2.5f64.sqrt() / 5f64.sqrt();
    assert!((min_detectable_effect(&s).unwrap() - want).abs() < 1e-9);
    // more seeds with the same spread detect smaller effects
    let many: Vec<f64> = (0..20).map(|i| (i % 5) as f64).collect();
    assert!(min_detectable_effect(&summarize(&many)).unwrap() < want);
    assert_eq!(min_detectable_effect(&summarize(&[2.0, 2.0])), Some(0.0));
    assert_eq!(min_detectable_effect(&summarize(&[1.0])), None);
    assert_eq!(min_detectable_effect(&summarize(&[])), None);
}

#[test]
fn accuracy_guard_floor_ceiling_undefined() {
    // chance 0: floor at 0.10
    assert!(accuracy_guard(0.05, 0.0).unwrap().starts_with("floor"));
    assert_eq!(accuracy_guard(0.10, 0.0), None);
    assert_eq!(accuracy_guard(0.5, 0.0), None);
    // chance 0.5: floor at 0.55
    assert!(accuracy_guard(0.54, 0.5).unwrap().starts_with("floor"));
    assert_eq!(accuracy_guard(0.56, 0.5), None);
    assert!(accuracy_guard(0.95, 0.5).unwrap().starts_with("ceiling"));
    assert_eq!(accuracy_guard(0.90, 0.5), None);
    assert!(accuracy_guard(f64::NAN, 0.5).unwrap().starts_with("undefined"));
    assert!(accuracy_guard(0.5, f64::INFINITY).unwrap().starts_with("undefined"));
    let up = summarize(&[0.5, 0.6, 0.55]);
    assert_eq!(guarded_verdict(&up, Direction::Higher, None), Verdict::Reproduced);
    let g = accuracy_guard(0.99, 0.0);
    assert_eq!(guarded_verdict(&up, Direction::Higher, g.as_deref()), Verdict::Uninformative);
    assert_eq!(Verdict::Uninformative.as_str(), "uninformative");
    assert_eq!(serde_json::to_string(&Verdict::Uninformative).unwrap(), "\"uninformative\"");
}
