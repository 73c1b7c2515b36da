//! The report plots: compact counts and PNGs for normal, single-point and empty/NaN data.

use difftx_experiments::plot::{
    draw_bands, draw_loss_panels, draw_param_efficiency, fmt_count, Band, BandPoint, EfficiencySeries,
};
use std::path::Path;

#[test]
fn fmt_count_table() {
    let table: &[(f64, &str)] = &[
        (0.0, "0"),
        (950.0, "950"),
        (1000.0, "1k"),
        (12_345.0, "12k"),
        (12_500.0, "12.5k"),
        (200_000.0, "200k"),
        (1_250_000.0, "1.25M"),
        (1_500_000.0, "1.5M"),
        (2_000_000.0, "2M"),
        (3.2e9, "3.2B"),
        (999_999.0, "1M"),
        (-1_500.0, "-1.5k"),
        (0.5, "0.5"),
        (7.0, "7"),
    ];
    for &(x, want) in table {
        assert_eq!(fmt_count(x), want, "fmt_count({x})");
    }
    assert_eq!(fmt_count(f64::NAN), "NaN");
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.len() > 1000, "{} is only {} bytes", path.display(), bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
}

fn curve(label: &str, end: f64, seed: f64, n: usize) -> Band {
    let points = (0..n)
        .map(|i| {
            let x = i as f64 * 2_048.0 * 16.0;
            let mid = end + 4.3 * (-(i as f64) / 40.0).exp() + 0.03 * (seed * i as f64).sin();
            let w = 0.02 + 0.2 * (-(i as f64) / 30.0).exp();
            BandPoint { x, mid, lo: mid - w, hi: mid + w }
        })
        .collect();
    Band { label: label.into(), points }
}

fn delta(a: &Band, base: &Band) -> Band {
    let points = a
        .points
        .iter()
        .zip(&base.points)
        .map(|(p, q)| {
            let d = p.mid - q.mid;
            let w = 0.5 * ((p.hi - p.lo) + (q.hi - q.lo)) / 2.0;
            BandPoint { x: p.x, mid: d, lo: d - w, hi: d + w }
        })
        .collect();
    Band { label: format!("{} − baseline", a.label), points }
}

fn families(n: usize) -> (Vec<Band>, Vec<Band>) {
    let loss = vec![curve("baseline", 1.25, 0.3, n), curve("diff-v1", 1.28, 0.7, n), curve("diff-v2", 1.21, 1.1, n)];
    let d = loss[1..].iter().map(|b| delta(b, &loss[0])).collect();
    (loss, d)
}

fn nan_band() -> Band {
    let nan = f64::NAN;
    Band { label: "nan".into(), points: vec![BandPoint { x: nan, mid: nan, lo: nan, hi: nan }; 3] }
}

#[test]
fn bands_normal_single_and_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (loss, d) = families(60);
    let p = dir.path().join("bands.png");
    draw_bands(&p, "loss vs tokens", "tokens", "loss (nats)", &loss, false).unwrap();
    assert_png(&p);
    let p = dir.path().join("delta.png");
    draw_bands(&p, "difference", "tokens", "Δ loss", &d, true).unwrap();
    assert_png(&p);
    let one = Band { label: "one".into(), points: vec![BandPoint { x: 200_000.0, mid: 1.3, lo: 1.2, hi: 1.4 }] };
    let p = dir.path().join("one.png");
    draw_bands(&p, "single point", "tokens", "loss", &[one], true).unwrap();
    assert_png(&p);
    for (name, s) in [("empty.png", vec![]), ("nan.png", vec![nan_band()]), ("nopts.png", vec![Band::default()])] {
        let p = dir.path().join(name);
        draw_bands(&p, "nothing", "tokens", "loss", &s, true).unwrap();
        assert_png(&p);
    }
}

#[test]
fn loss_panels_normal_single_and_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (loss, d) = families(60);
    let p = dir.path().join("panels.png");
    draw_loss_panels(&p, "loss and difference to baseline", &loss, &d).unwrap();
    assert_png(&p);
    let (l1, d1) = families(1);
    let p = dir.path().join("one.png");
    draw_loss_panels(&p, "single point", &l1, &d1).unwrap();
    assert_png(&p);
    let p = dir.path().join("empty.png");
    draw_loss_panels(&p, "nothing", &[], &[]).unwrap();
    assert_png(&p);
    let p = dir.path().join("nan.png");
    draw_loss_panels(&p, "nan", &[nan_band()], &[nan_band()]).unwrap();
    assert_png(&p);
    let p = dir.path().join("half.png");
    draw_loss_panels(&p, "no deltas", &loss, &[]).unwrap();
    assert_png(&p);
}

