//! Hugging Face interop: logits/hidden-state/loss parity with outputs recorded from transformers,
//! loader error messages, and export -> re-import round trips.
//!
//! Reference folders: `tests/fixtures/hf/*` (made by `scripts/make_hf_fixtures.py`, plus
//! `tiny_diffllama` and `tiny_llama`, the project's two original reference checkpoints with
//! transformers' outputs). Each holds a HF model folder plus `reference_outputs.safetensors` (`input_ids` i64 [B, T], `logits` f32
//! [B, T, V], optional `hidden_states.K` and `loss`).

use candle_core::{DType, Device, IndexOp, Tensor};
use difftx_core::checkpoint::{self, load_model};
use difftx_core::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use difftx_core::hf::{self, export_hf, is_hf_dir, load_hf_weights, read_hf_config};
use difftx_core::model::{init_weights, Model, Probe};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const TOL: f32 = 1e-4;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixtures_dir() -> PathBuf {
    manifest().join("../../tests/fixtures/hf")
}

fn tmp_dir(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("difftx-hf-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Checks one HF folder against its recorded transformers outputs; returns the logits max |diff|.
fn check_reference(dir: &Path) -> f32 {
    let dev = Device::Cpu;
    assert!(is_hf_dir(dir), "{} is not a HF folder", dir.display());
    let (cfg, weights) = load_model(dir, DType::F32, &dev).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let model = Model::from_weights(&cfg, &weights).unwrap();
    let refs = checkpoint::read_safetensors(&dir.join("reference_outputs.safetensors"), &dev).unwrap();
    let ids = refs["input_ids"].to_dtype(DType::U32).unwrap();
    let mut probe = Probe { capture_hidden: true, ..Default::default() };
    let logits = model.forward_probe(&ids, None, Some(&mut probe)).unwrap();
    assert_eq!(probe.hidden.len(), cfg.n_layers + 1);
    // HF: embeddings, each block's output, and the last entry after the final norm.
    let mut hidden: Vec<Tensor> = probe.hidden.into_iter().take(cfg.n_layers).collect();
    hidden.push(model.hidden_states(&ids, None, None).unwrap());
    let dl = max_abs_diff(&logits, &refs["logits"]);
    assert!(dl <= TOL, "{}: logits max |diff| {dl:e} > {TOL:e}", dir.display());
    let mut n_hidden = 0;
    for (k, got) in hidden.iter().enumerate().take(cfg.n_layers + 1) {
        let Some(want) = refs.get(&format!("hidden_states.{k}")) else { continue };
        let dh = max_abs_diff(got, want);
        assert!(dh <= TOL, "{}: hidden_states.{k} max |diff| {dh:e}", dir.display());
        n_hidden += 1;
    }
    if let Some(want) = refs.get("loss") {
        // transformers' causal-LM loss: logits[:, :-1] against ids[:, 1:].
        let t = ids.dim(1).unwrap();
        let l = logits.narrow(1, 0, t - 1).unwrap().contiguous().unwrap();
        let tgt = ids.narrow(1, 1, t - 1).unwrap().contiguous().unwrap();
        let loss = Model::loss(&l, &tgt).unwrap().to_scalar::<f32>().unwrap();
        let want = want.flatten_all().unwrap().i(0).unwrap().to_scalar::<f32>().unwrap();
        assert!((loss - want).abs() <= TOL, "{}: loss {loss} vs {want}", dir.display());
    }
    eprintln!("{}: logits max |diff| {dl:e}, {n_hidden} hidden states checked", dir.display());
    dl
}

fn reference_folders(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(root).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    v.retain(|p| p.join("reference_outputs.safetensors").is_file());
    v.sort();
    v
}

#[test]
fn fixture_parity() {
    let dirs = reference_folders(&fixtures_dir());
    let names: Vec<String> = dirs.iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect();
    for want in [
        "tiny_diffllama",
        "tiny_llama",
        "diffllama_gqa_kv1",
        "diffllama_gqa_kv3",
        "diffllama_gqa_kv2",
        "diffllama_tied",
        "diffllama_bf16",
        "llama_gqa",
        "llama_sharded",
        "diffv2_gqa",
        "diffv2_tied_rotate_half",
    ] {
        assert!(names.iter().any(|n| n == want), "fixture {want} missing (have {names:?})");
    }
    for d in dirs {
        check_reference(&d);
    }
    // The diff-v2 fixtures carry the remote code export writes today (else: re-run
    // scripts/make_diff_v2_fixtures.sh, which also re-checks the class in PyTorch).
    for name in ["diffv2_gqa", "diffv2_tied_rotate_half"] {
        for file in ["configuration_difftx_diff_v2.py", "modeling_difftx_diff_v2.py"] {
            let fixture = std::fs::read_to_string(fixtures_dir().join(name).join(file)).unwrap();
            let source = std::fs::read_to_string(manifest().join("src/hf_remote").join(file)).unwrap();
            assert!(
                fixture == source,
                "{name}/{file} is older than src/hf_remote/{file}: re-run scripts/make_diff_v2_fixtures.sh"
            );
        }
    }
}

#[test]
fn odd_kv_heads_are_duplicated() {
    let dir = fixtures_dir().join("diffllama_gqa_kv1");
    let cfg = read_hf_config(&dir).unwrap();
    assert_eq!(cfg.family, Family::DiffV1);
    assert_eq!(cfg.n_kv_heads, 2, "one HF kv head becomes two engine kv heads");
    let w = load_hf_weights(&dir, &cfg, &Device::Cpu).unwrap();
    let k = &w["model.layers.0.self_attn.k_proj.weight"];
    let d = cfg.head_dim();
    assert_eq!(max_abs_diff(&k.narrow(0, 0, d).unwrap(), &k.narrow(0, d, d).unwrap()), 0.0);
}

#[test]
fn config_mapping() {
    let dir = fixtures_dir().join("diffllama_gqa_kv2");
    let cfg = read_hf_config(&dir).unwrap();
    assert_eq!(cfg.head_pairing, HeadPairing::Halves);
    assert_eq!(cfg.rope_style, RopeStyle::RotateHalf);
    assert!(!cfg.subln_affine);
    assert_eq!(cfg.subln_eps, cfg.norm_eps);
    // checkpoint::read_config dispatches to the HF reader.
    assert_eq!(checkpoint::read_config(&dir).unwrap(), cfg);
    let llama = read_hf_config(&fixtures_dir().join("llama_gqa")).unwrap();
    assert_eq!(llama.family, Family::Baseline);
    assert_eq!(llama.rope_style, RopeStyle::RotateHalf);
}

fn base_config_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "rope_theta": 500000.0
    })
}

