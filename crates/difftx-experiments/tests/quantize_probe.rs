//! Quantisation: absmax round-trip bounds, exact per-group values on a hand-built matrix, and the
//! instrument on tiny random models.

use candle_core::{DType, Device, Tensor};
use difftx_core::config::{Family, ModelConfig};
use difftx_experiments::quantize::{
    is_quantized_weight, quantize_matrix, quantize_weights, run_quantize, QuantizeOptions,
};
use rand::{Rng, SeedableRng};
use std::path::Path;

#[test]
fn hand_built_matrix_per_group_and_per_channel() {
    // 4 bits: qmax = 7. Groups of 4 along the input dim; the last group of each row has 2.
    let m = vec![
        1.0, -2.0, 3.5, 7.0, 0.3125, -1.75, //
        14.0, 0.0, -6.0, 5.0, 0.0, 0.0,
    ];
    let mut g = m.clone();
    quantize_matrix(&mut g, 6, Some(4), 4).unwrap();
    // row 0: scale 1 then 0.25 (3.5 and 1.25 round half away from zero / down);
    // row 1: scale 2 (2.5 -> 3), zero group stays zero.
    assert_eq!(g, vec![1.0, -2.0, 4.0, 7.0, 0.25, -1.75, 14.0, 0.0, -6.0, 6.0, 0.0, 0.0]);
    let mut c = m.clone();
    quantize_matrix(&mut c, 6, None, 4).unwrap();
    assert_eq!(c, vec![1.0, -2.0, 4.0, 7.0, 0.0, -2.0, 14.0, 0.0, -6.0, 6.0, 0.0, 0.0]);
    // A group wider than the row is per-channel.
    let mut w = m.clone();
    quantize_matrix(&mut w, 6, Some(128), 4).unwrap();
    assert_eq!(w, c);
    assert!(quantize_matrix(&mut w, 5, None, 4).is_err());
    assert!(quantize_matrix(&mut w, 6, Some(0), 4).is_err());
    assert!(quantize_matrix(&mut w, 6, None, 1).is_err());
}

#[test]
fn absmax_round_trip_error_bounds() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (rows, cols) = (16, 96);
    let data: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-3.0f32..3.0) * if rng.random_bool(0.05) { 20.0 } else { 1.0 })
        .collect();
    for bits in [4u32, 6, 8, 16] {
        let qmax = ((1u32 << (bits - 1)) - 1) as f32;
        for group in [None, Some(32), Some(40)] {
            let mut q = data.clone();
            quantize_matrix(&mut q, cols, group, bits).unwrap();
            let g = group.unwrap_or(cols);
            for r in 0..rows {
                for (ci, chunk) in data[r * cols..(r + 1) * cols].chunks(g).enumerate() {
                    let absmax = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let scale = absmax / qmax;
                    for (j, x) in chunk.iter().enumerate() {
                        let y = q[r * cols + ci * g + j];
                        // Half a step, plus f32 rounding of the scaled value (matters at 16 bits).
                        assert!(
                            (x - y).abs() <= scale * 0.5 + x.abs() * 1e-6,
                            "bits {bits} group {group:?}: {x} -> {y}"
                        );
                        assert!(y.abs() <= absmax * (1.0 + 1e-6));
                    }
                    // The largest value is exact (up to f32 rounding of the scale).
                    let i = chunk.iter().position(|x| x.abs() == absmax).unwrap();
                    assert!((q[r * cols + ci * g + i] - chunk[i]).abs() <= absmax * 1e-6);
                }
            }
            // Per channel agrees with the engine's dynamic absmax over the last dim.
            if group.is_none() {
                let t = Tensor::from_vec(data.clone(), (rows, cols), &Device::Cpu).unwrap();
                let e = difftx_core::ops::fake_quant_absmax(&t, bits)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for (a, b) in e.iter().zip(&q) {
                    assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
                }
            }
        }
    }
}

fn tiny_cfg(family: Family, tie: bool) -> ModelConfig {
    let mut cfg = ModelConfig::preset("tiny", family).unwrap();
    cfg.d_model = 64;
    cfg.n_layers = 2;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 4;
    cfg.d_ff = 128;
    cfg.max_seq_len = 32;
    cfg.tie_embeddings = tie;
    // The weight scales below (init × std_scale) were chosen for this init.
    cfg.init_std = 0.02;
    cfg
}

