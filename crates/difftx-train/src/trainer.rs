//! The training loop: AdamW, schedule, clipping, accumulation, validation, metrics and atomic,
//! resumable checkpoints.
//!
//! Run folder layout (`out_dir`):
//! - `train_config.json`  the options of the run (resume reads them back)
//! - `metrics.jsonl`      one JSON object per logged step / validation
//! - `checkpoint/`        the latest checkpoint: a loadable model folder plus
//!   `optimizer.safetensors` and `trainer_state.json`
//!
//! A checkpoint is written to `checkpoint.tmp/`, fsynced, then swapped in by two renames; at every
//! instant either `checkpoint/` or `checkpoint.old/` is complete, and loaders accept both.
//! Every step's batch is drawn from an RNG seeded by (seed, step), so a resumed run sees exactly
//! the batches the uninterrupted run would have seen.

use crate::data::{TokenDataset, WindowStart};
use crate::optim::{grad_norm, AdamW, AdamWParams, Decay, Schedule};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use difftx_core::checkpoint::{self, write_atomic, RUN_CHECKPOINT, RUN_CHECKPOINT_OLD};
use difftx_core::model::{init_weights, Model};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Kernels, ModelConfig, Precision};
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const TRAIN_CONFIG_FILE: &str = "train_config.json";
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

/// Everything that defines a run; saved as `train_config.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainOptions {
    pub model: ModelConfig,
    /// Where the training text came from (for the record and for `--resume`).
    pub data: PathBuf,
    pub jsonl_field: String,
    /// tokenizer.json used, or None for bytes.
    pub tokenizer: Option<PathBuf>,
    pub steps: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup_steps: usize,
    pub decay: Decay,
    pub adamw: AdamWParams,
    pub grad_clip: f64,
    pub eval_every: usize,
    pub eval_batches: usize,
    pub checkpoint_every: usize,
    pub log_every: usize,
    pub seed: u64,
    pub val_fraction: f64,
    /// Where training windows start (document starts keep short documents whole).
    #[serde(default)]
    pub windows: WindowStart,
    /// Start from this model folder's weights (a difftx run or model, or a Hugging Face folder)
    /// instead of a random initialisation (`difftx train --init`): fine-tuning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
}

impl TrainOptions {
    pub fn schedule(&self) -> Schedule {
        Schedule {
            peak: self.lr,
            warmup: self.warmup_steps,
            total: self.steps,
            min_ratio: self.min_lr_ratio,
            decay: self.decay,
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        if self.steps == 0 || self.batch_size == 0 || self.seq_len == 0 || self.grad_accum == 0 {
            bail!("steps, batch size, sequence length and gradient accumulation must be positive");
        }
        if self.seq_len > self.model.max_seq_len {
            bail!("sequence length {} exceeds the model's context {}", self.seq_len, self.model.max_seq_len);
        }
        // Written so that NaN is rejected too.
        if !(self.lr > 0.0 && self.grad_clip >= 0.0) {
            bail!("learning rate must be positive and gradient clip non-negative");
        }
        if !(self.val_fraction > 0.0 && self.val_fraction < 0.5) {
            bail!("validation fraction must be in (0, 0.5), got {}", self.val_fraction);
        }
        Ok(())
    }
}

/// Per-run controls that are not part of the run's definition.
#[derive(Debug, Clone, Default)]
pub struct RunControl {
    /// Stop (with a checkpoint) after this many steps in this invocation.
    pub stop_after: Option<usize>,
    /// Stop (with a checkpoint) once this much wall time has passed in this invocation.
    pub time_limit_secs: Option<f64>,
    pub kernels: Kernels,
    /// Arithmetic of the linear layers' products (weights, optimizer state and checkpoints are
    /// f32 either way). Resolve it first ([`Precision::resolve`]): bf16 errors where the CPU has
    /// no backend.
    pub precision: Precision,
    /// Show a progress bar (otherwise one log line per validation).
    pub progress: bool,
    /// A bar shared by several runs (e.g. all of `compare`), advanced by one per step; when
    /// set, the per-validation log lines are not printed.
    pub overall: Option<indicatif::ProgressBar>,
}

/// Progress of a run, saved with each checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: usize,
    pub tokens_seen: u64,
    pub initial_val_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    pub elapsed_secs: f64,
}