#[test]
fn rope_theta_sources() {
    let v = base_config_json();
    assert_eq!(hf::hf_config_from_json(&v).unwrap().rope_theta, 500000.0);
    let mut v = base_config_json();
    v.as_object_mut().unwrap().remove("rope_theta");
    v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 12345.0});
    assert_eq!(hf::hf_config_from_json(&v).unwrap().rope_theta, 12345.0);
    // transformers' eps defaults when rms_norm_eps is absent.
    let mut v = base_config_json();
    v.as_object_mut().unwrap().remove("rms_norm_eps");
    assert_eq!(hf::hf_config_from_json(&v).unwrap().norm_eps, 1e-6);
    v["model_type"] = "diffllama".into();
    let c = hf::hf_config_from_json(&v).unwrap();
    assert_eq!((c.family, c.norm_eps, c.subln_eps, c.head_pairing), (Family::DiffV1, 1e-5, 1e-5, HeadPairing::Halves));
    let mut v = base_config_json();
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    let e = format!("{:#}", hf::hf_config_from_json(&v).unwrap_err());
    assert!(e.contains("llama3"), "{e}");
    let mut v = base_config_json();
    v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0});
    let e = format!("{:#}", hf::hf_config_from_json(&v).unwrap_err());
    assert!(e.contains("yarn"), "{e}");
}

