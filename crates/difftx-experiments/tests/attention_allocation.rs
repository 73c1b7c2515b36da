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
    let e =
        run_attention(dir.path(), &AttentionOptions { needles: 8, context_len: Some(12), ..Default::default() }, &out)
            .unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let e =
        run_attention(dir.path(), &AttentionOptions { depths: vec![150.0], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("150"), "{e}");
}

#[test]
fn allocations_are_reported_and_consistent() {
    for family in [Family::Baseline, Family::DiffV1] {
        let dir = tempfile::tempdir().unwrap();
        tiny_model(dir.path(), family);
        let opts = AttentionOptions { depths: vec![25.0, 75.0], trials: 2, sink_windows: 2, ..Default::default() };
        let v = run_attention(dir.path(), &opts, &dir.path().join("o")).unwrap();
        assert!(v.get("mean_answer_share").is_none());
        assert!(v["definitions"].as_str().unwrap().contains("by construction"));
        let mut aas = Vec::new();
        for d in v["depths"].as_array().unwrap() {
            let (a, n) = (d["answer_alloc"].as_f64().unwrap(), d["noise_alloc"].as_f64().unwrap());
            assert!((-1.0..=1.0).contains(&a) && (0.0..=1.0).contains(&n), "{a} {n}");
            if family == Family::Baseline {
                // softmax rows: the two shares of the context's attention sum to 1
                assert!((a + n - 1.0).abs() < 1e-5, "{a} {n}");
            }
            assert!(d["answer_mass"].as_f64().unwrap().is_finite());
            aas.push(a);
        }
        let mean = v["mean_answer_alloc"].as_f64().unwrap();
        assert!((mean - (aas[0] + aas[1]) / 2.0).abs() < 1e-12);
        assert!(v["mean_noise_alloc"].as_f64().unwrap().is_finite());
        // the best head beats (or equals) the mean over heads
        let b = &v["best_head"];
        assert!(b["answer_alloc"].as_f64().unwrap() >= mean - 1e-12, "{b}");
        assert!(b["layer"].as_u64().is_some() && b["head"].as_u64().is_some());
        let s = &v["sink"];
        assert_eq!(s["windows"].as_u64().unwrap(), 2);
        for k in ["first_token_share", "punct_share", "punct_fraction", "first_token_uniform"] {
            let x = s[k].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{k} = {x}");
        }
        assert!(s["punct_fraction"].as_f64().unwrap() > 0.0);
    }
    // sink_windows = 0 skips the sink measure
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV2);
    let opts = AttentionOptions { depths: vec![50.0], trials: 1, sink_windows: 0, ..Default::default() };
    let v = run_attention(dir.path(), &opts, &dir.path().join("o")).unwrap();
    assert!(v["sink"].is_null());
}

fn rows_map(heads: &[Vec<Vec<f32>>]) -> Tensor {
    let (h, t, s) = (heads.len(), heads[0].len(), heads[0][0].len());
    let v: Vec<f32> = heads.iter().flatten().flatten().copied().collect();
    Tensor::from_vec(v, (h, t, s), &Device::Cpu).unwrap()
}

#[test]
fn row_allocation_known_values() {
    // softmax-like row: context 0..4, answer 1..2; key 4 is outside the context
    let r = row_allocation(&[0.1, 0.4, 0.2, 0.1, 0.2], 1..2, 0..4).unwrap();
    assert!((r.answer - 0.4 / 0.8).abs() < 1e-12 && (r.noise - 0.4 / 0.8).abs() < 1e-12, "{r:?}");
    let r = row_allocation(&[0.1, 0.4, 0.2, 0.3], 1..3, 0..4).unwrap();
    assert!(
        (r.answer - 0.6).abs() < 1e-12 && (r.noise - 0.4).abs() < 1e-12 && (r.answer + r.noise - 1.0).abs() < 1e-12
    );
    // signed row (diff map): negative answer weights count as negative, noise by magnitude
    let r = row_allocation(&[0.2, 0.5, -0.1, -0.05, 0.7], 1..3, 0..4).unwrap();
    assert!((r.answer - 0.4 / 0.85).abs() < 1e-12, "{r:?}");
    assert!((r.noise - 0.25 / 0.85).abs() < 1e-12, "{r:?}");
    let r = row_allocation(&[0.1, -0.3, 0.0], 1..2, 0..3).unwrap();
    assert!((r.answer + 0.75).abs() < 1e-12 && (r.noise - 0.25).abs() < 1e-12);
    // zero mass over the context: undefined
    assert!(row_allocation(&[0.0, 0.0, 0.0, 1.0], 1..2, 0..3).is_none());
    assert!(row_allocation(&[f64::NAN, 0.1], 1..2, 0..2).is_none());
}

#[test]
fn head_allocations_skip_zero_rows_and_pick_the_best_head() {
    // 2 heads, T = S = 3, query row 2, answer 1..2, context 0..2
    let m = rows_map(&[
        vec![vec![1.0, 0.0, 0.0], vec![0.5, 0.5, 0.0], vec![0.25, 0.75, 0.0]],
        vec![vec![1.0, 0.0, 0.0], vec![0.5, 0.5, 0.0], vec![0.0, 0.0, 1.0]],
    ]);
    let h = head_allocations(&m, 2, 1..2, 0..2).unwrap();
    assert!((h[0].answer - 0.75).abs() < 1e-6 && (h[0].noise - 0.25).abs() < 1e-6);
    assert!(h[1].answer.is_nan() && h[1].noise.is_nan());
    let grid = layer_head_allocations(&[m.clone(), m.unsqueeze(0).unwrap()], 2, 1..2, 0..2).unwrap();
    assert_eq!((grid.len(), grid[0].len()), (2, 2));
    let mean = mean_allocation(&grid);
    assert!((mean.answer - 0.75).abs() < 1e-6 && (mean.noise - 0.25).abs() < 1e-6, "{mean:?}");
    assert!(head_allocations(&m, 3, 1..2, 0..2).is_err());
    assert!(layer_head_allocations(&[], 2, 1..2, 0..2).is_err());

    // best head: averaged over prompts, NaN skipped
    let a = |x: f64| SpanAlloc { answer: x, noise: 1.0 - x };
    let p1 = vec![vec![a(0.1), a(0.5)], vec![a(0.3), SpanAlloc::NAN]];
    let p2 = vec![vec![a(0.1), a(0.1)], vec![a(0.5), a(0.9)]];
    // means: (0,0) 0.1, (0,1) 0.3, (1,0) 0.4, (1,1) 0.9 (one prompt only)
    let b = best_head(&[p1.clone(), p2]).unwrap();
    assert_eq!((b.layer, b.head), (1, 1));
    assert!((b.answer_alloc - 0.9).abs() < 1e-12);
    let b = best_head(&[p1]).unwrap();
    assert_eq!((b.layer, b.head), (0, 1));
    assert!(best_head(&[]).is_none());
    assert!(best_head(&[vec![vec![SpanAlloc::NAN]]]).is_none());
}