#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub state: TrainerState,
    pub finished: bool,
    pub tokens_per_sec: f64,
}

fn batch_rng(seed: u64, step: usize) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Mean validation loss; the validation split yields at least one batch by construction.
fn evaluate(model: &Model, batches: &[crate::eval::Batch], seq_len: usize) -> Result<f64> {
    if batches.is_empty() {
        bail!("no validation batches: the validation split is shorter than one sequence");
    }
    crate::eval::mean_loss(model, batches, seq_len)
}

fn append_metric(path: &Path, value: serde_json::Value) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    writeln!(f, "{value}")?;
    Ok(())
}

/// Keeps only metric lines with step <= `step` (a resumed run re-logs what came after).
fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s as usize <= step)
        })
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    write_atomic(path, out.as_bytes())
}

/// Writes a complete checkpoint into `out_dir/checkpoint/` atomically.
fn save_checkpoint(
    out_dir: &Path,
    cfg: &ModelConfig,
    vars: &[(String, Var)],
    opt: &AdamW,
    tok: &Tokenizer,
    state: &TrainerState,
) -> Result<()> {
    let tmp = out_dir.join("checkpoint.tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    let weights: Vec<(String, Tensor)> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    checkpoint::save_model(&tmp, cfg, &weights)?;
    tok.save_to_model_dir(&tmp)?;
    write_atomic(&tmp.join(OPTIMIZER_FILE), &checkpoint::safetensors_bytes(&opt.state_tensors()?)?)?;
    write_atomic(&tmp.join(TRAINER_STATE_FILE), serde_json::to_string_pretty(state)?.as_bytes())?;
    checkpoint::sync_dir(&tmp);
    let (cur, old) = (out_dir.join(RUN_CHECKPOINT), out_dir.join(RUN_CHECKPOINT_OLD));
    if cur.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old)?;
        }
        std::fs::rename(&cur, &old)?;
    }
    std::fs::rename(&tmp, &cur)?;
    checkpoint::sync_dir(out_dir);
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// Starts a new run in `out_dir` (which must not hold a run already).
pub fn train_new(
    out_dir: &Path,
    opts: &TrainOptions,
    tok: &Tokenizer,
    ds: &TokenDataset,
    ctl: &RunControl,
) -> Result<TrainSummary> {
    opts.validate()?;
    if out_dir.join(TRAIN_CONFIG_FILE).exists() {
        bail!(
            "{} already holds a training run: use --resume to continue it, or choose another --out",
            out_dir.display()
        );
    }
    if tok.vocab_size() > opts.model.vocab_size {
        bail!("tokenizer has {} tokens but the model's vocabulary is {}", tok.vocab_size(), opts.model.vocab_size);
    }
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    write_atomic(&out_dir.join(TRAIN_CONFIG_FILE), serde_json::to_string_pretty(opts)?.as_bytes())?;
    let _ = std::fs::remove_file(out_dir.join(METRICS_FILE));
    let weights = match &opts.init {
        None => init_weights(&opts.model, opts.seed, DType::F32, &Device::Cpu)?,
        Some(dir) => initial_weights_from(dir, &opts.model)?,
    };
    crate::on_pool(|| run(out_dir, opts, tok, ds, ctl, weights, None, TrainerState::default()))
}

/// The weights of the model folder `dir`, in parameter order, checked to have `model`'s shapes.
fn initial_weights_from(dir: &Path, model: &ModelConfig) -> Result<Vec<(String, Tensor)>> {
    let (cfg, mut weights) = difftx_core::checkpoint::load_model(dir, DType::F32, &Device::Cpu)
        .with_context(|| format!("cannot start from {}", dir.display()))?;
    let shapes = |c: &ModelConfig| -> Vec<(String, Vec<usize>)> {
        difftx_core::model::param_specs(c).into_iter().map(|p| (p.name, p.shape)).collect()
    };
    if shapes(&cfg) != shapes(model) || cfg.family != model.family {
        bail!(
            "{} holds a {} model of another shape than this run's {} model: --init takes the model's own config",
            dir.display(),
            cfg.family,
            model.family
        );
    }
    difftx_core::model::param_specs(model)
        .into_iter()
        .map(|spec| {
            let t = weights
                .remove(&spec.name)
                .with_context(|| format!("{}: weight '{}' is missing", dir.display(), spec.name))?;
            Ok((spec.name, t))
        })
        .collect()
}

