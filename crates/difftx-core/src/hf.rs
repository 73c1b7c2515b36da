//! Hugging Face checkpoint interop: import and export of `DiffLlamaForCausalLM` (diff-v1) and
//! `LlamaForCausalLM` (baseline) folders (`config.json` + `model.safetensors` or a sharded
//! `model.safetensors.index.json`).
//!
//! Import maps the HF config onto the engine's switches (docs/design.md §3): DiffLlama is diff-v1 with
//! `head_pairing: Halves`, `rope_style: RotateHalf`, `subln_affine: false`; Llama is baseline with
//! rotate-half RoPE. The weight names are the engine's own, so weights are used as they are, with
//! one exception: a DiffLlama with an odd `num_key_value_heads` (which HF allows) has each kv head
//! duplicated, because the engine splits kv heads into two halves. HF repeats kv heads to the query
//! count and then chunks them in two; duplicating every kv head (`k'[m] = k[m / 2]`) reproduces that
//! exactly, so `read_hf_config` reports twice the file's kv head count in that case.
//!
//! Export converts a native model to those conventions: interleaved head pairing -> halves (q/k/v
//! heads `2j, 2j+1` -> `j, j + count/2`), interleaved RoPE -> rotate-half (within each q/k head row
//! `2i` -> `i`, `2i+1` -> `i + d/2`) and the diff-v1 sub-layer-norm gain folded into the o_proj
//! columns of every head.
//!
//! diff-v2 has no class in transformers: its export writes the engine's own weights and layout
//! with a PyTorch implementation beside them (`configuration_difftx_diff_v2.py`,
//! `modeling_difftx_diff_v2.py` from `src/hf_remote/`, named in config.json's `auto_map`, loaded
//! with `trust_remote_code=True`), and import reads such folders back.

use crate::checkpoint::{write_atomic, CONFIG_FILE};
use crate::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use crate::model::param_specs;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Single-file weights of a HF folder.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";
/// Index of a sharded HF checkpoint (`weight_map`: tensor name -> shard file).
pub const HF_INDEX_FILE: &str = "model.safetensors.index.json";

/// `model_type` of exported diff-v2 folders.
pub const DIFF_V2_MODEL_TYPE: &str = "difftx_diff_v2";
/// Version of the remote code written with diff-v2 exports (`difftx_remote_code_version`).
pub const DIFF_V2_REMOTE_CODE_VERSION: u64 = 1;
/// The remote code files of a diff-v2 export and their contents.
const DIFF_V2_REMOTE_CODE: [(&str, &str); 2] = [
    ("configuration_difftx_diff_v2.py", include_str!("hf_remote/configuration_difftx_diff_v2.py")),
    ("modeling_difftx_diff_v2.py", include_str!("hf_remote/modeling_difftx_diff_v2.py")),
];

/// True when `dir/config.json` exists and is a Hugging Face config (has a `model_type` key).
pub fn is_hf_dir(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(CONFIG_FILE)) else { return false };
    let Ok(value) = serde_json::from_str::<Value>(&text) else { return false };
    value.get("model_type").is_some()
}

/// Reads a HF `config.json` (model_type `diffllama` or `llama`) as an engine config.
pub fn read_hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    if !path.is_file() {
        bail!("{} has no {CONFIG_FILE}: not a Hugging Face model folder", dir.display());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    if value.get("model_type").and_then(Value::as_str) == Some(DIFF_V2_MODEL_TYPE) {
        check_remote_code(dir, &value)?;
    }
    hf_config_from_json(&value).with_context(|| format!("{}: unsupported Hugging Face config", path.display()))
}

/// A diff-v2 folder must carry the remote code it was written with (transformers needs it; its
/// version says what the weights mean).
fn check_remote_code(dir: &Path, v: &Value) -> Result<()> {
    for (file, _) in DIFF_V2_REMOTE_CODE {
        if !dir.join(file).is_file() {
            bail!(
                "{} is a difftx diff-v2 folder but {file} is missing (re-export it with `difftx export`)",
                dir.display()
            );
        }
    }
    match v.get("difftx_remote_code_version").and_then(Value::as_u64) {
        Some(DIFF_V2_REMOTE_CODE_VERSION) => Ok(()),
        other => bail!(
            "{}: remote code version {} is not the version this difftx reads ({DIFF_V2_REMOTE_CODE_VERSION}); re-export it",
            dir.display(),
            other.map_or("missing".to_string(), |n| n.to_string())
        ),
    }
}

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| anyhow!("'{key}' must be a non-negative integer, got {x}")),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    get_usize(v, key)?.ok_or_else(|| anyhow!("missing '{key}'"))
}

