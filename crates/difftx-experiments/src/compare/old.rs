//! `difftx compare`: trains parameter-matched baseline, diff-v1 and diff-v2 models (one preset,
//! one family each) on the same mixture with the same seeds and budget, runs every instrument on
//! each, aggregates over seeds and writes a report folder:
//!
//! - `runs/FAMILY-seedN/` training runs (metrics.jsonl, checkpoint/) and `analysis/` per run
//! - `report.md`, `report.json`
//! - `loss_curves.png`, `needle_heatmaps.png`, `attention_bars.png`, `icl_spread.png`
//!
//! Every claim is judged on paired per-seed differences (family − baseline): the 95% Student-t CI
//! of the difference excludes zero in the paper's direction → reproduced; in the other direction
//! → not reproduced; includes zero → inconclusive ("no effect at this scale").
//!
//! Instruments owned elsewhere (outliers, quantization) plug in through
//! [`CompareOptions::extra_instruments`]: a closure `(model_dir, out_dir) -> JSON` plus the claims
//! to read from that JSON (JSON pointers).

use crate::attention::{draw_bars, run_attention, AttentionOptions};
use crate::icl::{draw_spread, run_icl, IclOptions};
use crate::mixture::{build_mixture, read_corpus, MixtureSpec};
use crate::needle::{draw_heatmaps, run_needle, sweep_panels, NeedleOptions};
use crate::stats::{paired_differences, summarize, verdict, Direction, Summary, Verdict};
use anyhow::{bail, Context, Result};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_train::data::TokenDataset;
use difftx_train::optim::{AdamWParams, Decay};
use difftx_train::trainer::{train_new, RunControl, TrainOptions};
use plotters::prelude::*;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Training budget per model (the same for every family and seed).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Budget {
    /// Optimizer steps per model.
    Steps(usize),
    /// Wall-clock seconds of training in all, split evenly over the models (families × seeds);
    /// steps then differ between families (slower attention trains fewer tokens; the loss curves
    /// are against tokens).
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

/// An instrument `compare` does not own: run on `(model_dir, out_dir)`, returning its JSON.
pub type InstrumentFn = Box<dyn Fn(&Path, &Path) -> Result<serde_json::Value> + Send + Sync>;

/// A number to compare across families, read from an instrument's JSON by a JSON pointer.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimSpec {
    pub id: String,
    pub title: String,
    /// What the paper reports (free text, with its numbers).
    pub paper: String,
    /// JSON pointer into the instrument's result, e.g. "/mean_accuracy".
    pub pointer: String,
    /// The paper's sign of (differential − baseline).
    pub direction: Direction,
}

/// Hook for other developers' instruments (outliers, quantization): the lead fills these in.
pub struct ExtraInstrument {
    pub name: String,
    pub run: InstrumentFn,
    pub claims: Vec<ClaimSpec>,
}

pub struct CompareOptions {
    pub seeds: usize,
    pub budget: Budget,
    /// A ~1-minute smoke run: 2 seeds, a few steps, minimal instrument settings (overrides
    /// seeds, budget, batch, sequence length and instrument options).
    pub quick: bool,
    pub families: Vec<Family>,
    /// Model preset (parameter-matched across families by construction).
    pub preset: String,
    /// Real text of the mixture; None = the bundled corpus.
    pub data: Option<PathBuf>,
    pub mixture: MixtureSpec,
    pub out: PathBuf,
    /// Training sequence length; also the models' context (max_seq_len).
    pub seq_len: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub needle: NeedleOptions,
    pub recall: crate::recall::RecallOptions,
    pub attention: AttentionOptions,
    pub icl: IclOptions,
    pub extra_instruments: Vec<ExtraInstrument>,
}