/// Reads a run's saved options.
pub fn read_options(out_dir: &Path) -> Result<TrainOptions> {
    let path = out_dir.join(TRAIN_CONFIG_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{} is not a training run (no {TRAIN_CONFIG_FILE})", out_dir.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a valid training config", path.display()))
}

/// Continues the run in `out_dir` from its latest checkpoint.
pub fn train_resume(out_dir: &Path, tok: &Tokenizer, ds: &TokenDataset, ctl: &RunControl) -> Result<TrainSummary> {
    let opts = read_options(out_dir)?;
    let dir = checkpoint::resolve_model_dir(out_dir)
        .with_context(|| format!("{} has no checkpoint to resume from", out_dir.display()))?;
    let (cfg, weights) = checkpoint::load_model(&dir, DType::F32, &Device::Cpu)?;
    if cfg != opts.model {
        bail!("checkpoint in {} does not match the run's model config (another family or shape)", dir.display());
    }
    let state: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(dir.join(TRAINER_STATE_FILE))
            .with_context(|| format!("{} lacks {TRAINER_STATE_FILE}", dir.display()))?,
    )?;
    let opt_state = checkpoint::read_safetensors(&dir.join(OPTIMIZER_FILE), &Device::Cpu)?;
    let mut ordered = Vec::new();
    for spec in difftx_core::model::param_specs(&cfg) {
        let t = weights.get(&spec.name).with_context(|| format!("checkpoint lacks '{}'", spec.name))?;
        ordered.push((spec.name, t.clone()));
    }
    truncate_metrics(&out_dir.join(METRICS_FILE), state.step)?;
    crate::on_pool(|| run(out_dir, &opts, tok, ds, ctl, ordered, Some(opt_state), state))
}

