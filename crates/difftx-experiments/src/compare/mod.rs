//! `difftx compare`: trains parameter-matched model families ("arms": baseline, diff-v1, diff-v2,
//! and the ablation diff-v1-nonorm) on the same mixture with the same seeds and budget, runs
//! every instrument on each, and writes a report folder:
//!
//! - `runs/ARM-seedN/` training runs (metrics.jsonl, checkpoint/) and `analysis/` per run;
//!   with `--sizes`, also `runs/ARM-dD-seedN/` (other widths, trained for the loss only)
//! - `mixture.jsonl` (the exact training documents) and `mixture.json` (how they were made)
//! - `report.md`, `report.json` and plots (see [`report`])
//!
//! The work is planned as independent runs (train, then analyse) executed by `jobs` workers
//! side by side, each with its own thread pool; one progress bar with an ETA covers it all.
//! How claims are judged is in [`report`]; the claims themselves in [`claims`].

pub mod claims;
pub mod report;

use crate::attention::{run_attention, AttentionOptions};
use crate::icl::{run_icl, IclOptions};
use crate::mixture::{build_mixture, read_corpus, MixtureSpec};
use crate::needle::{run_needle, NeedleOptions};
use crate::outliers::{run_outliers, OutliersOptions};
use crate::quantize::{run_quantize, QuantizeOptions};
use crate::recall::{run_recall, RecallOptions};
use anyhow::{bail, Context, Result};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_train::data::{TokenDataset, WindowStart};
use difftx_train::optim::{AdamWParams, Decay};
use difftx_train::trainer::{self, train_new, RunControl, TrainOptions};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// Training budget per model (the same for every arm and seed).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Budget {
    /// Optimizer steps per model.
    Steps(usize),
    /// Wall-clock seconds of training in all. Converted to one step budget for every model before
    /// training (`steps_for_seconds`): equal tokens per arm and width, and a full warmup +
    /// cosine schedule.
    Seconds(f64),
}

impl std::str::FromStr for Budget {
    type Err = String;
    /// `300` or `300steps` = steps per model; `90s`, `15m`, `1h` = total training time.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        let bad = || format!("invalid budget '{s}' (expected steps like 300, or a time like 90s, 15m, 1h)");
        let num = |x: &str| x.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
        if let Some(x) = t.strip_suffix("steps") {
            return x.trim().parse::<usize>().map(Budget::Steps).map_err(|_| bad());
        }
        for (suffix, mul) in [("s", 1.0), ("m", 60.0), ("h", 3600.0)] {
            if let Some(x) = t.strip_suffix(suffix) {
                return num(x).map(|v| Budget::Seconds(v * mul)).ok_or_else(bad);
            }
        }
        t.parse::<usize>().map(Budget::Steps).map_err(|_| bad())
    }
}

/// One arm of the comparison: a family, possibly with an ablation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Arm {
    pub name: String,
    pub family: Family,
    /// diff-v1's per-head sub-layer norm (false: the paper's "without GroupNorm" ablation).
    pub subln: bool,
}

impl Arm {
    pub fn of(family: Family) -> Self {
        Arm { name: family.as_str().into(), family, subln: true }
    }
    pub fn is_baseline(&self) -> bool {
        self.family == Family::Baseline
    }
    /// The arm's model: the preset's shape (width `d_model` when given, heads kept), its family,
    /// context `seq_len`.
    pub fn config(&self, preset: &str, seq_len: usize, d_model: Option<usize>) -> Result<ModelConfig> {
        let mut cfg = ModelConfig::preset(preset, self.family).map_err(|e| anyhow::anyhow!("compare: {e}"))?;
        cfg.max_seq_len = seq_len;
        cfg.subln = self.subln;
        if let Some(d) = d_model {
            cfg.d_model = d;
            cfg.d_ff = difftx_core::config::swiglu_width(d);
            cfg.init_std = difftx_core::config::preset_init_std(d);
        }
        cfg.validate().map_err(|e| anyhow::anyhow!("compare: arm {} at width {}: {e}", self.name, cfg.d_model))?;
        Ok(cfg)
    }
}

impl std::str::FromStr for Arm {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "diff-v1-nonorm" {
            return Ok(Arm { name: s.into(), family: Family::DiffV1, subln: false });
        }
        s.parse::<Family>()
            .map(Arm::of)
            .map_err(|e| format!("{e}; or diff-v1-nonorm (diff-v1 without its per-head norm, the paper's ablation)"))
    }
}

