//! Model folders on disk: `config.json` + `model.safetensors` (+ a tokenizer, written by
//! `tokenizer`). Files are written atomically (temporary file, fsync, rename) so that a crash
//! never leaves a half-written file under a real name.
//!
//! A training run keeps its latest checkpoint in `RUN/checkpoint/`; `resolve_model_dir` accepts
//! either a model folder or a run folder.

use crate::config::ModelConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Sub-folder of a training run that holds its latest checkpoint.
pub const RUN_CHECKPOINT: &str = "checkpoint";
/// Where the previous checkpoint sits during the swap to a new one.
pub const RUN_CHECKPOINT_OLD: &str = "checkpoint.old";

/// The native `config.json`: a format tag plus the model config.
#[derive(Debug, Serialize, Deserialize)]
pub struct NativeConfigFile {
    pub format: String,
    pub model: ModelConfig,
}

pub const NATIVE_FORMAT: &str = "difftx-v1";

/// Writes `bytes` to `path` atomically: temp file in the same folder, fsync, rename, fsync folder.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().context("write_atomic: path has no file name")?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    sync_dir(dir);
    Ok(())
}

/// fsync a directory so a rename inside it is durable (best effort: not every FS supports it).
pub fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Serialises named tensors to safetensors bytes (sorted by name).
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut sorted: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    Ok(safetensors::serialize(sorted, None)?)
}

/// Reads every tensor of a safetensors file, with errors naming the file.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    candle_core::safetensors::load_buffer(&bytes, device)
        .with_context(|| format!("{} is not a valid safetensors file (truncated or corrupt?)", path.display()))
}

/// Saves config and weights into `dir` (created if needed).
pub fn save_model(dir: &Path, cfg: &ModelConfig, weights: &[(String, Tensor)]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let file = NativeConfigFile { format: NATIVE_FORMAT.into(), model: cfg.clone() };
    write_atomic(&dir.join(CONFIG_FILE), serde_json::to_string_pretty(&file)?.as_bytes())?;
    write_atomic(&dir.join(WEIGHTS_FILE), &safetensors_bytes(weights)?)?;
    Ok(())
}

/// The folder that actually holds a model: `dir` itself, or a training run's latest checkpoint.
pub fn resolve_model_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.exists() {
        bail!("model folder {} does not exist", dir.display());
    }
    for cand in [dir.to_path_buf(), dir.join(RUN_CHECKPOINT), dir.join(RUN_CHECKPOINT_OLD)] {
        if cand.join(CONFIG_FILE).is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "{} holds no model: expected {} (or a training run's {}/{})",
        dir.display(),
        CONFIG_FILE,
        RUN_CHECKPOINT,
        CONFIG_FILE
    )
}

/// Reads a native config.json.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    if value.get("model_type").is_some() {
        // A Hugging Face folder (DiffLlama / Llama): mapped onto the engine's config.
        return crate::hf::read_hf_config(dir);
    }
    if crate::official::is_official_config(&value) {
        return crate::official::config_from_official_json(&value).with_context(|| format!("{}", path.display()));
    }
    let file: NativeConfigFile =
        serde_json::from_value(value).with_context(|| format!("{} is not a difftx model config", path.display()))?;
    if file.format != NATIVE_FORMAT {
        bail!("{}: unknown format '{}' (expected {NATIVE_FORMAT})", path.display(), file.format);
    }
    file.model.validate().with_context(|| path.display().to_string())?;
    Ok(file.model)
}

/// Whether `dir/config.json` is an official Diff-Transformer layout (`official.rs`).
fn is_official_dir(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| crate::official::is_official_config(&v))
}

/// Loads config and weights (converted to `dtype`) from a model or run folder.
pub fn load_model(dir: &Path, dtype: DType, device: &Device) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let dir = resolve_model_dir(dir)?;
    if crate::hf::is_hf_dir(&dir) {
        let (cfg, raw) = crate::hf::load_hf_model(&dir, device)?;
        let mut weights = HashMap::with_capacity(raw.len());
        for (name, t) in raw {
            let t = t.to_dtype(dtype).with_context(|| format!("tensor '{name}': cannot convert to {dtype:?}"))?;
            weights.insert(name, t);
        }
        return Ok((cfg, weights));
    }
    let cfg = read_config(&dir)?;
    if is_official_dir(&dir) {
        let raw = crate::official::load_official_weights(&dir, &cfg, device)?;
        let mut weights = HashMap::with_capacity(raw.len());
        for (name, t) in raw {
            weights.insert(name, t.to_dtype(dtype)?);
        }
        return Ok((cfg, weights));
    }
    let raw = read_safetensors(&dir.join(WEIGHTS_FILE), device)?;
    let mut weights = HashMap::with_capacity(raw.len());
    for (name, t) in raw {
        let t = t.to_dtype(dtype).with_context(|| format!("tensor '{name}': cannot convert to {dtype:?}"))?;
        weights.insert(name, t);
    }
    let expected: std::collections::HashSet<String> =
        crate::model::param_specs(&cfg).into_iter().map(|s| s.name).collect();
    if let Some(extra) = weights.keys().find(|k| !expected.contains(*k)) {
        bail!(
            "{}: tensor '{extra}' does not belong to a {} model with this config (checkpoint of another family or shape?)",
            dir.join(WEIGHTS_FILE).display(),
            cfg.family
        );
    }
    Ok((cfg, weights))
}

/// Loads a ready-to-run model.
pub fn load_runnable(dir: &Path, device: &Device) -> Result<crate::model::Model> {
    let (cfg, weights) = load_model(dir, DType::F32, device)?;
    crate::model::Model::from_weights(&cfg, &weights)
        .with_context(|| format!("{}: weights do not fit the config", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;

    #[test]
    fn save_load_round_trip_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        for family in Family::ALL {
            let mut cfg = ModelConfig::preset("tiny", family).unwrap();
            cfg.n_layers = 2;
            cfg.tie_embeddings = family == Family::DiffV2;
            let weights = crate::model::init_weights(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
            let path = dir.path().join(family.as_str());
            save_model(&path, &cfg, &weights).unwrap();
            let (cfg2, loaded) = load_model(&path, DType::F32, &Device::Cpu).unwrap();
            assert_eq!(cfg, cfg2);
            assert_eq!(loaded.len(), weights.len());
            for (name, t) in &weights {
                let diff = (t - &loaded[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(diff, 0.0, "{family} {name}");
            }
            // No temporary files are left behind.
            let names: Vec<String> = std::fs::read_dir(&path)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        }
    }

    #[test]
    fn run_folder_falls_back_to_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::preset("tiny", Family::DiffV1).unwrap();
        let weights = crate::model::init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        // A kill between the two renames of a checkpoint swap leaves only checkpoint.old.
        save_model(&dir.path().join(RUN_CHECKPOINT_OLD), &cfg, &weights).unwrap();
        assert_eq!(resolve_model_dir(dir.path()).unwrap(), dir.path().join(RUN_CHECKPOINT_OLD));
        save_model(&dir.path().join(RUN_CHECKPOINT), &cfg, &weights).unwrap();
        assert_eq!(resolve_model_dir(dir.path()).unwrap(), dir.path().join(RUN_CHECKPOINT));
        let err = resolve_model_dir(&dir.path().join("nope")).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
    }
}
