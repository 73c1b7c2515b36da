//! Outlier statistics: exact on a known tensor, histogram mode within its bound, and the
//! instrument end to end on a tiny random model.

use candle_core::{DType, Device, Tensor};
use difftx_core::config::{Family, ModelConfig};
use difftx_experiments::outliers::{outlier_stats, run_outliers, Accumulator, OutliersOptions};
use std::path::Path;

#[test]
fn known_tensor_exact_topk_and_median() {
    // |values| are 1..=200 shuffled, with signs: k-th largest is 201 - k, median (even) 100.5.
    let mut vals: Vec<f32> = (1..=200).map(|i| if i % 3 == 0 { -(i as f32) } else { i as f32 }).collect();
    vals.reverse();
    vals.swap(3, 150);
    let s = outlier_stats(&vals).unwrap();
    assert_eq!(s.count, 200);
    assert_eq!(
        (s.top1, s.top2, s.top3, s.top10, s.top100),
        (Some(200.0), Some(199.0), Some(198.0), Some(191.0), Some(101.0))
    );
    assert_eq!(s.median, Some(100.5));
    assert!(s.median_exact);
    assert_eq!(s.top1_over_median, Some(200.0 / 100.5));
    // Odd count, fewer than 100 values: top100 missing.
    let s = outlier_stats(&[-5.0, 1.0, 3.0, -2.0, 4.0]).unwrap();
    assert_eq!((s.top1, s.top3, s.top10, s.median), (Some(5.0), Some(3.0), None, Some(3.0)));
    assert!(outlier_stats(&[1.0, f32::NAN]).is_err());
}

#[test]
fn histogram_median_within_bound_and_merge_is_consistent() {
    let vals: Vec<f32> = (0..20_001).map(|i| ((i as f32) * 0.37).sin().abs() * 10.0 + (i % 7) as f32).collect();
    let exact = outlier_stats(&vals).unwrap();
    let mut acc = Accumulator::new(1000); // forces the histogram
    acc.add(vals.iter().copied()).unwrap();
    let approx = acc.stats();
    assert!(!approx.median_exact);
    assert_eq!(approx.top1, exact.top1);
    assert_eq!(approx.top100, exact.top100);
    let (m, e) = (approx.median.unwrap(), exact.median.unwrap());
    assert!((m - e).abs() <= e * 2f64.powi(-7), "{m} vs {e}");
    // Merging two halves (one exact, one histogram) equals the whole.
    let mut a = Accumulator::new(usize::MAX);
    a.add(vals[..5000].iter().copied()).unwrap();
    let mut b = Accumulator::new(1000);
    b.add(vals[5000..].iter().copied()).unwrap();
    let mut all = Accumulator::new(usize::MAX);
    all.merge(&a).unwrap();
    all.merge(&b).unwrap();
    let merged = all.stats();
    assert_eq!(merged.count, exact.count);
    assert_eq!(
        (merged.top1, merged.top2, merged.top10, merged.top100),
        (exact.top1, exact.top2, exact.top10, exact.top100)
    );
    assert!((merged.median.unwrap() - e).abs() <= e * 2f64.powi(-7));
}

fn tiny_model(dir: &Path, family: Family, seed: u64) -> ModelConfig {
    let mut cfg = ModelConfig::preset("tiny", family).unwrap();
    cfg.d_model = 32;
    cfg.n_layers = 2;
    cfg.n_heads = 2;
    cfg.n_kv_heads = 2;
    cfg.d_ff = 64;
    cfg.max_seq_len = 32;
    let w = difftx_core::model::init_weights(&cfg, seed, DType::F32, &Device::Cpu).unwrap();
    difftx_core::checkpoint::save_model(dir, &cfg, &w).unwrap();
    cfg
}

