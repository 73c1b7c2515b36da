//! Export to the official Diff-Transformer layout and back (`difftx_core::official`).

use candle_core::{DType, Device, Tensor};
use difftx_core::checkpoint::load_model;
use difftx_core::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use difftx_core::model::{init_weights, Model};
use difftx_core::official::export_official;
use std::collections::HashMap;
use std::path::PathBuf;

fn weights(cfg: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    init_weights(cfg, seed, DType::F32, &Device::Cpu).unwrap().into_iter().collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn config() -> ModelConfig {
    let mut cfg = ModelConfig::preset("nano", Family::DiffV1).unwrap();
    cfg.n_layers = 2;
    cfg.max_seq_len = 32;
    cfg.init_std = 0.3;
    cfg.lambda_std = 0.3;
    cfg
}

fn logits(cfg: &ModelConfig, w: &HashMap<String, Tensor>) -> Tensor {
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % cfg.vocab_size as u32).collect();
    let ids = Tensor::from_vec(ids, (2, 20), &Device::Cpu).unwrap();
    Model::from_weights(cfg, w).unwrap().forward(&ids, None).unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("difftx-official-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn the_native_layout_round_trips_exactly() {
    let cfg = config();
    assert_eq!(
        (cfg.head_pairing, cfg.rope_style, cfg.subln_affine),
        (HeadPairing::Interleaved, RopeStyle::Interleaved, true)
    );
    let w = weights(&cfg, 3);
    let dir = tmp("native");
    export_official(&cfg, &w, &dir).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_heads"], cfg.n_heads / 2);
    assert_eq!(config["head_dim"], cfg.head_dim());
    let file = difftx_core::checkpoint::read_safetensors(&dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(file.contains_key("model.layers.1.self_attn.out_proj.weight"));
    assert!(file.contains_key("model.layers.0.self_attn.lambda_q1"));
    let (cfg2, w2) = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        (cfg2.family, cfg2.n_heads, cfg2.head_dim(), cfg2.subln_affine),
        (Family::DiffV1, cfg.n_heads, cfg.head_dim(), true)
    );
    for (name, t) in &w {
        assert_eq!(max_abs(t, &w2[name]), 0.0, "{name}");
    }
    assert_eq!(max_abs(&logits(&cfg, &w), &logits(&cfg2, &w2)), 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_diffllama_layout_is_converted_and_computes_the_same_logits() {
    let mut cfg = config();
    cfg.head_pairing = HeadPairing::Halves;
    cfg.rope_style = RopeStyle::RotateHalf;
    cfg.subln_affine = false;
    let w = weights(&cfg, 5);
    let dir = tmp("diffllama");
    export_official(&cfg, &w, &dir).unwrap();
    let (cfg2, w2) = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        (cfg2.head_pairing, cfg2.rope_style, cfg2.subln_affine),
        (HeadPairing::Interleaved, RopeStyle::Interleaved, true)
    );
    let (a, b) = (logits(&cfg, &w), logits(&cfg2, &w2));
    let scale = a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let diff = max_abs(&a, &b);
    assert!(scale > 0.1 && diff <= 1e-5 * scale.max(1.0), "max |diff| {diff} (logits up to {scale})");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_the_official_module_cannot_compute_is_refused() {
    let dir = tmp("refused");
    let mut gqa = config();
    gqa.n_kv_heads = 2;
    let e = format!("{:#}", export_official(&gqa, &weights(&gqa, 1), &dir).unwrap_err());
    assert!(e.contains("GQA"), "{e}");
    let base = ModelConfig::preset("nano", Family::Baseline).unwrap();
    let e = format!("{:#}", export_official(&base, &weights(&base, 1), &dir).unwrap_err());
    assert!(e.contains("diff-v1"), "{e}");
    let mut off = config();
    off.subln = false;
    let e = format!("{:#}", export_official(&off, &weights(&off, 1), &dir).unwrap_err());
    assert!(e.contains("subln"), "{e}");
    assert!(!dir.exists());
}