#[test]
fn loader_errors_are_clear() {
    let dev = Device::Cpu;
    let err = |r: anyhow::Result<(ModelConfig, HashMap<String, Tensor>)>| format!("{:#}", r.expect_err("should fail"));

    // Folder without config.json.
    let empty = tmp_dir("empty");
    let e = format!("{:#}", read_hf_config(&empty).unwrap_err());
    assert!(e.contains("config.json"), "{e}");
    let e = err(load_model(&empty, DType::F32, &dev));
    assert!(e.contains("config.json"), "{e}");

    // Unknown model_type.
    let d = tmp_dir("gpt2");
    let mut v = base_config_json();
    v["model_type"] = "gpt2".into();
    std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("unknown model_type 'gpt2'"), "{e}");

    // Shape mismatch: config says another intermediate size.
    let src = fixtures_dir().join("llama_gqa");
    let d = tmp_dir("shape");
    copy_dir(&src, &d);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    v["intermediate_size"] = (v["intermediate_size"].as_u64().unwrap() + 8).into();
    std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(
        e.contains("'model.layers.0.mlp.gate_proj.weight'") && e.contains("model.safetensors") && e.contains("shape"),
        "{e}"
    );

    // Truncated safetensors.
    let d = tmp_dir("trunc");
    copy_dir(&src, &d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("model.safetensors") && e.contains("truncated or corrupt"), "{e}");

    // Garbage header.
    std::fs::write(d.join("model.safetensors"), b"not a safetensors file at all").unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("truncated or corrupt"), "{e}");

    // Missing shard.
    let sharded = fixtures_dir().join("llama_sharded");
    let d = tmp_dir("shard");
    copy_dir(&sharded, &d);
    let idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("model.safetensors.index.json")).unwrap()).unwrap();
    let shard = idx["weight_map"]["model.norm.weight"].as_str().unwrap().to_string();
    std::fs::remove_file(d.join(&shard)).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("missing shard") && e.contains(&shard), "{e}");

    // Unsupported dtype: an integer tensor among the weights.
    let d = tmp_dir("dtype");
    copy_dir(&src, &d);
    let mut w = checkpoint::read_safetensors(&d.join("model.safetensors"), &dev).unwrap();
    let n = w["model.norm.weight"].dim(0).unwrap();
    w.insert("model.norm.weight".into(), Tensor::zeros(n, DType::I64, &dev).unwrap());
    let list: Vec<(String, Tensor)> = w.into_iter().collect();
    std::fs::write(d.join("model.safetensors"), checkpoint::safetensors_bytes(&list).unwrap()).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(
        e.contains("'model.norm.weight'") && e.contains("unsupported dtype") && e.contains("model.safetensors"),
        "{e}"
    );

    // Missing tensor and unexpected tensor.
    let d = tmp_dir("missing");
    copy_dir(&src, &d);
    let mut w = checkpoint::read_safetensors(&d.join("model.safetensors"), &dev).unwrap();
    let norm = w.remove("model.norm.weight").unwrap();
    w.insert("model.layers.0.self_attn.q_proj.bias".into(), norm);
    let list: Vec<(String, Tensor)> = w.into_iter().collect();
    std::fs::write(d.join("model.safetensors"), checkpoint::safetensors_bytes(&list).unwrap()).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("'model.norm.weight'") && e.contains("missing"), "{e}");

    // No weights at all.
    let d = tmp_dir("noweights");
    std::fs::copy(src.join("config.json"), d.join("config.json")).unwrap();
    let e = err(load_model(&d, DType::F32, &dev));
    assert!(e.contains("model.safetensors"), "{e}");

    for name in ["empty", "gpt2", "shape", "trunc", "shard", "dtype", "missing", "noweights"] {
        let _ =
            std::fs::remove_dir_all(std::env::temp_dir().join(format!("difftx-hf-test-{}-{name}", std::process::id())));
    }
}