fn save(dir: &Path, cfg: &ModelConfig, seed: u64, std_scale: f32) {
    let w = difftx_core::model::init_weights(cfg, seed, DType::F32, &Device::Cpu).unwrap();
    // Larger weights than the init so that the model is far from uniform and quantisation bites.
    let w: Vec<(String, Tensor)> = w
        .into_iter()
        .map(|(n, t)| {
            if n.ends_with("_proj.weight") || n.contains("embed") || n.contains("lm_head") {
                (n, (t * std_scale as f64).unwrap())
            } else {
                (n, t)
            }
        })
        .collect();
    difftx_core::checkpoint::save_model(dir, cfg, &w).unwrap();
}

fn loss_of(v: &serde_json::Value, setting: &str) -> f64 {
    v["results"].as_array().unwrap().iter().find(|r| r["setting"] == setting).unwrap_or_else(|| panic!("no {setting}"))
        ["loss"]
        .as_f64()
        .unwrap()
}

#[test]
fn tiny_models_int8_barely_changes_loss_int4_more() {
    let tmp = tempfile::tempdir().unwrap();
    let text_path = tmp.path().join("t.txt");
    let text: String = (0..300).map(|i| ["the king ", "is dead; ", "long live ", "the queen. "][i % 4]).collect();
    std::fs::write(&text_path, &text).unwrap();
    for family in [Family::Baseline, Family::DiffV1, Family::DiffV2] {
        let mdir = tmp.path().join(family.as_str());
        let cfg = tiny_cfg(family, false);
        save(&mdir, &cfg, 11, 10.0);
        let out = tmp.path().join(format!("out-{}", family.as_str()));
        let opts =
            QuantizeOptions { text: Some(text_path.clone()), max_tokens: 128, seq_len: Some(32), ..Default::default() };
        let v = run_quantize(&mdir, &opts, &out).unwrap();
        let base = v["baseline_loss"].as_f64().unwrap();
        assert!(base.is_finite() && base > 0.0);
        assert_eq!(v["results"].as_array().unwrap().len(), 1 + 4 + 6 + 2);
        let d = |s: &str| (loss_of(&v, s) - base).abs();
        assert!(d("logits int16") < 1e-3, "{family:?}: {}", d("logits int16"));
        assert!(d("W8 per-channel") < 0.02, "{family:?}: int8 delta {}", d("W8 per-channel"));
        assert!(
            d("W4 per-channel") > 3.0 * d("W8 per-channel"),
            "{family:?}: int4 {} vs int8 {}",
            d("W4 per-channel"),
            d("W8 per-channel")
        );
        assert!(d("W4A4") > d("W8A8"), "{family:?}: W4A4 {} vs W8A8 {}", d("W4A4"), d("W8A8"));
        assert!(d("logits int4") > d("logits int16"));
        let names: Vec<&str> = v["quantized_weights"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
        assert!(names.contains(&"model.layers.0.self_attn.q_proj.weight") && names.contains(&"lm_head.weight"));
        assert!(names.iter().all(|n| !n.contains("norm") && !n.contains("lambda_q") && !n.contains("embed")));
        if family == Family::DiffV2 {
            assert!(names.contains(&"model.layers.1.self_attn.lambda_proj.weight"));
        }
        assert_eq!(names.len(), 2 * 7 + 1 + usize::from(family == Family::DiffV2) * 2);
        assert!(std::fs::metadata(out.join("quantize.json")).is_ok());
        assert!(std::fs::metadata(out.join("quantize.png")).unwrap().len() > 1000);
    }
    // Errors.
    let mdir = tmp.path().join("baseline");
    let bad = QuantizeOptions { logit_bits: vec![1], ..Default::default() };
    assert!(run_quantize(&mdir, &bad, tmp.path()).unwrap_err().to_string().contains("out of range"));
    let err =
        run_quantize(&tmp.path().join("missing"), &QuantizeOptions::default(), tmp.path()).unwrap_err().to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn tied_embedding_is_quantized_only_when_tied() {
    let cfg = tiny_cfg(Family::Baseline, true);
    assert!(is_quantized_weight("model.embed_tokens.weight", &cfg));
    assert!(!is_quantized_weight("model.embed_tokens.weight", &tiny_cfg(Family::Baseline, false)));
    assert!(!is_quantized_weight("model.layers.0.input_layernorm.weight", &cfg));
    let w: std::collections::HashMap<String, Tensor> =
        difftx_core::model::init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    let (q, names) = quantize_weights(&cfg, &w, 4, Some(32)).unwrap();
    assert!(names.contains(&"model.embed_tokens.weight".to_string()));
    let norm = "model.norm.weight";
    assert_eq!(q[norm].to_vec1::<f32>().unwrap(), w[norm].to_vec1::<f32>().unwrap());
    let e = "model.embed_tokens.weight";
    let diff = (&q[e] - &w[e]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff > 0.0);
}