pub struct CompareOptions {
    pub seeds: usize,
    pub budget: Budget,
    /// A ~1-minute smoke run: 2 seeds, a few steps, minimal instrument settings (overrides
    /// seeds, budget, batch, sequence length and instrument options).
    pub quick: bool,
    pub arms: Vec<Arm>,
    /// Model preset (parameter-matched across families by construction).
    pub preset: String,
    /// Extra model widths (d_model) for the parameter-efficiency fit; the preset's width is
    /// always included. Empty: one size.
    pub sizes: Vec<usize>,
    /// Real text of the mixture; None = the bundled corpus.
    pub data: Option<PathBuf>,
    pub mixture: MixtureSpec,
    pub out: PathBuf,
    /// Training sequence length; also the models' context (max_seq_len).
    pub seq_len: usize,
    pub batch_size: usize,
    pub lr: f64,
    /// Runs trained side by side (0: one per core). Each gets cores / jobs threads.
    pub jobs: usize,
    pub needle: NeedleOptions,
    pub recall: RecallOptions,
    pub attention: AttentionOptions,
    pub icl: IclOptions,
    /// Tokens of evaluation text for the outlier and quantisation instruments.
    pub eval_tokens: usize,
    /// Show the progress bar (otherwise one line per finished run).
    pub progress: bool,
}

/// Default steps per model: 2,400 steps × 8 × 256 = 4.9M tokens per model with the nano preset,
/// a budget at which the baseline learns every retrieval and in-context task partially
/// (docs/compare/calibration.md), sized so the default compare (9 models, two at a time, then
/// every instrument) stays near 30 minutes on 2 cores (docs/compare/README.md).
pub const DEFAULT_STEPS: usize = 2400;

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions {
            seeds: 3,
            budget: Budget::Steps(DEFAULT_STEPS),
            quick: false,
            arms: Family::ALL.iter().map(|&f| Arm::of(f)).collect(),
            preset: "nano".into(),
            sizes: Vec::new(),
            data: None,
            mixture: MixtureSpec::default(),
            out: PathBuf::from("runs/compare"),
            seq_len: 256,
            batch_size: 8,
            lr: 3e-3,
            jobs: 0,
            needle: NeedleOptions { trials: 3, ..Default::default() },
            recall: RecallOptions::default(),
            attention: AttentionOptions { trials: 3, ..Default::default() },
            icl: IclOptions { orders: 8, episodes: 8, queries: 12, ..Default::default() },
            eval_tokens: 4096,
            progress: false,
        }
    }
}

/// What `run_compare` produced.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub out: PathBuf,
    pub report_md: PathBuf,
    pub report_json: serde_json::Value,
    pub wall_secs: f64,
}

/// Settings after `quick` and the defaults are applied: what every run and the report use.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub preset: String,
    pub arms: Vec<Arm>,
    pub seeds: usize,
    pub budget: Budget,
    /// The seconds of a `--budget` given as a time, once converted to steps in `budget`.
    pub budget_seconds: Option<f64>,
    pub quick: bool,
    pub seq_len: usize,
    pub batch_size: usize,
    pub lr: f64,
    /// The preset's width first, then the extra sizes.
    pub widths: Vec<usize>,
    pub mixture: MixtureSpec,
    /// The mixture holds about `windows × seq_len` characters: one epoch at the step budget.
    pub windows: usize,
    /// The real-text documents of the validation split, for the loss on real text (filled by
    /// `run_compare` once the mixture is built).
    #[serde(skip)]
    pub text_eval: Vec<String>,
    pub needle: NeedleOptions,
    pub recall: RecallOptions,
    pub attention: AttentionOptions,
    pub icl: IclOptions,
    pub eval_tokens: usize,
    pub jobs: usize,
    pub threads_per_job: usize,
}

/// One planned training run.
#[derive(Debug, Clone)]
struct Plan {
    arm: Arm,
    seed: usize,
    width: usize,
    /// The preset's width: analysed by every instrument; other widths only give their loss.
    main: bool,
    dir: PathBuf,
    topts: TrainOptions,
}