#[test]
fn tied_embeddings_with_lm_head_present_are_accepted() {
    // A tied folder that still stores lm_head.weight (older save_pretrained) loads the same.
    let dev = Device::Cpu;
    let src = fixtures_dir().join("diffllama_tied");
    let d = tmp_dir("tied_extra");
    copy_dir(&src, &d);
    let mut w = checkpoint::read_safetensors(&d.join("model.safetensors"), &dev).unwrap();
    assert!(!w.contains_key("lm_head.weight"));
    let emb = w["model.embed_tokens.weight"].clone();
    w.insert("lm_head.weight".into(), emb);
    w.insert("model.rotary_emb.inv_freq".into(), Tensor::ones(4, DType::F32, &dev).unwrap());
    let list: Vec<(String, Tensor)> = w.into_iter().collect();
    std::fs::write(d.join("model.safetensors"), checkpoint::safetensors_bytes(&list).unwrap()).unwrap();
    check_reference(&d);
    let _ = std::fs::remove_dir_all(&d);
}

// ---------------------------------------------------------------------------------------------
// Export

fn native_config(family: Family) -> ModelConfig {
    let mut cfg = ModelConfig::preset("tiny", family).unwrap();
    cfg.vocab_size = 48;
    cfg.d_model = 48;
    cfg.n_layers = 2;
    cfg.n_heads = 8;
    cfg.n_kv_heads = 4;
    cfg.head_dim = Some(10);
    cfg.d_ff = 96;
    cfg.max_seq_len = 32;
    cfg.rope_theta = 5000.0;
    cfg
}

/// Random weights, with non-trivial norm and sub-layer-norm gains.
fn random_weights(cfg: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let mut w: HashMap<String, Tensor> = init_weights(cfg, seed, DType::F32, &dev).unwrap().into_iter().collect();
    let mut k = 0.3;
    for (name, t) in w.iter_mut() {
        if name.ends_with("norm.weight") || name.ends_with("subln.weight") {
            let n = t.dim(0).unwrap();
            k += 0.7;
            let s = Tensor::arange(0f32, n as f32, &dev).unwrap().affine(k, 0.1).unwrap().sin().unwrap();
            *t = s.affine(0.5, 1.0).unwrap();
        } else {
            // Larger weights than the 0.02 init so attention is far from uniform.
            *t = (&*t * 8.0).unwrap();
        }
    }
    w
}

fn test_ids(cfg: &ModelConfig) -> Tensor {
    let v = cfg.vocab_size as u32;
    let ids: Vec<u32> = (0..24).map(|i| (i * 7 + 3 + i / 12) % v).collect();
    Tensor::from_vec(ids, (2, 12), &Device::Cpu).unwrap()
}

fn export_roundtrip(cfg: &ModelConfig, name: &str) -> f32 {
    let dev = Device::Cpu;
    let w = random_weights(cfg, 7);
    let model = Model::from_weights(cfg, &w).unwrap();
    let dir = tmp_dir(name);
    export_hf(cfg, &w, &dir).unwrap();
    assert!(is_hf_dir(&dir));
    let (cfg2, w2) = load_model(&dir, DType::F32, &dev).unwrap();
    assert_eq!(cfg2.family, cfg.family);
    // DiffLlama and Llama are rotate-half; diff-v2's remote code keeps the engine's style.
    let style = if cfg.family == Family::DiffV2 { cfg.rope_style } else { RopeStyle::RotateHalf };
    assert_eq!((cfg2.rope_style, cfg2.subln_affine), (style, false));
    assert_eq!(cfg2.tie_embeddings, cfg.tie_embeddings);
    assert_eq!(cfg2.head_dim(), cfg.head_dim());
    let model2 = Model::from_weights(&cfg2, &w2).unwrap();
    let ids = test_ids(cfg);
    let a = model.forward(&ids, None).unwrap();
    let b = model2.forward(&ids, None).unwrap();
    let diff = max_abs_diff(&a, &b);
    let spread = max_abs_diff(&a, &a.zeros_like().unwrap());
    eprintln!("{name}: export round trip logits max |diff| {diff:e} (max |logit| {spread})");
    assert!(spread > 0.1, "logits too small for a meaningful test");
    // f32 rounding scales with the logits (presets initialise at 1/√D, so they reach ~20 here),
    // and the export permutes q/k rows (interleaved -> rotate-half), so matmuls sum in another
    // order; how gemm splits them also depends on the threads free at the time: 7.9e-5 at
    // |logit| 18 was seen on a busy machine, hence 1e-5 relative rather than 4e-6.
    assert!(diff <= 1e-5 * spread.max(2.5), "{name}: round trip max |diff| {diff:e}");
    let _ = std::fs::remove_dir_all(&dir);
    diff
}

