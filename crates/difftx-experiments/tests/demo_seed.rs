//! Seed demo against numbers printed by the article's own numpy code (fixture made by
//! scripts/seed_demo_fixture.py).

use difftx_experiments::seed_demo::{format_report, read_qkv_npz, run_demo, DemoOptions, NumpyRandomState};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/demo")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap()).unwrap()
}

fn lines(v: &serde_json::Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

#[test]
fn randomstate_matches_numpy_randn() {
    let exp = expected();
    for (seed, draws) in exp["randn"].as_object().unwrap() {
        let mut rs = NumpyRandomState::new(seed.parse().unwrap());
        for (i, want) in draws.as_array().unwrap().iter().enumerate() {
            let got = rs.gauss();
            let want = want.as_f64().unwrap();
            assert!((got - want).abs() <= 1e-15 * want.abs().max(1.0), "seed {seed} draw {i}: {got} vs {want}");
        }
    }
}

#[test]
fn synthetic_setup_prints_what_numpy_prints() {
    let report = run_demo(&DemoOptions::default(), None).unwrap();
    let got: Vec<String> = format_report(&report).lines().map(String::from).collect();
    assert_eq!(got, lines(&expected()["synthetic_output"]));
}

#[test]
fn npz_prints_what_numpy_prints_and_writes_outputs() {
    let out = tempfile::tempdir().unwrap();
    let opts = DemoOptions { npz: Some(fixture_dir().join("qkv_small.npz")), ..Default::default() };
    let report = run_demo(&opts, Some(out.path())).unwrap();
    assert_eq!(report.shape, [2, 3, 64, 8]);
    let got: Vec<String> = format_report(&report).lines().map(String::from).collect();
    assert_eq!(got, lines(&expected()["npz_output"]));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("demo.json")).unwrap()).unwrap();
    assert!((json["std_snr"].as_f64().unwrap() - report.std_snr).abs() < 1e-12);
    assert!(std::fs::metadata(out.path().join("demo.png")).unwrap().len() > 1000);
}

fn write_npz(path: &std::path::Path, arrays: &[(&str, candle_core::Tensor)]) {
    let refs: Vec<(&str, &candle_core::Tensor)> = arrays.iter().map(|(n, t)| (*n, t)).collect();
    candle_core::Tensor::write_npz(&refs, path).unwrap();
}

#[test]
#[allow(clippy::type_complexity)]
fn bad_npz_gives_clear_errors() {
    use candle_core::{DType, Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let ok = Tensor::zeros((1, 2, 64, 8), DType::F64, &dev).unwrap();
    let cases: Vec<(&str, Vec<(&str, Tensor)>, &str)> = vec![
        ("missing", vec![("Q", ok.clone()), ("V", ok.clone())], "no array 'K'"),
        (
            "dtype",
            vec![("Q", ok.clone()), ("K", ok.to_dtype(DType::F32).unwrap()), ("V", ok.clone())],
            "expected float64",
        ),
        ("rank", vec![("Q", ok.reshape((2, 64, 8)).unwrap()), ("K", ok.clone()), ("V", ok.clone())], "expected rank 4"),
        (
            "shape",
            vec![("Q", ok.clone()), ("K", ok.clone()), ("V", Tensor::zeros((1, 2, 64, 4), DType::F64, &dev).unwrap())],
            "same shape",
        ),
    ];
    for (name, arrays, want) in cases {
        let p = dir.path().join(format!("{name}.npz"));
        write_npz(&p, &arrays);
        let err = read_qkv_npz(&p).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
        assert!(!err.contains('\n'), "{name}: not one line: {err}");
    }
    // Too short for the article's query position 60.
    let short = Tensor::zeros((1, 1, 32, 8), DType::F64, &dev).unwrap();
    let p = dir.path().join("short.npz");
    write_npz(&p, &[("Q", short.clone()), ("K", short.clone()), ("V", short)]);
    let err = run_demo(&DemoOptions { npz: Some(p), ..Default::default() }, None).unwrap_err().to_string();
    assert!(err.contains("below N = 32"), "{err}");
    // Not a file / not an npz.
    let err = run_demo(&DemoOptions { npz: Some(dir.path().join("nope.npz")), ..Default::default() }, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
    let junk = dir.path().join("junk.npz");
    std::fs::write(&junk, b"not a zip").unwrap();
    let err = read_qkv_npz(&junk).unwrap_err().to_string();
    assert!(err.contains("cannot read"), "{err}");
}