/// A finished run and what the instruments measured on it.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub arm: Arm,
    pub seed: usize,
    pub width: usize,
    pub main: bool,
    pub dir: PathBuf,
    pub params: usize,
    /// instrument name -> JSON ("train" holds final_val_loss, tokens, tokens_per_sec)
    pub results: BTreeMap<String, serde_json::Value>,
    /// (tokens, train loss) and (tokens, validation loss)
    pub train_curve: Vec<(f64, f64)>,
    pub val_curve: Vec<(f64, f64)>,
    /// Trained by an earlier invocation (its training time is not in this one's wall time).
    pub reused: bool,
}

impl RunResult {
    /// A number from an instrument's JSON (NaN when absent or not a number).
    pub fn value(&self, instrument: &str, pointer: &str) -> f64 {
        self.results.get(instrument).and_then(|v| v.pointer(pointer)).and_then(|v| v.as_f64()).unwrap_or(f64::NAN)
    }
}

fn resolve_settings(opts: &CompareOptions) -> Result<Settings> {
    let quick = opts.quick;
    let seeds = if quick { 2 } else { opts.seeds };
    if seeds == 0 {
        bail!("compare: --seeds must be at least 1");
    }
    let mut arms: Vec<Arm> = Vec::new();
    for a in &opts.arms {
        if !arms.contains(a) {
            arms.push(a.clone());
        }
    }
    if arms.is_empty() {
        bail!("compare: no families to train");
    }
    let budget = if quick { Budget::Steps(4) } else { opts.budget };
    if let Budget::Steps(s) = budget {
        if s < 2 {
            bail!("compare: a budget of {s} step(s) is too small to train (need at least 2)");
        }
    }
    let (seq_len, batch_size) = if quick { (128, 2) } else { (opts.seq_len, opts.batch_size) };
    let base = ModelConfig::preset(&opts.preset, Family::Baseline).map_err(|e| anyhow::anyhow!("compare: {e}"))?;
    let mut widths = vec![base.d_model];
    for &w in &opts.sizes {
        if !widths.contains(&w) {
            widths.push(w);
        }
    }
    let mut mixture = opts.mixture.clone();
    mixture.doc_chars = seq_len;
    mixture.validate()?;
    let needle = if quick {
        NeedleOptions {
            sweeps: vec![(1, 1), (2, 2), (6, 2)],
            depths: vec![0.0, 100.0],
            trials: 1,
            ..opts.needle.clone()
        }
    } else {
        opts.needle.clone()
    };
    let needle = NeedleOptions { pairs: mixture.pairs, ..needle };
    let recall = RecallOptions {
        pairs: mixture.pairs,
        filler: mixture.recall_filler,
        documents: if quick { 2 } else { opts.recall.documents },
        ..opts.recall.clone()
    };
    let attention = if quick {
        AttentionOptions { depths: vec![0.0, 50.0, 100.0], trials: 1, ..opts.attention.clone() }
    } else {
        opts.attention.clone()
    };
    let attention = AttentionOptions { pairs: mixture.pairs, ..attention };
    let icl = if quick {
        IclOptions { shots: 4, orders: 3, episodes: 1, queries: 4, ..opts.icl.clone() }
    } else {
        opts.icl.clone()
    };
    let icl = IclOptions { letters_per_class: mixture.icl_letters, ..icl };
    let steps_for_docs = match budget {
        Budget::Steps(s) => s,
        Budget::Seconds(_) => 4 * DEFAULT_STEPS,
    };
    // quick: 400 windows, enough that the validation split holds real text for the text loss
    let windows = if quick { 400 } else { (steps_for_docs.min(100_000) * batch_size).clamp(2000, 100_000) };
    let runs = arms.len() * seeds * widths.len();
    // The cores difftx may use: RAYON_NUM_THREADS (the CLI sets it to all cores unless the user
    // chose), else all cores.
    let cores = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let jobs = if opts.jobs == 0 { cores.min(runs) } else { opts.jobs.min(runs) }.max(1);
    let threads_per_job = (cores / jobs).max(1);
    if let Budget::Seconds(t) = budget {
        let per = t * jobs as f64 / runs as f64;
        if per.is_nan() || per < 5.0 {
            bail!("compare: a budget of {t} seconds is too small to train {runs} models (need at least 5 s each)");
        }
    }
    Ok(Settings {
        preset: opts.preset.clone(),
        arms,
        seeds,
        budget,
        budget_seconds: None,
        quick,
        seq_len,
        batch_size,
        lr: opts.lr,
        widths,
        mixture,
        windows,
        text_eval: Vec::new(),
        needle,
        recall,
        attention,
        icl,
        eval_tokens: if quick { 512 } else { opts.eval_tokens },
        jobs,
        threads_per_job,
    })
}