#[test]
fn export_diff_v1_interleaved_with_gain_gqa() {
    let cfg = native_config(Family::DiffV1);
    assert_eq!(
        (cfg.head_pairing, cfg.rope_style, cfg.subln_affine),
        (HeadPairing::Interleaved, RopeStyle::Interleaved, true)
    );
    export_roundtrip(&cfg, "v1_interleaved");
}

#[test]
fn export_diff_v1_variants() {
    let mut cfg = native_config(Family::DiffV1);
    cfg.n_kv_heads = 2; // one kv group per half
    cfg.tie_embeddings = true;
    export_roundtrip(&cfg, "v1_kv2_tied");
    let mut cfg = native_config(Family::DiffV1);
    cfg.head_pairing = HeadPairing::Halves;
    cfg.rope_style = RopeStyle::RotateHalf;
    cfg.subln_affine = false;
    cfg.head_dim = None;
    export_roundtrip(&cfg, "v1_hf_layout");
    let mut cfg = native_config(Family::DiffV1);
    cfg.head_pairing = HeadPairing::Halves; // mixed: halves pairing, interleaved RoPE, gain
    export_roundtrip(&cfg, "v1_mixed");
}

#[test]
fn export_baseline() {
    let mut cfg = native_config(Family::Baseline);
    cfg.n_kv_heads = 2;
    export_roundtrip(&cfg, "baseline_interleaved");
    cfg.tie_embeddings = true;
    cfg.rope_style = RopeStyle::RotateHalf;
    export_roundtrip(&cfg, "baseline_tied");
}

