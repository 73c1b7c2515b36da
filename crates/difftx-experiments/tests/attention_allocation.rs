use candle_core::{DType, Device, Tensor};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_experiments::attention::*;
use std::path::Path;

fn tiny_model(dir: &Path, family: Family) {
    let cfg = ModelConfig::preset("tiny", family).unwrap();
    let w = difftx_core::model::init_weights(&cfg, 2, DType::F32, &Device::Cpu).unwrap();
    difftx_core::checkpoint::save_model(dir, &cfg, &w).unwrap();
    Tokenizer::bytes().save_to_model_dir(dir).unwrap();
}

/// 2 heads, T = S = 6. Query row 5: head 0 puts 0.5 on keys 1..3 (the answer), 0.25 on key 0,
/// 0.25 on key 5 (outside the context 0..4); head 1 is uniform over the 6 keys.
fn hand_map() -> Tensor {
    let mut v = vec![0f32; 2 * 6 * 6];
    let row0 = [0.25, 0.3, 0.2, 0.0, 0.0, 0.25];
    let row1 = [1.0 / 6.0; 6];
    for j in 0..6 {
        v[5 * 6 + j] = row0[j];
        v[36 + 5 * 6 + j] = row1[j];
    }
    Tensor::from_vec(v, (2, 6, 6), &Device::Cpu).unwrap()
}

#[test]
fn hand_built_map_has_the_known_masses() {
    let m = span_mass(&hand_map(), 5, 1..3, 0..4).unwrap();
    // answer: head0 0.5, head1 2/6 -> mean (0.5 + 1/3) / 2
    assert!((m.answer - (0.5 + 1.0 / 3.0) / 2.0).abs() < 1e-6, "{m:?}");
    // noise: context 0..4 minus 1..3 = keys 0, 3: head0 0.25, head1 2/6
    assert!((m.noise - (0.25 + 1.0 / 3.0) / 2.0).abs() < 1e-6, "{m:?}");
    // batched form and layer averaging
    let b = hand_map().unsqueeze(0).unwrap();
    let z = Tensor::zeros((1, 2, 6, 6), DType::F32, &Device::Cpu).unwrap();
    let avg = allocation(&[b, z], 5, 1..3, 0..4).unwrap();
    assert!((avg.answer - m.answer / 2.0).abs() < 1e-6);
    assert!((avg.noise - m.noise / 2.0).abs() < 1e-6);
    // negative weights (diff maps) are summed as they are
    let neg = (hand_map() * -1.0).unwrap();
    assert!((span_mass(&neg, 5, 1..3, 0..4).unwrap().answer + m.answer).abs() < 1e-6);
}

#[test]
fn bad_spans_are_errors() {
    assert!(span_mass(&hand_map(), 6, 1..3, 0..4).is_err());
    assert!(span_mass(&hand_map(), 5, 1..9, 0..4).is_err());
    assert!(allocation(&[], 5, 1..3, 0..4).is_err());
    let z = Tensor::zeros((2, 2, 6, 6), DType::F32, &Device::Cpu).unwrap();
    assert!(span_mass(&z, 5, 1..3, 0..4).is_err());
}

#[test]
fn runs_on_every_family_and_masses_are_sane() {
    for family in Family::ALL {
        let dir = tempfile::tempdir().unwrap();
        tiny_model(dir.path(), family);
        let out = dir.path().join("out");
        let opts = AttentionOptions { depths: vec![0.0, 50.0, 100.0], trials: 1, ..Default::default() };
        let v = run_attention(dir.path(), &opts, &out).unwrap();
        for f in ["attention.json", "attention.png", "attention_head.png"] {
            assert!(out.join(f).metadata().unwrap().len() > 500, "{f}");
        }
        for d in v["depths"].as_array().unwrap() {
            let a = d["answer_mass"].as_f64().unwrap();
            let n = d["noise_mass"].as_f64().unwrap();
            if family == Family::Baseline {
                // softmax rows: masses are probabilities summing to at most 1
                assert!(a > 0.0 && n > 0.0 && a + n <= 1.0 + 1e-5, "{a} {n}");
                // an untrained model spreads attention: 2 answer tokens get far less than ~100 noise tokens
                assert!(a < n, "{a} {n}");
            } else {
                assert!(a.is_finite() && n.is_finite() && a.abs() <= 2.0 && n.abs() <= 2.0);
            }
        }
    }
}

#[test]
fn bad_options_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV2);
    let out = dir.path().join("o");
    let e = run_attention(dir.path(), &AttentionOptions { heatmap_head: 99, ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("head 99"), "{e}");
    let e = run_attention(dir.path(), &AttentionOptions { needles: 8, ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let e = run_attention(dir.path(), &AttentionOptions { depths: vec![150.0], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("150"), "{e}");
}

#[test]
fn share_is_reported_and_consistent() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::Baseline);
    let v = run_attention(dir.path(), &AttentionOptions { depths: vec![50.0], trials: 1, ..Default::default() }, &dir.path().join("o")).unwrap();
    let d = &v["depths"][0];
    let (a, n, s) = (d["answer_mass"].as_f64().unwrap(), d["noise_mass"].as_f64().unwrap(), d["answer_share"].as_f64().unwrap());
    // one trial: the share is exactly answer / (answer + noise)
    assert!((s - a / (a + n)).abs() < 1e-12);
    assert_eq!(v["mean_answer_share"].as_f64().unwrap(), s);
}