/// The run folder of an arm, seed and width (the preset's width keeps the short name).
fn run_dir(out: &Path, arm: &Arm, seed: usize, width: usize, main: bool) -> PathBuf {
    let name = if main { format!("{}-seed{seed}", arm.name) } else { format!("{}-d{width}-seed{seed}", arm.name) };
    out.join("runs").join(name)
}

fn plan_runs(s: &Settings, out: &Path, data: &Path) -> Result<Vec<Plan>> {
    let Budget::Steps(steps) = s.budget else {
        bail!("compare: a budget in seconds must be converted to steps before the runs are planned");
    };
    let mut plans = Vec::new();
    // Seeds outermost, so the first finished runs already pair every arm.
    for seed in 0..s.seeds {
        for (wi, &width) in s.widths.iter().enumerate() {
            for arm in &s.arms {
                let main = wi == 0;
                let model = arm.config(&s.preset, s.seq_len, if main { None } else { Some(width) })?;
                let topts = TrainOptions {
                    model,
                    data: data.to_path_buf(),
                    jsonl_field: "text".into(),
                    tokenizer: None,
                    steps,
                    batch_size: s.batch_size,
                    seq_len: s.seq_len,
                    grad_accum: 1,
                    lr: s.lr,
                    min_lr_ratio: 0.1,
                    warmup_steps: (steps / 10).clamp(1, 50),
                    decay: Decay::Cosine,
                    adamw: AdamWParams { weight_decay: 0.1, ..Default::default() },
                    grad_clip: 1.0,
                    eval_every: (steps / 12).max(1),
                    eval_batches: if s.quick { 1 } else { 4 },
                    checkpoint_every: usize::MAX,
                    log_every: 1,
                    seed: 1000 + seed as u64,
                    val_fraction: VAL_FRACTION,
                    windows: WindowStart::DocumentStart,
                    init: None,
                };
                let dir = run_dir(out, arm, seed, width, main);
                plans.push(Plan { arm: arm.clone(), seed, width, main, dir, topts });
            }
        }
    }
    Ok(plans)
}

type Curve = Vec<(f64, f64)>;

fn read_curves(dir: &Path) -> Result<(Curve, Curve)> {
    let p = dir.join(trainer::METRICS_FILE);
    let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let (mut tr, mut va) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let t = v["tokens"].as_f64().unwrap_or(0.0);
        if let Some(l) = v["loss"].as_f64() {
            tr.push((t, l));
        }
        if let Some(l) = v["val_loss"].as_f64() {
            va.push((t, l));
        }
    }
    Ok((tr, va))
}

/// Refuses a run folder that holds an unfinished run or one trained with other settings.
fn check_reusable(p: &Plan) -> Result<bool> {
    if !p.dir.join(trainer::TRAIN_CONFIG_FILE).exists() {
        return Ok(false);
    }
    let done = p.dir.join(difftx_core::checkpoint::RUN_CHECKPOINT).join(trainer::TRAINER_STATE_FILE);
    if !done.exists() {
        bail!("compare: {} holds an unfinished run; remove it or choose another --out", p.dir.display());
    }
    let old = serde_json::to_value(trainer::read_options(&p.dir)?)?;
    let new = serde_json::to_value(&p.topts)?;
    if !differing_fields(&old, &new, "").is_empty() {
        bail!(
            "compare: {} holds a run with different settings ({}); remove it or choose another --out",
            p.dir.display(),
            differing_fields(&old, &new, "").join(", ")
        );
    }
    Ok(true)
}

/// The fields (`model.d_ff: 64 there, 96 now`) that differ between two JSON objects. Numbers
/// equal to 1e-12 relative count as equal: serde_json's default float parsing can return a
/// neighbouring f64 of the one written (1/√32 came back one ulp off), which must not make a
/// finished run unusable.
pub fn differing_fields(a: &serde_json::Value, b: &serde_json::Value, prefix: &str) -> Vec<String> {
    if let (true, Some(x), Some(y)) = (a.is_f64() && b.is_f64(), a.as_f64(), b.as_f64()) {
        if (x - y).abs() <= 1e-12 * x.abs().max(y.abs()) {
            return Vec::new();
        }
    }
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter()
                .flat_map(|k| {
                    let null = serde_json::Value::Null;
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    differing_fields(x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null), &path)
                })
                .collect()
        }
        _ if a != b => vec![format!("{prefix}: {a} there, {b} now")],
        _ => Vec::new(),
    }
}