#[allow(clippy::too_many_arguments)]
fn run(
    out_dir: &Path,
    opts: &TrainOptions,
    tok: &Tokenizer,
    ds: &TokenDataset,
    ctl: &RunControl,
    weights: Vec<(String, Tensor)>,
    opt_state: Option<HashMap<String, Tensor>>,
    mut state: TrainerState,
) -> Result<TrainSummary> {
    let cfg = &opts.model;
    let vars: Vec<(String, Var)> =
        weights.iter().map(|(n, t)| Ok((n.clone(), Var::from_tensor(t)?))).collect::<Result<_>>()?;
    let map: HashMap<String, Tensor> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let mut model = Model::from_weights(cfg, &map)?;
    model.opts.kernels = ctl.kernels;
    model.opts.precision = ctl.precision;
    let mut opt = AdamW::new(&vars, opts.adamw)?;
    if let Some(s) = &opt_state {
        opt.load_state(s)?;
        if opt.step_count() != state.step {
            bail!("optimizer state is at step {} but the trainer state at {}", opt.step_count(), state.step);
        }
    }
    let metrics = out_dir.join(METRICS_FILE);
    let val = ds.val_batches(opts.batch_size, opts.seq_len, opts.eval_batches);
    if state.step == 0 && state.initial_val_loss.is_none() {
        let v = evaluate(&model, &val, opts.seq_len)?;
        state.initial_val_loss = Some(v);
        state.last_val_loss = Some(v);
        append_metric(&metrics, serde_json::json!({"step": 0, "tokens": 0, "val_loss": v}))?;
    }
    let schedule = opts.schedule();
    let tokens_per_step = (opts.batch_size * opts.seq_len * opts.grad_accum) as u64;
    let start = Instant::now();
    let start_step = state.step;
    let elapsed_before = state.elapsed_secs;
    let bar = if ctl.progress {
        let b = indicatif::ProgressBar::new(opts.steps as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_position(state.step as u64);
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let dev = Device::Cpu;
    let mut finished = true;
    while state.step < opts.steps {
        let step = state.step;
        if ctl.stop_after.is_some_and(|n| step - start_step >= n)
            || ctl.time_limit_secs.is_some_and(|t| start.elapsed().as_secs_f64() >= t)
        {
            finished = false;
            break;
        }
        let lr = schedule.lr(step);
        let mut rng = batch_rng(opts.seed, step);
        let mut grads: Option<candle_core::backprop::GradStore> = None;
        let mut loss_sum = 0.0;
        for _ in 0..opts.grad_accum {
            let (x, y) = ds.sample_batch(opts.batch_size, opts.seq_len, opts.windows, &mut rng);
            let xs = Tensor::from_vec(x, (opts.batch_size, opts.seq_len), &dev)?;
            let ys = Tensor::from_vec(y, (opts.batch_size, opts.seq_len), &dev)?;
            let loss = Model::loss(&model.forward(&xs, None)?, &ys)?;
            let l = loss.to_scalar::<f32>()? as f64;
            if !l.is_finite() {
                bar.abandon();
                bail!(
                    "loss became {l} at step {step}: training stopped; the last good checkpoint is in {} (try a lower --lr)",
                    out_dir.join(RUN_CHECKPOINT).display()
                );
            }
            loss_sum += l;
            let g = loss.backward()?;
            grads = Some(match grads {
                None => g,
                Some(mut acc) => {
                    for (_, var) in &vars {
                        if let Some(gi) = g.get(var.as_tensor()) {
                            let sum = match acc.get(var.as_tensor()) {
                                Some(a) => (a + gi)?,
                                None => gi.clone(),
                            };
                            acc.insert(var.as_tensor(), sum);
                        }
                    }
                    acc
                }
            });
        }
        let grads = grads.expect("grad_accum >= 1");
        let accum = opts.grad_accum as f64;
        let norm = grad_norm(&grads, &vars)? / accum;
        if !norm.is_finite() {
            bar.abandon();
            bail!(
                "gradient norm became {norm} at step {step}: training stopped; the last good checkpoint is in {}",
                out_dir.join(RUN_CHECKPOINT).display()
            );
        }
        let clip = if opts.grad_clip > 0.0 && norm > opts.grad_clip { opts.grad_clip / norm } else { 1.0 };
        opt.step_scaled(&grads, lr, clip / accum)?;
        state.step += 1;
        state.tokens_seen += tokens_per_step;
        let secs = start.elapsed().as_secs_f64();
        state.elapsed_secs = elapsed_before + secs;
        let tps = (state.step - start_step) as f64 * tokens_per_step as f64 / secs.max(1e-9);
        let loss = loss_sum / accum;
        if state.step.is_multiple_of(opts.log_every.max(1)) || state.step == opts.steps {
            append_metric(
                &metrics,
                serde_json::json!({"step": state.step, "tokens": state.tokens_seen, "loss": loss, "lr": lr,
                    "grad_norm": norm, "tokens_per_sec": tps, "elapsed_secs": state.elapsed_secs}),
            )?;
        }
        if state.step.is_multiple_of(opts.eval_every.max(1)) || state.step == opts.steps {
            let v = evaluate(&model, &val, opts.seq_len)?;
            state.last_val_loss = Some(v);
            append_metric(
                &metrics,
                serde_json::json!({"step": state.step, "tokens": state.tokens_seen, "val_loss": v}),
            )?;
            if !ctl.progress && ctl.overall.is_none() {
                eprintln!("step {}/{} loss {loss:.4} val {v:.4} {tps:.0} tok/s", state.step, opts.steps);
            }
        }
        if let Some(o) = &ctl.overall {
            o.inc(1);
        }
        bar.set_position(state.step as u64);
        bar.set_message(format!("loss {loss:.4} lr {lr:.2e} {tps:.0} tok/s"));
        if state.step.is_multiple_of(opts.checkpoint_every.max(1)) && state.step < opts.steps {
            save_checkpoint(out_dir, cfg, &vars, &opt, tok, &state)?;
        }
    }
    if !finished && state.last_val_loss.is_some() {
        // Record where we stopped so the summary reflects the model on disk.
        let v = evaluate(&model, &val, opts.seq_len)?;
        state.last_val_loss = Some(v);
    }
    save_checkpoint(out_dir, cfg, &vars, &opt, tok, &state)?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    Ok(TrainSummary {
        tokens_per_sec: (state.step - start_step) as f64 * tokens_per_step as f64 / secs.max(1e-9),
        state,
        finished,
    })
}
