//! The official Diff-Transformer layout: export of diff-v1 models for the authors' own
//! `MultiheadDiffAttn` (microsoft/unilm, Diff-Transformer), and import back.
//!
//! The official module holds, per layer, `q_proj`, `k_proj`, `v_proj`, `out_proj`, `lambda_q1`,
//! `lambda_k1`, `lambda_q2`, `lambda_k2` and `subln` (RMSNorm over 2d with a gain, eps 1e-5); it
//! pairs query heads `(2j, 2j+1)`, rotates interleaved pairs, views the value of head `j` as
//! `[v_2j | v_2j+1]`, and takes `num_heads = H/2`, `num_kv_heads = H_kv/2`, `head_dim = D/H`,
//! `λ_init = 0.8 − 0.6·exp(−0.3·depth)`. That is the engine's native diff-v1 layout
//! (docs/design.md §3), so the export renames `o_proj` to `out_proj` and converts only models in
//! another layout (an imported DiffLlama: halves pairing, rotate-half RoPE, no gain → unit gain).
//! The repository defines no whole model, so everything outside attention keeps the engine's
//! (Llama's) names. config.json carries `"format": "diff-transformer-official"` and the
//! module's constructor arguments.
//!
//! Refused, because the official module would compute something else: GQA with `H_kv < H` (its
//! `repeat_kv` gives both maps of a pair the same kv head; docs/design.md §1.5), `subln: false`,
//! a sub-layer-norm eps other than 1e-5, and a head dim other than D/H.

use crate::checkpoint::{write_atomic, CONFIG_FILE, WEIGHTS_FILE};
use crate::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use crate::hf::{halves_to_interleaved, rotate_half_to_interleaved};
use crate::model::param_specs;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// `format` of an official-layout folder's config.json.
pub const OFFICIAL_FORMAT: &str = "diff-transformer-official";
/// The sub-layer norm's eps, fixed in the official module.
const OFFICIAL_SUBLN_EPS: f64 = 1e-5;

/// Whether a parsed config.json is an official-layout one.
pub fn is_official_config(v: &Value) -> bool {
    v.get("format").and_then(Value::as_str) == Some(OFFICIAL_FORMAT)
}

fn check_exportable(cfg: &ModelConfig) -> Result<()> {
    if cfg.family != Family::DiffV1 {
        bail!("the official layout is diff-v1's (the paper's MultiheadDiffAttn); this model is {}", cfg.family);
    }
    if !cfg.subln {
        bail!("cannot export to the official layout: the model has no sub-layer norm (subln: false), which MultiheadDiffAttn always applies");
    }
    if cfg.n_kv_heads != cfg.n_heads {
        bail!(
            "cannot export to the official layout: GQA ({} kv heads for {} heads) is paired differently by the official repeat_kv (docs/design.md §1.5); only kv heads = heads exports exactly",
            cfg.n_kv_heads,
            cfg.n_heads
        );
    }
    if cfg.head_dim() * cfg.n_heads != cfg.d_model {
        bail!(
            "cannot export to the official layout: head dim {} is not D/H = {}",
            cfg.head_dim(),
            cfg.d_model / cfg.n_heads
        );
    }
    if (cfg.subln_eps - OFFICIAL_SUBLN_EPS).abs() > 1e-12 {
        bail!("cannot export to the official layout: subln_eps {} (the official module fixes 1e-5)", cfg.subln_eps);
    }
    Ok(())
}

/// The official config.json for a diff-v1 config.
pub fn official_config_json(cfg: &ModelConfig) -> Result<Value> {
    check_exportable(cfg)?;
    Ok(json!({
        "format": OFFICIAL_FORMAT,
        "attention": "MultiheadDiffAttn (microsoft/unilm Diff-Transformer/multihead_diffattn.py)",
        "embed_dim": cfg.d_model,
        "num_heads": cfg.n_heads / 2,
        "num_kv_heads": null,
        "head_dim": cfg.head_dim(),
        "num_layers": cfg.n_layers,
        "lambda_init": (0..cfg.n_layers).map(ModelConfig::lambda_init).collect::<Vec<_>>(),
        "subln_eps": OFFICIAL_SUBLN_EPS,
        "vocab_size": cfg.vocab_size,
        "ffn_dim": cfg.d_ff,
        "max_seq_len": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope": "interleaved",
        "rms_norm_eps": cfg.norm_eps,
        "tie_embeddings": cfg.tie_embeddings,
        "lambda_std": cfg.lambda_std,
        "init_std": cfg.init_std,
    }))
}