fn get_f64(v: &Value, key: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| anyhow!("'{key}' must be a number, got {x}")),
    }
}

fn get_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_bool().map(Some).ok_or_else(|| anyhow!("'{key}' must be true or false, got {x}")),
    }
}

/// The RoPE type named by a `rope_scaling` / `rope_parameters` object (`rope_type` or legacy `type`).
fn rope_type(obj: &Value) -> Option<&str> {
    obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str)
}

/// Maps a parsed HF config to an engine config (see the module docs).
pub fn hf_config_from_json(v: &Value) -> Result<ModelConfig> {
    let model_type = v.get("model_type").and_then(Value::as_str).ok_or_else(|| anyhow!("missing 'model_type'"))?;
    let family = match model_type {
        "diffllama" => Family::DiffV1,
        "llama" => Family::Baseline,
        DIFF_V2_MODEL_TYPE => Family::DiffV2,
        other => bail!("unknown model_type '{other}' (supported: diffllama, llama, {DIFF_V2_MODEL_TYPE})"),
    };
    if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            bail!("hidden_act '{act}' is not supported (only silu)");
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if get_bool(v, key)? == Some(true) {
            bail!("'{key}: true' is not supported (the engine has no biases)");
        }
    }
    if let Some(f) = get_f64(v, "partial_rotary_factor")? {
        if f != 1.0 {
            bail!("partial_rotary_factor {f} is not supported");
        }
    }
    // RoPE: 4.x writes `rope_theta` (+ optional `rope_scaling`), 5.x `rope_parameters`.
    let mut theta = get_f64(v, "rope_theta")?;
    for key in ["rope_scaling", "rope_parameters"] {
        match v.get(key) {
            None | Some(Value::Null) => {}
            Some(obj @ Value::Object(_)) => {
                if let Some(t) = rope_type(obj) {
                    if t != "default" {
                        bail!("{key}: RoPE type '{t}' is not supported (only default RoPE)");
                    }
                }
                if key == "rope_scaling" && rope_type(obj).is_none() {
                    bail!("rope_scaling {obj} is not supported (only default RoPE)");
                }
                if let Some(t) = get_f64(obj, "rope_theta")? {
                    theta.get_or_insert(t);
                }
                if let Some(f) = get_f64(obj, "partial_rotary_factor")? {
                    if f != 1.0 {
                        bail!("{key}: partial_rotary_factor {f} is not supported");
                    }
                }
            }
            Some(other) => bail!("'{key}' must be an object, got {other}"),
        }
    }
    let n_heads = req_usize(v, "num_attention_heads")?;
    let file_kv = get_usize(v, "num_key_value_heads")?.unwrap_or(n_heads);
    let d_model = req_usize(v, "hidden_size")?;
    if n_heads == 0 || file_kv == 0 || n_heads % file_kv != 0 {
        bail!("num_key_value_heads {file_kv} does not divide num_attention_heads {n_heads}");
    }
    // DiffLlama with an odd kv count: the loader duplicates every kv head (module docs).
    let n_kv_heads = if family == Family::DiffV1 && file_kv % 2 == 1 { 2 * file_kv } else { file_kv };
    // transformers' defaults: DiffLlamaConfig 1e-5, LlamaConfig 1e-6.
    let default_eps = if family == Family::DiffV1 { 1e-5 } else { 1e-6 };
    // diff-v2 exports keep the engine's RoPE style (written as `rope_style`).
    let rope_style = match v.get("rope_style").and_then(Value::as_str) {
        None if family != Family::DiffV2 => RopeStyle::RotateHalf,
        Some("rotate_half") => RopeStyle::RotateHalf,
        Some("interleaved") if family == Family::DiffV2 => RopeStyle::Interleaved,
        None => bail!("missing 'rope_style' (interleaved or rotate_half)"),
        Some(other) => bail!("rope_style '{other}' is not supported for model_type '{model_type}'"),
    };
    let eps = get_f64(v, "rms_norm_eps")?.unwrap_or(default_eps);
    let cfg = ModelConfig {
        family,
        vocab_size: req_usize(v, "vocab_size")?,
        d_model,
        n_layers: req_usize(v, "num_hidden_layers")?,
        n_heads,
        n_kv_heads,
        head_dim: get_usize(v, "head_dim")?,
        d_ff: req_usize(v, "intermediate_size")?,
        max_seq_len: get_usize(v, "max_position_embeddings")?.unwrap_or(2048),
        rope_theta: theta.unwrap_or(10000.0),
        rope_style,
        head_pairing: HeadPairing::Halves,
        subln: true,
        subln_affine: false,
        lambda_std: get_f64(v, "lambda_std_dev")?.unwrap_or(0.1),
        tie_embeddings: get_bool(v, "tie_word_embeddings")?.unwrap_or(false),
        norm_eps: eps,
        subln_eps: eps,
        init_std: get_f64(v, "initializer_range")?.unwrap_or(0.02),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The safetensors files of a HF folder: the index's shards (checked to exist) or the single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(HF_INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let value: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| anyhow!("{} has no 'weight_map' object", index.display()))?;
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| anyhow!("{}: weight_map entry '{name}' is not a file name", index.display()))?;
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        files.sort();
        let mut paths = Vec::with_capacity(files.len());
        for f in files {
            let p = dir.join(&f);
            if !p.is_file() {
                bail!("missing shard {} (listed in {})", p.display(), index.display());
            }
            paths.push(p);
        }
        if paths.is_empty() {
            bail!("{}: weight_map is empty", index.display());
        }
        return Ok(paths);
    }
    let single = dir.join(HF_WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    if dir.join("pytorch_model.bin").is_file() {
        bail!(
            "{} holds pytorch_model.bin: only safetensors checkpoints are supported (re-save with safe_serialization=True)",
            dir.display()
        );
    }
    bail!("{} has neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}", dir.display())
}