/// Default steps per model, sized for ~15 minutes on 2 idle cores with the tiny preset:
/// 900 steps × 8 × 256 tokens = 1.8M tokens per model. Measured: the default run with 350 steps
/// took 6.8 minutes on 2 cores (the tiny preset trains at ~16–22k tokens/s at this shape with the
/// fused kernels; instruments take ~1.5 minutes), so 900 steps is about 15 minutes in all. On a
/// loaded machine it takes proportionally longer; `--budget 15m` bounds the training time instead.
pub const DEFAULT_STEPS: usize = 900;

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions {
            seeds: 3,
            budget: Budget::Steps(DEFAULT_STEPS),
            quick: false,
            families: Family::ALL.to_vec(),
            preset: "tiny".into(),
            data: None,
            mixture: MixtureSpec::default(),
            out: PathBuf::from("runs/compare"),
            seq_len: 256,
            batch_size: 8,
            lr: 2e-3,
            needle: NeedleOptions { trials: 3, ..Default::default() },
            recall: Default::default(),
            attention: AttentionOptions { trials: 3, ..Default::default() },
            icl: IclOptions { classes: 4, orders: 8, episodes: 3, queries: 8, ..Default::default() },
            extra_instruments: Vec::new(),
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

/// The paper's claims our instruments measure. Numbers are those of the Differential Transformer
/// paper (3B models, 4K context) as transcribed here; check them against the paper.
fn builtin_claims(sweeps: &[(usize, usize)]) -> Vec<(String, ClaimSpec)> {
    let c = |inst: &str, id: &str, title: &str, paper: &str, pointer: &str, direction| {
        (inst.to_string(), ClaimSpec { id: id.into(), title: title.into(), paper: paper.into(), pointer: pointer.into(), direction })
    };
    let mut v = vec![
        c("train", "val_loss", "Validation loss at equal tokens (lower is better)", "diff reaches the baseline's loss with ~65% of the parameters or training tokens, i.e. lower loss at equal budget", "/final_val_loss", Direction::Lower),
        c("needle", "needle_all", "Multi-needle retrieval accuracy, all sweeps", "higher for diff at every N/R", "/mean_accuracy", Direction::Higher),
    ];
    // The paper's table of multi-needle accuracy (baseline, diff) by (N, R).
    const PAPER_NEEDLE: [((usize, usize), &str); 4] = [
        ((1, 1), "baseline 1.00, diff 1.00"),
        ((2, 2), "baseline 0.85, diff 0.92"),
        ((4, 2), "baseline 0.62, diff 0.84"),
        ((6, 2), "baseline 0.55, diff 0.85"),
    ];
    for (i, &(n, r)) in sweeps.iter().enumerate() {
        let paper = PAPER_NEEDLE.iter().find(|x| x.0 == (n, r)).map(|x| x.1).unwrap_or("not in the paper's table; higher for diff expected");
        v.push(c("needle", &format!("needle_n{n}r{r}"), &format!("Needle accuracy N={n}, R={r}"), paper, &format!("/sweeps/{i}/mean_accuracy"), Direction::Higher));
    }
    v.push(c("recall", "recall_all", "Associative recall accuracy (MQAR), all pair counts", "not a paper experiment; the paper's retrieval claims predict higher for diff", "/mean_accuracy", Direction::Higher));
    v.extend([
        c("attention", "attn_answer", "Attention mass on the answer span", "baseline ≈0.03–0.09, diff ≈0.27–0.40 (by depth)", "/mean_answer_mass", Direction::Higher),
        c("attention", "attn_share", "Answer span's share of context attention, answer / (answer + noise)", "baseline ≈0.06–0.15, diff ≈0.93–0.98 (from the masses above)", "/mean_answer_share", Direction::Higher),
        c("attention", "attn_noise", "Attention mass on the noise context", "baseline ≈0.49–0.54, diff ≈0.01–0.02 (by depth)", "/mean_noise_mass", Direction::Lower),
        c("icl", "icl_acc", "In-context classification accuracy (mean over orders)", "higher for diff", "/mean_accuracy", Direction::Higher),
        c("icl", "icl_margin", "Best − worst accuracy over demonstration orders", "much smaller for diff (e.g. ≈19 vs ≈4 points, random order)", "/margin", Direction::Lower),
    ]);
    v
}

struct Run {
    family: Family,
    seed: usize,
    dir: PathBuf,
    /// instrument name -> JSON
    results: Vec<(String, serde_json::Value)>,
    /// (tokens, loss) and (tokens, val_loss)
    train_curve: Vec<(f64, f64)>,
    val_curve: Vec<(f64, f64)>,
}

type Curve = Vec<(f64, f64)>;

fn read_curves(dir: &Path) -> Result<(Curve, Curve)> {
    let p = dir.join(difftx_train::trainer::METRICS_FILE);
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

/// Trains, analyses, aggregates and writes the report. Errors (one line) on an unknown or empty
/// family list, a budget too small to train, unreadable data, or a run folder holding a
/// different unfinished run.
pub fn run_compare(opts: &CompareOptions) -> Result<CompareReport> {
    let start = Instant::now();
    let quick = opts.quick;
    let seeds = if quick { 2 } else { opts.seeds };
    let budget = if quick { Budget::Steps(4) } else { opts.budget };
    let (seq_len, batch) = if quick { (128, 2) } else { (opts.seq_len, opts.batch_size) };
    if seeds == 0 {
        bail!("compare: --seeds must be at least 1");
    }
    if opts.families.is_empty() {
        bail!("compare: no families to train");
    }
    let (steps, time_limit) = match budget {
        Budget::Steps(s) if s < 2 => bail!("compare: a budget of {s} step(s) is too small to train (need at least 2)"),
        Budget::Steps(s) => (s, None),
        Budget::Seconds(_) => (1_000_000, None),
    };
    let mut fams: Vec<Family> = Vec::new();
    for f in &opts.families {
        if !fams.contains(f) {
            fams.push(*f);
        }
    }
    let time_limit = match budget {
        Budget::Seconds(t) => {
            let per = t / (fams.len() * seeds) as f64;
            if per.is_nan() || per < 5.0 {
                bail!("compare: a budget of {t} seconds is too small to train {} models (need at least 5 s each)", fams.len() * seeds);
            }
            Some(per)
        }
        Budget::Steps(_) => time_limit,
    };
    let mut mixture = opts.mixture.clone();
    mixture.doc_chars = seq_len;
    let needle_opts = if quick {
        NeedleOptions { sweeps: vec![(1, 1), (2, 2), (6, 2)], depths: vec![0.0, 100.0], trials: 1, ..opts.needle.clone() }
    } else {
        opts.needle.clone()
    };
    let needle_opts = NeedleOptions { pairs: mixture.pairs, ..needle_opts };
    let recall_opts = crate::recall::RecallOptions {
        pairs: mixture.pairs,
        filler: mixture.recall_filler,
        documents: if quick { 2 } else { opts.recall.documents },
        ..opts.recall.clone()
    };
    let attn_opts = if quick { AttentionOptions { depths: vec![0.0, 50.0, 100.0], trials: 1, ..opts.attention.clone() } } else { opts.attention.clone() };
    let icl_opts = if quick { IclOptions { shots: 4, orders: 3, episodes: 1, queries: 4, ..opts.icl.clone() } } else { opts.icl.clone() };

    // Data: one mixture, one dataset, shared by every run.
    let data_path = match &opts.data {
        Some(p) => p.clone(),
        None => difftx_train::data::bundled_corpus()?,
    };
    let text = read_corpus(Some(&data_path))?;
    let tokens_needed = steps.min(100_000) * batch * seq_len;
    let n_docs = if quick { 200 } else { (tokens_needed / seq_len.max(1)).clamp(2000, 40_000) };
    let docs = build_mixture(&mixture, &text, n_docs, 1234)?;
    let tok = Tokenizer::bytes();
    let ds = TokenDataset::build(&docs, &tok, seq_len, 0.05)?;
    std::fs::create_dir_all(&opts.out).with_context(|| format!("cannot create {}", opts.out.display()))?;
    std::fs::write(
        opts.out.join("mixture.json"),
        serde_json::to_string_pretty(&serde_json::json!({"spec": mixture, "documents": n_docs, "seed": 1234, "text": data_path}))?,
    )?;
    // The exact training text, so each run's train_config.json names what it was trained on and
    // `difftx train --resume` rebuilds the same token stream (documents joined by "\n", as
    // TokenDataset::build joins separate texts).
    let mixture_text = opts.out.join("mixture.jsonl");
    let lines: Vec<String> =
        docs.iter().map(|d| serde_json::json!({ "text": d }).to_string()).collect::<Vec<_>>();
    std::fs::write(&mixture_text, lines.join("\n") + "\n")
        .with_context(|| format!("cannot write {}", mixture_text.display()))?;

    let mut runs: Vec<Run> = Vec::new();
    let mut params = serde_json::Map::new();
    for &family in &fams {
        let mut cfg = ModelConfig::preset(&opts.preset, family).map_err(|e| anyhow::anyhow!("compare: {e}"))?;
        cfg.max_seq_len = seq_len;
        params.insert(family.as_str().into(), serde_json::json!(cfg.param_counts().total));
        for seed in 0..seeds {
            let dir = opts.out.join("runs").join(format!("{}-seed{seed}", family.as_str()));
            let topts = TrainOptions {
                model: cfg.clone(),
                data: mixture_text.clone(),
                jsonl_field: "text".into(),
                tokenizer: None,
                steps,
                batch_size: batch,
                seq_len,
                grad_accum: 1,
                lr: opts.lr,
                min_lr_ratio: 0.1,
                warmup_steps: (steps / 10).clamp(1, 50),
                decay: Decay::Cosine,
                adamw: AdamWParams { weight_decay: 0.1, ..Default::default() },
                grad_clip: 1.0,
                eval_every: if time_limit.is_some() { 50 } else { (steps / 8).max(1) },
                eval_batches: if quick { 1 } else { 4 },
                checkpoint_every: usize::MAX,
                log_every: 1,
                seed: 1000 + seed as u64,
                val_fraction: 0.05,
                windows: difftx_train::data::WindowStart::DocumentStart,
            };
            let done = dir.join("checkpoint").join(difftx_train::trainer::TRAINER_STATE_FILE);
            if dir.join(difftx_train::trainer::TRAIN_CONFIG_FILE).exists() {
                if !done.exists() {
                    bail!("compare: {} holds an unfinished run; remove it or choose another --out", dir.display());
                }
                let old = difftx_train::trainer::read_options(&dir)?;
                if serde_json::to_value(&old)? != serde_json::to_value(&topts)? {
                    bail!("compare: {} holds a run with different settings (budget, batch, model or seed); remove it or choose another --out", dir.display());
                }
                eprintln!("compare: reusing the finished run in {}", dir.display());
            } else {
                eprintln!("compare: training {} seed {seed} ({} params) -> {}", family.as_str(), cfg.param_counts().total, dir.display());
                let ctl = RunControl { time_limit_secs: time_limit, ..Default::default() };
                train_new(&dir, &topts, &tok, &ds, &ctl)?;
            }
            let (train_curve, val_curve) = read_curves(&dir)?;
            let final_val = val_curve.last().map(|x| x.1).unwrap_or(f64::NAN);
            let tokens = train_curve.last().map(|x| x.0).unwrap_or(0.0);
            let tps = std::fs::read_to_string(dir.join(difftx_train::trainer::METRICS_FILE))
                .ok()
                .and_then(|t| t.lines().rev().find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["tokens_per_sec"].as_f64()));
            let mut results = vec![("train".to_string(), serde_json::json!({"final_val_loss": final_val, "tokens": tokens, "tokens_per_sec": tps}))];
            let an = dir.join("analysis");
            results.push(("needle".into(), run_needle(&dir, &needle_opts, &an)?));
            results.push(("recall".into(), crate::recall::run_recall(&dir, &recall_opts, &an)?));
            results.push(("attention".into(), run_attention(&dir, &attn_opts, &an)?));
            results.push(("icl".into(), run_icl(&dir, &icl_opts, &an)?));
            for x in &opts.extra_instruments {
                let v = (x.run)(&dir, &an).with_context(|| format!("instrument {} on {}", x.name, dir.display()))?;
                results.push((x.name.clone(), v));
            }
            runs.push(Run { family, seed, dir, results, train_curve, val_curve });
        }
    }

    // Claims.
    let mut claims = builtin_claims(&needle_opts.sweeps);
    for x in &opts.extra_instruments {
        claims.extend(x.claims.iter().map(|c| (x.name.clone(), c.clone())));
    }
    let value = |r: &Run, inst: &str, ptr: &str| -> f64 {
        r.results.iter().find(|(n, _)| n == inst).and_then(|(_, v)| v.pointer(ptr)).and_then(|v| v.as_f64()).unwrap_or(f64::NAN)
    };
    let per_family = |inst: &str, ptr: &str, f: Family| -> Vec<f64> {
        (0..seeds).map(|s| runs.iter().find(|r| r.family == f && r.seed == s).map(|r| value(r, inst, ptr)).unwrap_or(f64::NAN)).collect()
    };
    let has_base = fams.contains(&Family::Baseline);
    let mut claims_json = Vec::new();
    let mut md = String::new();
    md.push_str("# Differential Transformer vs baseline: compare report\n\n");
    md.push_str(&format!(
        "Preset `{}` (context {seq_len}), families {}, {seeds} seed(s), budget {:?}, batch {batch} × {seq_len} tokens, mixture: text {:.2} / needle {:.2} / icl {:.2} ({} documents){}.\n\n",
        opts.preset,
        fams.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(", "),
        budget,
        mixture.text_fraction,
        mixture.needle_fraction,
        mixture.icl_fraction,
        n_docs,
        if quick { " — QUICK smoke run: numbers are not meaningful" } else { "" }
    ));
    md.push_str("Parameters: ");
    md.push_str(&params.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", "));
    md.push_str("\n\nEach verdict uses paired per-seed differences (family − baseline) and their 95% Student-t CI: excludes 0 in the paper's direction → reproduced; in the opposite direction → not reproduced; includes 0 → inconclusive. Paper numbers: the paper's 3B models at 4K context, as transcribed in `compare.rs` (check against the paper).\n\n");
    for (inst, c) in &claims {
        let fam_vals: Vec<(Family, Vec<f64>, Summary)> = fams.iter().map(|&f| {
            let v = per_family(inst, &c.pointer, f);
            let s = summarize(&v);
            (f, v, s)
        }).collect();
        if fam_vals.iter().all(|(_, _, s)| s.n == 0) {
            claims_json.push(serde_json::json!({"id": c.id, "title": c.title, "instrument": inst, "note": "not measured (no finite values)"}));
            md.push_str(&format!("## {}\n\nPaper: {}. Not measured at this scale (e.g. the context is too short for this sweep).\n\n", c.title, c.paper));
            continue;
        }
        md.push_str(&format!("## {}\n\nPaper: {} (expected direction: diff {} than baseline).\n\n", c.title, c.paper, if c.direction == Direction::Higher { "higher" } else { "lower" }));
        md.push_str("| family | ours (mean ± 95% CI) | diff − baseline (mean ± 95% CI) | verdict |\n|---|---|---|---|\n");
        let base = fam_vals.iter().find(|x| x.0 == Family::Baseline).map(|x| x.1.clone());
        let mut fam_json = serde_json::Map::new();
        for (f, v, s) in &fam_vals {
            let (dtext, vtext, dj) = match (&base, *f) {
                (_, Family::Baseline) => ("—".to_string(), "reference".to_string(), serde_json::Value::Null),
                (None, _) => ("n/a".into(), "n/a (no baseline trained)".into(), serde_json::Value::Null),
                (Some(b), _) => {
                    let d = summarize(&paired_differences(v, b));
                    let vd = verdict(&d, c.direction);
                    let text = match vd {
                        Verdict::Inconclusive => "inconclusive: no effect at this scale (CI includes 0)".to_string(),
                        other => other.as_str().to_string(),
                    };
                    (d.display(4), text, serde_json::json!({"summary": d, "verdict": vd}))
                }
            };
            md.push_str(&format!("| {} | {} | {} | {} |\n", f.as_str(), s.display(4), dtext, vtext));
            fam_json.insert(f.as_str().into(), serde_json::json!({"values": v, "summary": s, "vs_baseline": dj}));
        }
        md.push('\n');
        claims_json.push(serde_json::json!({"id": c.id, "title": c.title, "instrument": inst, "paper": c.paper, "direction": c.direction, "families": fam_json}));
    }
    if !has_base {
        md.push_str("No baseline was trained, so no verdicts could be given.\n\n");
    }

    // Plots.
    plot_loss(&opts.out.join("loss_curves.png"), &runs, &fams)?;
    let mut panels = Vec::new();
    for &f in &fams {
        let fr: Vec<&Run> = runs.iter().filter(|r| r.family == f).collect();
        // mean over seeds of each cell, as a needle result to reuse the panel builder
        let Some((_, first)) = fr[0].results.iter().find(|(n, _)| n == "needle") else { continue };
        let mut mean = first.clone();
        if let Some(sweeps) = mean["sweeps"].as_array_mut() {
            for (si, sw) in sweeps.iter_mut().enumerate() {
                if let Some(rows) = sw["accuracy"].as_array_mut() {
                    for (li, row) in rows.iter_mut().enumerate() {
                        if let Some(cells) = row.as_array_mut() {
                            for (di, cell) in cells.iter_mut().enumerate() {
                                let xs: Vec<f64> = fr.iter().filter_map(|r| r.results.iter().find(|(n, _)| n == "needle")?.1["sweeps"][si]["accuracy"][li][di].as_f64()).collect();
                                *cell = if xs.is_empty() { serde_json::Value::Null } else { serde_json::json!(crate::stats::mean(&xs)) };
                            }
                        }
                    }
                }
            }
        }
        panels.extend(sweep_panels(&mean, &format!("{} ", f.as_str())));
    }
    draw_heatmaps(&opts.out.join("needle_heatmaps.png"), "needle accuracy, mean over seeds (rows: context tokens, cols: depth; grey: does not fit)", &panels, 0.0, 1.0)?;
    let bars: Vec<crate::attention::BarSeries> = fams
        .iter()
        .map(|&f| {
            let fr: Vec<&Run> = runs.iter().filter(|r| r.family == f).collect();
            let nd = attn_opts.depths.len();
            let per: Vec<(f64, f64, f64)> = (0..nd)
                .map(|di| {
                    let get = |k: &str| -> Vec<f64> { fr.iter().filter_map(|r| r.results.iter().find(|(n, _)| n == "attention")?.1["depths"][di][k].as_f64()).collect() };
                    (attn_opts.depths[di], crate::stats::mean(&get("answer_mass")), crate::stats::mean(&get("noise_mass")))
                })
                .collect();
            (f.as_str().to_string(), per)
        })
        .collect();
    draw_bars(&opts.out.join("attention_bars.png"), "attention allocation by needle depth, mean over seeds", &bars)?;
    let spread: Vec<(String, Vec<f64>)> = fams
        .iter()
        .map(|&f| {
            let xs: Vec<f64> = runs
                .iter()
                .filter(|r| r.family == f)
                .flat_map(|r| {
                    r.results.iter().find(|(n, _)| n == "icl").map(|(_, v)| {
                        v["episodes"].as_array().cloned().unwrap_or_default().iter().flat_map(|e| e["order_accuracies"].as_array().cloned().unwrap_or_default()).filter_map(|x| x.as_f64()).collect::<Vec<_>>()
                    }).unwrap_or_default()
                })
                .collect();
            (f.as_str().to_string(), xs)
        })
        .collect();
    let chance = 1.0 / icl_opts.classes.max(1) as f64;
    draw_spread(&opts.out.join("icl_spread.png"), "ICL accuracy per demonstration order (all seeds, episodes)", &spread, if icl_opts.data.is_none() { chance } else { 0.0 })?;
    md.push_str("Note on attention masses: a differential map A1 − λ·A2 has rows summing to about 1 − λ, not 1, so its raw masses are smaller than a softmax's by construction; the answer-share row compares families on the same footing.\n\n");
    md.push_str("## Plots\n\n![loss](loss_curves.png)\n\n![needle](needle_heatmaps.png)\n\n![attention](attention_bars.png)\n\n![icl](icl_spread.png)\n\n");
    md.push_str("Per-run instrument outputs (JSON and PNG) are in `runs/FAMILY-seedN/analysis/`.\n");

    let wall = start.elapsed().as_secs_f64();
    let report = serde_json::json!({
        "preset": opts.preset,
        "families": fams.iter().map(|f| f.as_str()).collect::<Vec<_>>(),
        "seeds": seeds,
        "budget": format!("{budget:?}"),
        "quick": quick,
        "seq_len": seq_len,
        "batch_size": batch,
        "mixture": mixture,
        "mixture_documents": n_docs,
        "parameters": params,
        "runs": runs.iter().map(|r| serde_json::json!({
            "family": r.family.as_str(), "seed": r.seed, "dir": r.dir.display().to_string(),
            "results": r.results.iter().map(|(n, v)| (n.clone(), v.clone())).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
        "claims": claims_json,
        "wall_secs": wall,
    });
    let md_path = opts.out.join("report.md");
    std::fs::write(&md_path, md)?;
    std::fs::write(opts.out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(CompareReport { out: opts.out.clone(), report_md: md_path, report_json: report, wall_secs: wall })
}

/// Train loss (thin, min–max band over seeds) and validation loss (thick) against tokens.
fn plot_loss(path: &Path, runs: &[Run], fams: &[Family]) -> Result<()> {
    crate::plot::init_fonts();
    let all: Vec<(f64, f64)> = runs.iter().flat_map(|r| r.train_curve.iter().chain(&r.val_curve).cloned()).collect();
    let xmax = all.iter().map(|x| x.0).fold(1.0, f64::max);
    let ymax = all.iter().map(|x| x.1).filter(|x| x.is_finite()).fold(0.0, f64::max).max(0.1) * 1.05;
    let ymin = all.iter().map(|x| x.1).filter(|x| x.is_finite()).fold(f64::INFINITY, f64::min).min(ymax) * 0.95;
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("loss vs tokens (band: min–max over seeds; thick: validation)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..xmax, ymin..ymax)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart.configure_mesh().x_desc("tokens").y_desc("loss (nats)").label_style(("sans-serif", 12)).draw().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    for (fi, &f) in fams.iter().enumerate() {
        let c = Palette99::pick(fi).to_rgba();
        let fr: Vec<&Run> = runs.iter().filter(|r| r.family == f).collect();
        let n = fr.iter().map(|r| r.train_curve.len()).min().unwrap_or(0);
        let pts: Vec<(f64, f64, f64, f64)> = (0..n)
            .map(|i| {
                let ys: Vec<f64> = fr.iter().map(|r| r.train_curve[i].1).collect();
                (fr[0].train_curve[i].0, crate::stats::mean(&ys), ys.iter().cloned().fold(f64::INFINITY, f64::min), ys.iter().cloned().fold(f64::NEG_INFINITY, f64::max))
            })
            .collect();
        if pts.len() > 1 {
            let mut poly: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.3)).collect();
            poly.extend(pts.iter().rev().map(|p| (p.0, p.2)));
            chart.draw_series(std::iter::once(Polygon::new(poly, c.mix(0.15).filled()))).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        }
        chart
            .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), c.stroke_width(1)))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?
            .label(f.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(3)));
        let nv = fr.iter().map(|r| r.val_curve.len()).min().unwrap_or(0);
        let vpts: Vec<(f64, f64)> = (0..nv).map(|i| (fr[0].val_curve[i].0, crate::stats::mean(&fr.iter().map(|r| r.val_curve[i].1).collect::<Vec<_>>()))).collect();
        chart.draw_series(LineSeries::new(vpts.clone(), c.stroke_width(3))).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        chart.draw_series(vpts.iter().map(|p| Circle::new(*p, 4, c.filled()))).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 13)).draw().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