/// Every instrument on one run (the outputs go to `analysis/`).
fn analyse(dir: &Path, s: &Settings) -> Result<Vec<(String, serde_json::Value)>> {
    let an = dir.join("analysis");
    let mut out = vec![
        ("needle".to_string(), run_needle(dir, &s.needle, &an)?),
        ("recall".to_string(), run_recall(dir, &s.recall, &an)?),
        ("attention".to_string(), run_attention(dir, &s.attention, &an)?),
        ("icl".to_string(), run_icl(dir, &s.icl, &an)?),
    ];
    let outliers = OutliersOptions { max_tokens: s.eval_tokens, ..Default::default() };
    out.push(("outliers".into(), run_outliers(dir, &outliers, &an)?));
    let quant = QuantizeOptions {
        max_tokens: s.eval_tokens,
        logit_bits: vec![16, 8, 6, 4],
        weight_bits: vec![8, 4],
        weight_groups: vec![None],
        wa_bits: vec![8, 4],
        wa_group: None,
        ..Default::default()
    };
    let mut q = run_quantize(dir, &quant, &an)?;
    // Settings by name, so claims need not know the order of the results.
    let by_setting: serde_json::Map<String, serde_json::Value> = q["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| Some((r["setting"].as_str()?.to_string(), r["delta"].clone())))
        .collect();
    q["delta_by_setting"] = serde_json::Value::Object(by_setting);
    out.push(("quantize".into(), q));
    Ok(out)
}

/// Share of the mixture's token stream held out for validation (the last part of the stream).
const VAL_FRACTION: f64 = 0.05;

/// The real-text documents lying wholly in the validation split of `docs` (the last
/// `val_fraction` of the stream `TokenDataset::build` makes, one byte a token): the text the loss
/// on real text is measured on. Text documents are the only kind without a newline. They are
/// slices of the same corpus as the training text documents, so held out as windows, not as text.
pub fn validation_text_documents(docs: &[String], val_fraction: f64) -> Vec<String> {
    let total: usize = docs.iter().map(|d| d.len() + 1).sum::<usize>().saturating_sub(1);
    let val_len = (total as f64 * val_fraction).ceil() as usize;
    let mut seen = 0;
    let mut out = Vec::new();
    for d in docs.iter().rev() {
        if seen + d.len() > val_len {
            break;
        }
        if !d.contains('\n') {
            out.push(d.clone());
        }
        // the newline that separates it from the document before
        seen += d.len() + 1;
    }
    out.reverse();
    out
}

/// Mean next-token loss of the run's final checkpoint on `texts` (each followed by the newline
/// that ends a document in training), in windows of `seq_len`; NaN when there is too little text
/// for one window (e.g. a mixture without real text).
fn text_validation_loss(dir: &Path, texts: &[String], seq_len: usize) -> Result<f64> {
    let texts: Vec<String> = texts.iter().map(|t| format!("{t}\n")).collect();
    if texts.iter().map(|t| t.len()).sum::<usize>() < seq_len + 1 {
        return Ok(f64::NAN);
    }
    let (model, tok, _) = crate::common::load_model_and_tokenizer(dir)?;
    Ok(difftx_train::eval::evaluate_text(&model, &tok, &texts, seq_len, 8, 8)?.loss)
}

/// Trains (or reuses) and analyses one planned run.
fn execute(
    p: &Plan,
    s: &Settings,
    tok: &Tokenizer,
    ds: &TokenDataset,
    bar: &indicatif::ProgressBar,
) -> Result<RunResult> {
    let reused = check_reusable(p)?;
    if reused {
        say(bar, format!("compare: reusing the finished run in {}", p.dir.display()));
        bar.inc(p.topts.steps as u64);
    } else {
        let ctl = RunControl { overall: Some(bar.clone()), ..Default::default() };
        train_new(&p.dir, &p.topts, tok, ds, &ctl)?;
    }
    let (train_curve, val_curve) = read_curves(&p.dir)?;
    let final_val = val_curve.last().map(|x| x.1).unwrap_or(f64::NAN);
    let tokens = train_curve.last().map(|x| x.0).unwrap_or(0.0);
    let tps = std::fs::read_to_string(p.dir.join(trainer::METRICS_FILE)).ok().and_then(|t| {
        t.lines().rev().find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["tokens_per_sec"].as_f64())
    });
    let text_loss = text_validation_loss(&p.dir, &s.text_eval, s.seq_len)?;
    let mut results = BTreeMap::new();
    results.insert(
        "train".to_string(),
        serde_json::json!({"final_val_loss": final_val, "text_loss": text_loss, "tokens": tokens, "tokens_per_sec": tps}),
    );
    if p.main {
        bar.set_message(format!("analysing {}", p.dir.file_name().unwrap_or_default().to_string_lossy()));
        results.extend(analyse(&p.dir, s).with_context(|| format!("analysing {}", p.dir.display()))?);
    }
    bar.inc(analysis_units(p));
    Ok(RunResult {
        arm: p.arm.clone(),
        seed: p.seed,
        width: p.width,
        main: p.main,
        dir: p.dir.clone(),
        params: p.topts.model.param_counts().total,
        results,
        train_curve,
        val_curve,
        reused,
    })
}