/// Reads every tensor of one safetensors file as f32, naming file and tensor in errors.
fn read_f32_tensors(path: &Path, device: &Device) -> Result<Vec<(String, Tensor)>> {
    use safetensors::Dtype as S;
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{} is not a valid safetensors file (truncated or corrupt?): {e}", path.display()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            S::F32 => DType::F32,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::F64 => DType::F64,
            other => bail!(
                "{}: tensor '{name}' has unsupported dtype {other:?} (expected F32, F16, BF16 or F64)",
                path.display()
            ),
        };
        let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)
            .and_then(|t| t.to_dtype(DType::F32))
            .with_context(|| format!("{}: cannot read tensor '{name}'", path.display()))?;
        out.push((name, t));
    }
    Ok(out)
}

/// Repeats every head of `w` ([heads·d, D]) twice: rows of head m go to heads 2m and 2m+1.
fn duplicate_heads(w: &Tensor, d: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let heads = rows / d;
    Ok(w.reshape((heads, 1, d, cols))?.repeat((1, 2, 1, 1))?.reshape((2 * rows, cols))?)
}

/// Loads the weights of a HF folder as f32 tensors named and shaped as `param_specs(cfg)` expects
/// (`cfg` from `read_hf_config`). Accepts a single `model.safetensors` or a sharded index, f32/f16/
/// bf16/f64 tensors, tied embeddings with or without `lm_head.weight`; drops `rotary_emb.inv_freq`.
pub fn load_hf_weights(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<HashMap<String, Tensor>> {
    let files = weight_files(dir)?;
    let mut raw: HashMap<String, (Tensor, PathBuf)> = HashMap::new();
    for file in &files {
        for (name, t) in read_f32_tensors(file, device)? {
            if let Some((_, prev)) = raw.get(&name) {
                bail!("tensor '{name}' is in both {} and {}", prev.display(), file.display());
            }
            raw.insert(name, (t, file.clone()));
        }
    }
    raw.retain(|name, _| !name.ends_with("rotary_emb.inv_freq"));
    if cfg.tie_embeddings {
        raw.remove("lm_head.weight");
    }
    let d = cfg.head_dim();
    let mut weights = HashMap::with_capacity(raw.len());
    for spec in param_specs(cfg) {
        let (mut t, file) = raw.remove(&spec.name).ok_or_else(|| {
            anyhow!(
                "{}: tensor '{}' (shape {:?}) is missing from {}",
                dir.display(),
                spec.name,
                spec.shape,
                files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
            )
        })?;
        let is_kv = spec.name.ends_with("self_attn.k_proj.weight") || spec.name.ends_with("self_attn.v_proj.weight");
        if cfg.family == Family::DiffV1
            && is_kv
            && (cfg.n_kv_heads / 2) % 2 == 1
            && t.dims() == [cfg.n_kv_heads / 2 * d, cfg.d_model]
        {
            t = duplicate_heads(&t, d).with_context(|| format!("{}: tensor '{}'", file.display(), spec.name))?;
        }
        if t.dims() != spec.shape.as_slice() {
            bail!(
                "{}: tensor '{}' has shape {:?}, but config.json implies {:?}",
                file.display(),
                spec.name,
                t.dims(),
                spec.shape
            );
        }
        weights.insert(spec.name, t);
    }
    if let Some((name, (_, file))) = raw.iter().min_by(|a, b| a.0.cmp(b.0)) {
        bail!(
            "{}: unexpected tensor '{name}' for a {} model with this config.json",
            file.display(),
            match cfg.family {
                Family::DiffV1 => "DiffLlama",
                Family::Baseline => "Llama",
                Family::DiffV2 => "difftx diff-v2",
            }
        );
    }
    Ok(weights)
}

/// Reads config and weights of a HF folder in one go.
pub fn load_hf_model(dir: &Path, device: &Device) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let cfg = read_hf_config(dir)?;
    let weights = load_hf_weights(dir, &cfg, device)?;
    Ok((cfg, weights))
}