#[test]
fn export_of_hf_layout_is_lossless() {
    // Importing and re-exporting a HF folder reproduces its tensors bit for bit.
    let dev = Device::Cpu;
    let src = fixtures_dir().join("diffllama_gqa_kv2");
    let (cfg, w) = load_model(&src, DType::F32, &dev).unwrap();
    let dir = tmp_dir("relossless");
    export_hf(&cfg, &w, &dir).unwrap();
    let a = checkpoint::read_safetensors(&src.join("model.safetensors"), &dev).unwrap();
    let b = checkpoint::read_safetensors(&dir.join("model.safetensors"), &dev).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        assert_eq!(max_abs_diff(t, &b[name]), 0.0, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_diff_v2_with_its_remote_code() {
    let mut cfg = native_config(Family::DiffV2);
    cfg.n_kv_heads = 2;
    export_roundtrip(&cfg, "v2_interleaved_gqa");
    cfg.tie_embeddings = true;
    cfg.rope_style = RopeStyle::RotateHalf;
    export_roundtrip(&cfg, "v2_tied_rotate_half");
}

#[test]
fn diff_v2_folders_need_their_remote_code_of_this_version() {
    let dir = tmp_dir("v2_remote");
    let cfg = native_config(Family::DiffV2);
    export_hf(&cfg, &random_weights(&cfg, 1), &dir).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "difftx_diff_v2");
    assert_eq!(config["auto_map"]["AutoModelForCausalLM"], "modeling_difftx_diff_v2.DifftxDiffV2ForCausalLM");
    assert!(read_hf_config(&dir).is_ok());
    let mut old = config.clone();
    old["difftx_remote_code_version"] = serde_json::json!(0);
    std::fs::write(dir.join("config.json"), old.to_string()).unwrap();
    let e = format!("{:#}", read_hf_config(&dir).unwrap_err());
    assert!(e.contains("remote code version 0"), "{e}");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::remove_file(dir.join("modeling_difftx_diff_v2.py")).unwrap();
    let e = format!("{:#}", read_hf_config(&dir).unwrap_err());
    assert!(e.contains("modeling_difftx_diff_v2.py is missing"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_errors() {
    let dir = tmp_dir("export_err");
    let mut cfg = native_config(Family::DiffV1);
    cfg.subln_eps = 1e-6;
    let w = random_weights(&cfg, 1);
    let e = format!("{:#}", export_hf(&cfg, &w, &dir.join("eps")).unwrap_err());
    assert!(e.contains("subln_eps"), "{e}");
    let cfg = native_config(Family::DiffV1);
    let mut w = random_weights(&cfg, 1);
    w.remove("model.layers.1.self_attn.subln.weight");
    let e = format!("{:#}", export_hf(&cfg, &w, &dir.join("miss")).unwrap_err());
    assert!(e.contains("model.layers.1.self_attn.subln.weight"), "{e}");
    let mut cfg = native_config(Family::DiffV1);
    cfg.subln = false;
    let w = random_weights(&cfg, 1);
    let e = format!("{:#}", export_hf(&cfg, &w, &dir.join("nosubln")).unwrap_err());
    assert!(e.contains("subln: false") && !e.contains('\n'), "{e}");
    assert!(!dir.join("nosubln").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes an exported folder plus `native_logits.safetensors` (input_ids, logits of the native
/// model) for `scripts/export_roundtrip.py`:
/// `DIFFTX_EXPORT_DIR=/tmp/x cargo test -p difftx-core --test hf_parity -- --ignored dump_export`
#[test]
#[ignore]
fn dump_export_for_python() {
    let root = std::env::var("DIFFTX_EXPORT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join("difftx-export"));
    let mut cases = vec![("diffllama", native_config(Family::DiffV1)), ("llama", native_config(Family::Baseline))];
    let mut tied = native_config(Family::DiffV1);
    tied.n_kv_heads = 2;
    tied.tie_embeddings = true;
    cases.push(("diffllama_kv2_tied", tied));
    for (name, cfg) in cases {
        let w = random_weights(&cfg, 11);
        let model = Model::from_weights(&cfg, &w).unwrap();
        let dir = root.join(name);
        export_hf(&cfg, &w, &dir).unwrap();
        let ids = test_ids(&cfg);
        let logits = model.forward(&ids, None).unwrap();
        let list = vec![("input_ids".to_string(), ids.to_dtype(DType::I64).unwrap()), ("logits".to_string(), logits)];
        std::fs::write(dir.join("native_logits.safetensors"), checkpoint::safetensors_bytes(&list).unwrap()).unwrap();
        eprintln!("wrote {}", dir.display());
    }
}

#[test]
fn a_folder_whose_weights_are_of_another_family_is_a_clear_error() {
    // diff-v2 weights under a DiffLlama config.json, and DiffLlama weights under a diff-v2 one.
    let dir = tmp_dir("family_mismatch");
    copy_dir(&fixtures_dir().join("diffv2_gqa"), &dir);
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = serde_json::json!("diffllama");
    config.as_object_mut().unwrap().remove("rope_style");
    std::fs::write(&path, config.to_string()).unwrap();
    let e = format!("{:#}", load_model(&dir, DType::F32, &Device::Cpu).unwrap_err());
    assert!(e.contains("unexpected tensor") || e.contains("shape"), "{e}");
    let dir2 = tmp_dir("family_mismatch2");
    copy_dir(&fixtures_dir().join("diffllama_tied"), &dir2);
    for f in ["configuration_difftx_diff_v2.py", "modeling_difftx_diff_v2.py"] {
        std::fs::copy(fixtures_dir().join("diffv2_gqa").join(f), dir2.join(f)).unwrap();
    }
    let path = dir2.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = serde_json::json!("difftx_diff_v2");
    config["difftx_remote_code_version"] = serde_json::json!(1);
    config["rope_style"] = serde_json::json!("rotate_half");
    std::fs::write(&path, config.to_string()).unwrap();
    let e = format!("{:#}", load_model(&dir2, DType::F32, &Device::Cpu).unwrap_err());
    assert!(e.contains("missing") || e.contains("shape"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}