fn eff(label: &str, a: f64, b: f64, params: &[f64]) -> EfficiencySeries {
    let points = params
        .iter()
        .map(|&n| {
            let m = a + b * n.ln();
            (n, m, m - 0.02, m + 0.03)
        })
        .collect();
    EfficiencySeries { label: label.into(), points, fit: Some((a, b)) }
}

#[test]
fn param_efficiency_normal_single_and_empty() {
    let dir = tempfile::tempdir().unwrap();
    let params = [2.0e6, 5.0e6, 1.2e7, 3.0e7];
    let mut s = vec![eff("baseline", 3.2, -0.12, &params), eff("diff-v1", 3.1, -0.12, &params)];
    let mut nofit = eff("diff-v2", 3.05, -0.12, &params);
    nofit.fit = None;
    s.push(nofit);
    let p = dir.path().join("eff.png");
    draw_param_efficiency(&p, "parameter efficiency", &s).unwrap();
    assert_png(&p);
    let p = dir.path().join("one.png");
    draw_param_efficiency(&p, "single", &[eff("baseline", 3.2, -0.12, &[1.0e6])]).unwrap();
    assert_png(&p);
    let nan = EfficiencySeries {
        label: "nan".into(),
        points: vec![(f64::NAN, 1.0, 0.9, 1.1), (0.0, 1.0, 0.9, 1.1), (1e6, f64::NAN, f64::NAN, f64::NAN)],
        fit: Some((f64::NAN, 1.0)),
    };
    for (name, s) in [("empty.png", vec![]), ("nan.png", vec![nan])] {
        let p = dir.path().join(name);
        draw_param_efficiency(&p, "nothing", &s).unwrap();
        assert_png(&p);
    }
}

#[test]
fn output_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let (loss, d) = families(40);
    let (a, b) = (dir.path().join("a.png"), dir.path().join("b.png"));
    draw_loss_panels(&a, "t", &loss, &d).unwrap();
    draw_loss_panels(&b, "t", &loss, &d).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn unwritable_path_is_a_one_line_error_naming_the_file() {
    let p = Path::new("/nonexistent-dir-difftx/x.png");
    let (loss, d) = families(5);
    let e = draw_loss_panels(p, "t", &loss, &d).unwrap_err().to_string();
    assert!(e.contains("/nonexistent-dir-difftx/x.png") && !e.contains('\n'), "{e}");
}

/// Renders one example of each plot to $DIFFTX_PLOT_DIR (for looking at them); skipped when unset.
#[test]
fn render_examples() {
    let Some(dir) = std::env::var_os("DIFFTX_PLOT_DIR") else { return };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    let (loss, d) = families(57);
    draw_bands(&dir.join("bands.png"), "loss vs tokens", "tokens", "loss (nats)", &loss, false).unwrap();
    draw_loss_panels(&dir.join("panels.png"), "loss vs tokens (mean, band: 95% CI over 3 seeds)", &loss, &d).unwrap();
    let params = [2.0e6, 5.0e6, 1.2e7, 3.0e7];
    let mut s = vec![eff("baseline", 3.2, -0.12, &params), eff("diff-v1", 3.1, -0.12, &params)];
    let mut nofit = eff("diff-v2", 3.05, -0.12, &params);
    nofit.fit = None;
    s.push(nofit);
    draw_param_efficiency(&dir.join("eff.png"), "parameter efficiency", &s).unwrap();
    draw_loss_panels(&dir.join("empty.png"), "nothing", &[], &[]).unwrap();
    let (l1, d1) = families(1);
    draw_loss_panels(&dir.join("panels1.png"), "one point", &l1, &d1).unwrap();
    draw_param_efficiency(&dir.join("eff1.png"), "one point", &[eff("baseline", 3.2, -0.12, &[1.0e6])]).unwrap();
}