/// Heads `2j, 2j+1` -> `j, j + count/2` for w: [count·d, D].
fn interleaved_to_halves(w: &Tensor, count: usize, d: usize) -> Result<Tensor> {
    let cols = w.dim(1)?;
    Ok(w.reshape((count / 2, 2, d, cols))?.transpose(0, 1)?.contiguous()?.reshape((count * d, cols))?)
}

/// Within each head of w: [heads·d, D], row `2i` -> `i`, `2i+1` -> `i + d/2`.
fn interleaved_to_rotate_half(w: &Tensor, d: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    Ok(w.reshape((rows / d, d / 2, 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// Heads `j, j + count/2` -> `2j, 2j+1` for w: [count·d, D] (the inverse of `interleaved_to_halves`).
pub(crate) fn halves_to_interleaved(w: &Tensor, count: usize, d: usize) -> Result<Tensor> {
    let cols = w.dim(1)?;
    Ok(w.reshape((2, count / 2, d, cols))?.transpose(0, 1)?.contiguous()?.reshape((count * d, cols))?)
}

/// Within each head of w: [heads·d, D], row `i` -> `2i`, `i + d/2` -> `2i+1` (the inverse of
/// `interleaved_to_rotate_half`).
pub(crate) fn rotate_half_to_interleaved(w: &Tensor, d: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    Ok(w.reshape((rows / d, 2, d / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// DiffLlama always applies the sub-layer norm: the `subln: false` ablation has no HF form.
fn check_subln_exportable(cfg: &ModelConfig) -> Result<()> {
    if cfg.family == Family::DiffV1 && !cfg.subln {
        bail!(
            "cannot export: this diff-v1 model has no sub-layer norm (subln: false), which DiffLlama cannot represent"
        );
    }
    Ok(())
}

/// The HF `config.json` for an engine config (accepted by transformers 4.x and 5.x).
pub fn hf_config_json(cfg: &ModelConfig) -> Result<Value> {
    let (arch, model_type) = match cfg.family {
        Family::DiffV1 => ("DiffLlamaForCausalLM", "diffllama"),
        Family::Baseline => ("LlamaForCausalLM", "llama"),
        Family::DiffV2 => ("DifftxDiffV2ForCausalLM", DIFF_V2_MODEL_TYPE),
    };
    check_subln_exportable(cfg)?;
    let mut v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "use_cache": true,
        "bos_token_id": null,
        "eos_token_id": null,
        "pad_token_id": null,
        "torch_dtype": "float32",
        "dtype": "float32",
    });
    let obj = v.as_object_mut().expect("object");
    match cfg.family {
        Family::DiffV1 => {
            obj.insert("lambda_std_dev".into(), json!(cfg.lambda_std));
        }
        Family::DiffV2 => {
            obj.insert(
                "auto_map".into(),
                json!({
                    "AutoConfig": "configuration_difftx_diff_v2.DifftxDiffV2Config",
                    "AutoModelForCausalLM": "modeling_difftx_diff_v2.DifftxDiffV2ForCausalLM",
                }),
            );
            let style = if cfg.rope_style == RopeStyle::Interleaved { "interleaved" } else { "rotate_half" };
            obj.insert("rope_style".into(), json!(style));
            obj.insert("difftx_remote_code_version".into(), json!(DIFF_V2_REMOTE_CODE_VERSION));
            // HF's default RoPE parameters would be read as rotate-half by generic tools.
            obj.remove("rope_parameters");
        }
        Family::Baseline => {
            obj.insert("mlp_bias".into(), json!(false));
            obj.insert("pretraining_tp".into(), json!(1));
        }
    }
    Ok(v)
}

/// Converts native weights to HF names and layouts (module docs); f32, `lm_head` omitted when tied.
pub fn to_hf_weights(cfg: &ModelConfig, weights: &HashMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    cfg.validate()?;
    check_subln_exportable(cfg)?;
    if cfg.family == Family::DiffV1 && cfg.subln_eps != cfg.norm_eps {
        bail!(
            "cannot export: subln_eps {} differs from norm_eps {} (DiffLlama uses rms_norm_eps for both)",
            cfg.subln_eps,
            cfg.norm_eps
        );
    }
    let d = cfg.head_dim();
    let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
        let t = weights.get(name).ok_or_else(|| anyhow!("cannot export: weight '{name}' is missing"))?;
        if t.dims() != shape {
            bail!("cannot export: weight '{name}' has shape {:?}, the config expects {shape:?}", t.dims());
        }
        Ok(t.to_dtype(DType::F32)?)
    };
    let mut out = BTreeMap::new();
    for spec in param_specs(cfg) {
        let name = spec.name.as_str();
        if name.ends_with(".self_attn.subln.weight") {
            continue; // folded into o_proj below
        }
        let mut t = get(name, &spec.shape)?;
        let heads = if name.ends_with(".self_attn.q_proj.weight") {
            Some(cfg.n_heads)
        } else if name.ends_with(".self_attn.k_proj.weight") || name.ends_with(".self_attn.v_proj.weight") {
            Some(cfg.n_kv_heads)
        } else {
            None
        };
        // diff-v2's remote code uses the engine's own layout: nothing to permute.
        if let Some(count) = heads.filter(|_| cfg.family != Family::DiffV2) {
            if cfg.family == Family::DiffV1 && cfg.head_pairing == HeadPairing::Interleaved {
                t = interleaved_to_halves(&t, count, d)?;
            }
            if cfg.rope_style == RopeStyle::Interleaved && !name.ends_with(".v_proj.weight") {
                t = interleaved_to_rotate_half(&t, d)?;
            }
        }
        if cfg.family == Family::DiffV1 && cfg.subln_affine && name.ends_with(".self_attn.o_proj.weight") {
            let gain_name = name.replace(".o_proj.weight", ".subln.weight");
            let gain = get(&gain_name, &[2 * d])?;
            // Column block of head j is [2jd, 2jd + 2d): scale column 2jd + c by g[c].
            let cols = gain.repeat(cfg.n_heads / 2)?.reshape((1, cfg.n_heads * d))?;
            t = t.broadcast_mul(&cols)?;
        }
        out.insert(spec.name, t);
    }
    Ok(out)
}

/// Writes a HF folder (`config.json`, `model.safetensors`) for a diff-v1 (DiffLlama), baseline
/// (Llama) or diff-v2 model (with its remote code). Errors for diff-v1 without the sub-layer norm
/// (`subln: false`) and for diff-v1 with `subln_eps != norm_eps`.
pub fn export_hf(cfg: &ModelConfig, weights: &HashMap<String, Tensor>, out_dir: &Path) -> Result<()> {
    let config = hf_config_json(cfg)?;
    let tensors = to_hf_weights(cfg, weights)?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
        .context("cannot serialise the exported weights")?;
    write_atomic(&out_dir.join(HF_WEIGHTS_FILE), &bytes)?;
    if cfg.family == Family::DiffV2 {
        for (file, code) in DIFF_V2_REMOTE_CODE {
            write_atomic(&out_dir.join(file), code.as_bytes())?;
        }
    }
    write_atomic(&out_dir.join(CONFIG_FILE), serde_json::to_string_pretty(&config)?.as_bytes())?;
    Ok(())
}