/// The engine config of an official-layout config.json.
pub fn config_from_official_json(v: &Value) -> Result<ModelConfig> {
    let num = |key: &str| -> Result<f64> {
        v.get(key).and_then(Value::as_f64).ok_or_else(|| anyhow!("missing or non-numeric '{key}'"))
    };
    let int = |key: &str| -> Result<usize> {
        v.get(key).and_then(Value::as_u64).map(|n| n as usize).ok_or_else(|| anyhow!("missing or non-integer '{key}'"))
    };
    if !matches!(v.get("num_kv_heads"), None | Some(Value::Null)) {
        bail!("num_kv_heads must be null: GQA is not exported to the official layout");
    }
    let half_heads = int("num_heads")?;
    let cfg = ModelConfig {
        family: Family::DiffV1,
        vocab_size: int("vocab_size")?,
        d_model: int("embed_dim")?,
        n_layers: int("num_layers")?,
        n_heads: 2 * half_heads,
        n_kv_heads: 2 * half_heads,
        head_dim: Some(int("head_dim")?),
        d_ff: int("ffn_dim")?,
        max_seq_len: int("max_seq_len")?,
        rope_theta: num("rope_theta")?,
        rope_style: RopeStyle::Interleaved,
        head_pairing: HeadPairing::Interleaved,
        subln: true,
        subln_affine: true,
        lambda_std: num("lambda_std").unwrap_or(0.1),
        tie_embeddings: v.get("tie_embeddings").and_then(Value::as_bool).unwrap_or(false),
        norm_eps: num("rms_norm_eps")?,
        subln_eps: num("subln_eps")?,
        init_std: num("init_std").unwrap_or(0.02),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Native weights in the official layout and names (`o_proj` -> `out_proj`); `lm_head` omitted
/// when tied.
pub fn to_official_weights(cfg: &ModelConfig, weights: &HashMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    check_exportable(cfg)?;
    let d = cfg.head_dim();
    let mut out = BTreeMap::new();
    for spec in param_specs(cfg) {
        let name = spec.name.as_str();
        let mut t = weights
            .get(name)
            .ok_or_else(|| anyhow!("cannot export: weight '{name}' is missing"))?
            .to_dtype(DType::F32)?;
        let heads = if name.ends_with(".self_attn.q_proj.weight") || name.ends_with(".self_attn.k_proj.weight") {
            Some(true)
        } else if name.ends_with(".self_attn.v_proj.weight") {
            Some(false)
        } else {
            None
        };
        if let Some(rotated) = heads {
            if cfg.head_pairing == HeadPairing::Halves {
                t = halves_to_interleaved(&t, cfg.n_heads, d)?;
            }
            if rotated && cfg.rope_style == RopeStyle::RotateHalf {
                t = rotate_half_to_interleaved(&t, d)?;
            }
        }
        out.insert(name.replace(".self_attn.o_proj.", ".self_attn.out_proj."), t);
    }
    // A model without a gain gets the official module's unit gain.
    if !cfg.subln_affine {
        for l in 0..cfg.n_layers {
            out.insert(
                format!("model.layers.{l}.self_attn.subln.weight"),
                Tensor::ones(2 * d, DType::F32, &Device::Cpu)?,
            );
        }
    }
    Ok(out)
}

/// Writes an official-layout folder (config.json, model.safetensors) for a diff-v1 model.
pub fn export_official(cfg: &ModelConfig, weights: &HashMap<String, Tensor>, out_dir: &Path) -> Result<()> {
    let config = official_config_json(cfg)?;
    let tensors = to_official_weights(cfg, weights)?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None)
        .context("cannot serialise the exported weights")?;
    write_atomic(&out_dir.join(WEIGHTS_FILE), &bytes)?;
    write_atomic(&out_dir.join(CONFIG_FILE), serde_json::to_string_pretty(&config)?.as_bytes())?;
    Ok(())
}

/// Reads an official-layout folder's weights under the engine's names.
pub fn load_official_weights(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<HashMap<String, Tensor>> {
    let path = dir.join(WEIGHTS_FILE);
    let mut raw = crate::checkpoint::read_safetensors(&path, device)?;
    let mut weights = HashMap::new();
    for spec in param_specs(cfg) {
        let file_name = spec.name.replace(".self_attn.o_proj.", ".self_attn.out_proj.");
        let t = raw.remove(&file_name).ok_or_else(|| anyhow!("{}: tensor '{file_name}' is missing", path.display()))?;
        if t.dims() != spec.shape.as_slice() {
            bail!(
                "{}: tensor '{file_name}' has shape {:?}, config.json implies {:?}",
                path.display(),
                t.dims(),
                spec.shape
            );
        }
        weights.insert(spec.name, t);
    }
    if let Some(extra) = raw.keys().min() {
        bail!("{}: unexpected tensor '{extra}' for this config.json", path.display());
    }
    Ok(weights)
}