/// A line above the progress bar, or on stderr when there is no bar (not a terminal).
fn say(bar: &indicatif::ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

/// Progress units of a run's analysis: an estimate in training steps (the instruments take
/// about a fifth of the default training time of a main run).
fn analysis_units(p: &Plan) -> u64 {
    if p.main {
        (p.topts.steps.min(DEFAULT_STEPS) / 5).max(1) as u64
    } else {
        0
    }
}

/// Runs `plans` on `jobs` workers, each in its own rayon pool of `threads` threads.
fn execute_all(
    plans: &[Plan],
    s: &Settings,
    tok: &Tokenizer,
    ds: &TokenDataset,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<RunResult>> {
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Option<RunResult>>> = Mutex::new(vec![None; plans.len()]);
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..s.jobs {
            scope.spawn(|| {
                let pool = match rayon::ThreadPoolBuilder::new().num_threads(s.threads_per_job).build() {
                    Ok(p) => p,
                    Err(e) => {
                        *failure.lock().unwrap() = Some(anyhow::anyhow!("compare: cannot start a worker: {e}"));
                        return;
                    }
                };
                loop {
                    if failure.lock().unwrap().is_some() {
                        return;
                    }
                    let i = {
                        let mut n = next.lock().unwrap();
                        let i = *n;
                        *n += 1;
                        i
                    };
                    let Some(p) = plans.get(i) else { return };
                    match pool.install(|| execute(p, s, tok, ds, bar)) {
                        Ok(r) => {
                            let fin = r.results["train"]["final_val_loss"].as_f64().unwrap_or(f64::NAN);
                            say(bar, format!("compare: finished {} (validation loss {fin:.4})", p.dir.display()));
                            results.lock().unwrap()[i] = Some(r);
                        }
                        Err(e) => {
                            let mut f = failure.lock().unwrap();
                            if f.is_none() {
                                *f = Some(e);
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap() {
        return Err(e);
    }
    Ok(results.into_inner().unwrap().into_iter().flatten().collect())
}

/// The step budget that fits `seconds` of training in all: every model gets the same number of
/// steps (equal tokens for every arm and width, a full warmup + cosine schedule), as many as the
/// slowest model fits into its share of the time (`seconds × jobs / runs`). Each (arm, width) is
/// timed on the real mixture for a few steps on `threads_per_job` threads, twice, and the
/// difference gives the time per step without the start-up. Timed alone, runs go a little faster
/// than side by side, hence a 10% margin; the wall time still varies with the machine's load.
fn steps_for_seconds(
    s: &Settings,
    out: &Path,
    data: &Path,
    tok: &Tokenizer,
    ds: &TokenDataset,
    seconds: f64,
) -> Result<usize> {
    const SHORT: usize = 2;
    const LONG: usize = 8;
    let timing_dir = out.join("budget-timing");
    let _ = std::fs::remove_dir_all(&timing_dir);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(s.threads_per_job)
        .build()
        .context("cannot start the timing runs' thread pool")?;
    let timed = |steps: usize| -> Result<Vec<f64>> {
        let one = Settings { seeds: 1, budget: Budget::Steps(steps), ..s.clone() };
        let plans = plan_runs(&one, &timing_dir.join(format!("{steps}")), data)?;
        plans
            .iter()
            .map(|p| {
                let ctl = RunControl { overall: Some(indicatif::ProgressBar::hidden()), ..Default::default() };
                let start = Instant::now();
                pool.install(|| train_new(&p.dir, &p.topts, tok, ds, &ctl))?;
                Ok(start.elapsed().as_secs_f64())
            })
            .collect()
    };
    eprintln!("compare: timing a few steps of each model to turn {seconds:.0} s into a step budget ...");
    let (short, long) = (timed(SHORT)?, timed(LONG)?);
    let _ = std::fs::remove_dir_all(&timing_dir);
    let per_step =
        short.iter().zip(&long).map(|(a, b)| (b - a) / (LONG - SHORT) as f64).fold(f64::MIN_POSITIVE, f64::max);
    let runs = s.arms.len() * s.seeds * s.widths.len();
    let per_run = seconds * s.jobs as f64 / runs as f64;
    let steps = (per_run / (1.1 * per_step)).floor() as usize;
    if steps < 10 {
        bail!(
            "compare: a budget of {seconds} s fits only {steps} steps per model ({per_step:.2} s per step for the slowest, \
             {runs} models, {} side by side); give at least {:.0} s",
            s.jobs,
            10.0 * 1.1 * per_step * runs as f64 / s.jobs as f64
        );
    }
    eprintln!(
        "compare: {seconds:.0} s of training = {steps} steps per model (slowest model {:.3} s per step)",
        per_step
    );
    Ok(steps)
}

/// Trains, analyses, aggregates and writes the report. Errors (one line) on an unknown or empty
/// arm list, a budget too small to train, unreadable data, or a run folder holding a different
/// or unfinished run.
pub fn run_compare(opts: &CompareOptions) -> Result<CompareReport> {
    let start = Instant::now();
    let mut s = resolve_settings(opts)?;
    // Data: one mixture, one dataset, shared by every run.
    let data_path = match &opts.data {
        Some(p) => p.clone(),
        None => difftx_train::data::bundled_corpus()?,
    };
    let text = read_corpus(Some(&data_path))?;
    let docs = build_mixture(&s.mixture, &text, s.windows, 1234)?;
    let tok = Tokenizer::bytes();
    let ds = TokenDataset::build(&docs, &tok, s.seq_len, VAL_FRACTION)?;
    s.text_eval = validation_text_documents(&docs, VAL_FRACTION);
    std::fs::create_dir_all(&opts.out).with_context(|| format!("cannot create {}", opts.out.display()))?;
    std::fs::write(
        opts.out.join("mixture.json"),
        serde_json::to_string_pretty(
            &serde_json::json!({"spec": s.mixture, "windows": s.windows, "seed": 1234, "text": data_path}),
        )?,
    )?;
    // The exact training documents, one JSON line each: each run's train_config.json names this
    // file, and `difftx train --resume` rebuilds the same token stream and document starts.
    let mixture_file = opts.out.join("mixture.jsonl");
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "text": d }).to_string()).collect();
    std::fs::write(&mixture_file, lines.join("\n") + "\n")
        .with_context(|| format!("cannot write {}", mixture_file.display()))?;

    if let Budget::Seconds(seconds) = s.budget {
        let steps = steps_for_seconds(&s, &opts.out, &mixture_file, &tok, &ds, seconds)?;
        s.budget = Budget::Steps(steps);
        s.budget_seconds = Some(seconds);
    }
    let plans = plan_runs(&s, &opts.out, &mixture_file)?;
    for p in &plans {
        check_reusable(p)?;
    }
    let total: u64 = plans.iter().map(|p| p.topts.steps as u64 + analysis_units(p)).sum();
    let bar = if opts.progress {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "compare {bar:30} {percent}% [{elapsed_precise}, ETA {eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    eprintln!(
        "compare: {} runs ({} arms × {} seeds × {} sizes), {} side by side with {} thread(s) each",
        plans.len(),
        s.arms.len(),
        s.seeds,
        s.widths.len(),
        s.jobs,
        s.threads_per_job
    );
    let runs = execute_all(&plans, &s, &tok, &ds, &bar)?;
    bar.finish_and_clear();
    report::write_report(&opts.out, &s, &runs, start)
}