#[test]
fn tiny_diff_model_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let mdir = tmp.path().join("m");
    let cfg = tiny_model(&mdir, Family::DiffV1, 3);
    let text_path = tmp.path().join("t.txt");
    let text: String = (0..400).map(|i| ["to be ", "or not ", "that is ", "the question "][i % 4]).collect();
    std::fs::write(&text_path, &text).unwrap();
    let out = tmp.path().join("out");
    let opts =
        OutliersOptions { text: Some(text_path.clone()), max_tokens: 64, seq_len: Some(16), ..Default::default() };
    let v = run_outliers(&mdir, &opts, &out).unwrap();
    assert_eq!(v["windows"], 4);
    // diff-v1: n_heads projected heads = n_heads/2 differential heads with two maps each.
    assert_eq!(v["attention_maps_per_layer"], cfg.n_heads);
    let per_layer = v["attention_logits"]["per_layer"].as_array().unwrap();
    assert_eq!(per_layer.len(), 2);
    // causal entries of 4 windows x 2 maps x (16·17/2)
    assert_eq!(per_layer[0]["count"], 4 * 2 * 136);
    assert_eq!(v["hidden_states"]["per_layer"][1]["count"], 4 * 16 * 32);
    assert_eq!(v["hidden_states"]["all_layers"]["count"], 2 * 4 * 16 * 32);

    // Independent check of the hidden-state maximum of layer 1 and of the layer-0 logit maximum.
    let model = difftx_core::checkpoint::load_runnable(&mdir, &Device::Cpu).unwrap();
    let tokens: Vec<u32> = text.bytes().map(|b| b as u32).collect();
    let windows = difftx_experiments::common::token_windows(&tokens, 16, 64).unwrap();
    let (mut hmax, mut lmax) = (0f32, 0f32);
    for w in &windows {
        let ids = Tensor::from_slice(&w[..16], (1, 16), &Device::Cpu).unwrap();
        let mut probe =
            difftx_core::model::Probe { capture_hidden: true, capture_attention: true, ..Default::default() };
        model.forward_probe(&ids, None, Some(&mut probe)).unwrap();
        let h = probe.hidden[2].abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        hmax = hmax.max(h);
        let l = probe.attn_logits[0].to_vec3::<f32>().ok();
        assert!(l.is_none()); // rank 4
        let logits = probe.attn_logits[0].squeeze(0).unwrap().to_vec3::<f32>().unwrap();
        for map in logits {
            for (t, row) in map.iter().enumerate() {
                for x in &row[..=t] {
                    lmax = lmax.max(x.abs());
                }
            }
        }
    }
    let got_h = v["hidden_states"]["per_layer"][1]["top1"].as_f64().unwrap();
    let got_l = v["attention_logits"]["per_layer"][0]["top1"].as_f64().unwrap();
    assert_eq!(got_h, hmax as f64);
    assert_eq!(got_l, lmax as f64);
    let m = v["hidden_states"]["per_layer"][1]["median"].as_f64().unwrap();
    assert!(m > 0.0 && m < got_h);

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("outliers.json")).unwrap()).unwrap();
    assert_eq!(json["attention_logits"]["all_layers"]["count"], v["attention_logits"]["all_layers"]["count"]);
    let close = (json["hidden_states"]["all_layers"]["top1"].as_f64().unwrap() - got_h).abs() < 1e-12;
    assert!(close);
    assert!(std::fs::metadata(out.join("outliers.png")).unwrap().len() > 1000);

    // Clear errors.
    let err = run_outliers(&tmp.path().join("nope"), &opts, &out).unwrap_err().to_string();
    assert!(err.contains("does not exist"), "{err}");
    std::fs::write(&text_path, "short").unwrap();
    let err = run_outliers(&mdir, &opts, &out).unwrap_err().to_string();
    assert!(err.contains("text too short"), "{err}");
    let err =
        run_outliers(&mdir, &OutliersOptions { seq_len: Some(1000), ..opts.clone() }, &out).unwrap_err().to_string();
    assert!(err.contains("longer than the model's context"), "{err}");
}
