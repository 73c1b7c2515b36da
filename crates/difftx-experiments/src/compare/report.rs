//! Aggregating `compare` runs into verdicts, and writing `report.md`, `report.json` and the plots.
//!
//! How a claim is judged, for each arm against the baseline, on paired per-seed differences
//! (arm − baseline, same seed, same data):
//! - the baseline's value is undefined, or (accuracy claims) the baseline is at the floor or the
//!   ceiling → **uninformative**, with the reason: no model can show a difference there;
//! - a quantity that differs by construction (raw masses of a signed map) → not judged;
//! - else the 95% Student-t CI of the mean difference excludes 0 in the paper's direction →
//!   **reproduced**; in the other direction → **not reproduced**; includes 0 → **inconclusive**,
//!   reported with the smallest effect the run could have detected (80% power) so "no effect" and
//!   "too few seeds" can be told apart.

use super::claims::{self, ClaimKind, ClaimSpec};
use super::{Arm, CompareReport, RunResult, Settings};
use crate::efficiency::{fit_log_linear, param_ratio, token_ratio};
use crate::needle::{draw_heatmaps, sweep_panels};
use crate::plot::{fmt_count, Band, BandPoint, EfficiencySeries};
use crate::stats::{
    accuracy_guard, mean, min_detectable_effect, paired_differences, summarize, verdict, Direction, Summary, Verdict,
};
use anyhow::Result;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// The loss the parameter-efficiency fit and the norm ablation read: on the real-text documents
/// of the validation split. The mixture's validation loss is mostly retrieval and in-context
/// documents whose repeated questions are copied, so it measures retrieval as much as language
/// modelling.
const LM_LOSS: &str = "/text_loss";

/// One arm's standing on one claim.
#[derive(Debug, Clone, Serialize)]
pub struct ArmResult {
    pub arm: String,
    /// Per seed (NaN where not measured).
    pub values: Vec<f64>,
    pub summary: Summary,
    /// Arm − baseline, paired by seed (None for the baseline itself or without a baseline).
    pub vs_baseline: Option<Summary>,
    /// Smallest true difference the run would detect with 80% power (two-sided 95%).
    pub detectable: Option<f64>,
    /// None: not judged (the baseline itself, or a by-construction quantity).
    pub verdict: Option<Verdict>,
    /// Why a verdict is "uninformative" or absent.
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClaimResult {
    #[serde(flatten)]
    pub spec: ClaimSpec,
    pub arms: Vec<ArmResult>,
}

fn verdict_text(a: &ArmResult, digits: usize) -> String {
    match (a.verdict, &a.reason) {
        (None, Some(r)) => r.clone(),
        (None, None) => "reference".into(),
        (Some(Verdict::Uninformative), r) => format!("uninformative: {}", r.clone().unwrap_or_default()),
        (Some(Verdict::Inconclusive), _) => match a.detectable {
            Some(m) => format!("inconclusive: CI includes 0; detectable effect ≥ {m:.digits$}"),
            None => "inconclusive: too few seeds for a CI".into(),
        },
        (Some(v), _) => v.as_str().to_string(),
    }
}

/// Judges one claim for every arm.
pub fn judge_claim(spec: &ClaimSpec, arms: &[Arm], seeds: usize, runs: &[RunResult]) -> ClaimResult {
    let per_seed_of = |arm: &Arm, instrument: &str, pointer: &str| -> Vec<f64> {
        (0..seeds)
            .map(|s| {
                runs.iter()
                    .find(|r| r.main && r.arm == *arm && r.seed == s)
                    .map(|r| r.value(instrument, pointer))
                    .unwrap_or(f64::NAN)
            })
            .collect()
    };
    let per_seed = |arm: &Arm, pointer: &str| per_seed_of(arm, &spec.instrument, pointer);
    let base_arm = arms.iter().find(|a| a.is_baseline());
    let base = base_arm.map(|a| per_seed(a, &spec.pointer));
    let chance = base_arm.map(|a| mean(&per_seed(a, "/chance_accuracy"))).filter(|c| c.is_finite()).unwrap_or(0.0);
    // Why no arm can be judged on this claim, if so.
    let guard: Option<String> = match (&base, spec.kind) {
        (None, _) => Some("no baseline was trained".into()),
        (Some(b), _) if summarize(b).n == 0 => Some("undefined: the baseline's value is not finite".into()),
        (Some(b), ClaimKind::Accuracy) => accuracy_guard(summarize(b).mean, chance),
        (Some(_), ClaimKind::GuardedBy(instrument, ptr)) => {
            let acc = base_arm.map(|a| summarize(&per_seed_of(a, instrument, ptr)).mean).unwrap_or(f64::NAN);
            let chance = base_arm
                .map(|a| mean(&per_seed_of(a, instrument, "/chance_accuracy")))
                .filter(|c| c.is_finite())
                .unwrap_or(0.0);
            accuracy_guard(acc, chance).map(|r| format!("the {instrument} task is at its {r}"))
        }
        _ => None,
    };
    let results = arms
        .iter()
        .map(|arm| {
            let values = per_seed(arm, &spec.pointer);
            // The baseline's own row: values only, no comparison.
            let plain = ArmResult {
                arm: arm.name.clone(),
                summary: summarize(&values),
                values,
                vs_baseline: None,
                detectable: None,
                verdict: None,
                reason: None,
            };
            if arm.is_baseline() {
                return plain;
            }
            let Some(b) = &base else {
                return ArmResult { verdict: Some(Verdict::Uninformative), reason: guard.clone(), ..plain };
            };
            let d = summarize(&paired_differences(&plain.values, b));
            let detectable = min_detectable_effect(&d);
            let (verdict, reason) = if spec.kind == ClaimKind::ByConstruction {
                (None, Some("not judged: differs between families by construction".to_string()))
            } else if let Some(g) = &guard {
                (Some(Verdict::Uninformative), Some(g.clone()))
            } else if plain.summary.n == 0 {
                (Some(Verdict::Uninformative), Some("undefined: this arm's value is not finite".to_string()))
            } else {
                (Some(verdict(&d, spec.direction)), None)
            };
            ArmResult { vs_baseline: Some(d), detectable, verdict, reason, ..plain }
        })
        .collect();
    ClaimResult { spec: spec.clone(), arms: results }
}

/// A ratio claim (parameters or tokens to reach the baseline's loss): one ratio per seed.
#[derive(Debug, Clone, Serialize)]
pub struct RatioResult {
    pub arm: String,
    pub ratios: Vec<f64>,
    pub summary: Summary,
    pub detectable: Option<f64>,
    pub verdict: Verdict,
}

/// Judges per-seed ratios against 1 (below 1: the arm needs less than the baseline).
fn judge_ratio(arm: &str, ratios: Vec<f64>) -> RatioResult {
    let summary = summarize(&ratios);
    let shifted = summarize(&ratios.iter().map(|r| r - 1.0).collect::<Vec<_>>());
    let verdict = if summary.n == 0 { Verdict::Uninformative } else { verdict(&shifted, Direction::Lower) };
    RatioResult { arm: arm.into(), detectable: min_detectable_effect(&shifted), ratios, summary, verdict }
}

/// Parameter efficiency per arm: per seed, fit loss = a + b·ln(params) over the sizes of the
/// baseline and read the parameters the baseline needs for the arm's losses.
pub fn param_efficiency(s: &Settings, runs: &[RunResult]) -> Vec<RatioResult> {
    if s.widths.len() < 2 {
        return Vec::new();
    }
    let points = |arm: &Arm, seed: usize| -> Vec<(f64, f64)> {
        runs.iter()
            .filter(|r| r.arm == *arm && r.seed == seed)
            .map(|r| (r.params as f64, r.value("train", LM_LOSS)))
            .filter(|p| p.1.is_finite())
            .collect()
    };
    let Some(base) = s.arms.iter().find(|a| a.is_baseline()) else { return Vec::new() };
    s.arms
        .iter()
        .filter(|a| !a.is_baseline())
        .map(|arm| {
            let ratios = (0..s.seeds)
                .map(|seed| param_ratio(&points(base, seed), &points(arm, seed)).unwrap_or(f64::NAN))
                .collect();
            judge_ratio(&arm.name, ratios)
        })
        .collect()
}

/// Token efficiency per arm at the preset's width, from the validation curves.
pub fn token_efficiency(s: &Settings, runs: &[RunResult]) -> Vec<RatioResult> {
    let curve = |arm: &Arm, seed: usize| -> Vec<(f64, f64)> {
        runs.iter().find(|r| r.main && r.arm == *arm && r.seed == seed).map(|r| r.val_curve.clone()).unwrap_or_default()
    };
    let Some(base) = s.arms.iter().find(|a| a.is_baseline()) else { return Vec::new() };
    s.arms
        .iter()
        .filter(|a| !a.is_baseline())
        .map(|arm| {
            let ratios = (0..s.seeds)
                .map(|seed| {
                    // the first point (step 0, untrained) says nothing about efficiency
                    let b: Vec<_> = curve(base, seed).into_iter().skip(1).collect();
                    let o: Vec<_> = curve(arm, seed).into_iter().skip(1).collect();
                    token_ratio(&b, &o).unwrap_or(f64::NAN)
                })
                .collect();
            judge_ratio(&arm.name, ratios)
        })
        .collect()
}

/// The norm ablation: diff-v1-nonorm − diff-v1 loss on real text, paired by seed.
fn ablation(s: &Settings, runs: &[RunResult]) -> Option<(Summary, Option<f64>, Verdict)> {
    let nonorm = s.arms.iter().find(|a| a.family == difftx_core::Family::DiffV1 && !a.subln)?;
    let v1 = s.arms.iter().find(|a| a.family == difftx_core::Family::DiffV1 && a.subln)?;
    let vals = |arm: &Arm| -> Vec<f64> {
        (0..s.seeds)
            .map(|seed| {
                runs.iter()
                    .find(|r| r.main && r.arm == *arm && r.seed == seed)
                    .map(|r| r.value("train", LM_LOSS))
                    .unwrap_or(f64::NAN)
            })
            .collect()
    };
    let d = summarize(&paired_differences(&vals(nonorm), &vals(v1)));
    let v = if d.n == 0 { Verdict::Uninformative } else { verdict(&d, Direction::Higher) };
    Some((d.clone(), min_detectable_effect(&d), v))
}

fn ratio_md(md: &mut String, title: &str, paper: &str, rows: &[RatioResult], what: &str) {
    md.push_str(&format!("## {title}\n\nPaper: {paper}.\n\n"));
    md.push_str(&format!(
        "| arm | {what} (mean ± 95% CI over seeds) | per seed | detectable | verdict |\n|---|---|---|---|---|\n"
    ));
    for r in rows {
        let per: Vec<String> =
            r.ratios.iter().map(|x| if x.is_finite() { format!("{:.0}%", 100.0 * x) } else { "n/a".into() }).collect();
        let shown = match r.summary.half_width() {
            Some(h) => format!("{:.0}% ± {:.0}%", 100.0 * r.summary.mean, 100.0 * h),
            None if r.summary.n > 0 => format!("{:.0}%", 100.0 * r.summary.mean),
            None => "n/a".into(),
        };
        let det = r.detectable.map(|d| format!("{:.0}%", 100.0 * d)).unwrap_or_else(|| "n/a".into());
        let v = match r.verdict {
            Verdict::Reproduced => "reproduced (fewer than the baseline's)".to_string(),
            Verdict::NotReproduced => "not reproduced (more than the baseline's)".to_string(),
            Verdict::Inconclusive => "inconclusive: CI includes 100%".to_string(),
            Verdict::Uninformative => "uninformative: no crossing of the loss curves / fits".to_string(),
        };
        md.push_str(&format!("| {} | {shown} | {} | {det} | {v} |\n", r.arm, per.join(", ")));
    }
    md.push('\n');
}

/// Validation-loss bands (mean ± 95% CI over seeds) per arm and the paired difference to the
/// baseline, by tokens (curves aligned by evaluation index).
fn loss_bands(s: &Settings, runs: &[RunResult]) -> (Vec<Band>, Vec<Band>) {
    let curves = |arm: &Arm| -> Vec<Vec<(f64, f64)>> {
        (0..s.seeds)
            .filter_map(|seed| runs.iter().find(|r| r.main && r.arm == *arm && r.seed == seed))
            .map(|r| r.val_curve.clone())
            .collect()
    };
    let band = |label: String, cs: &[Vec<(f64, f64)>], base: Option<&[Vec<(f64, f64)>]>| -> Band {
        let n = cs.iter().chain(base.into_iter().flatten()).map(|c| c.len()).min().unwrap_or(0);
        // from the first evaluation after step 0: the untrained loss would squeeze the axis
        let points = (1..n)
            .map(|i| {
                let x = mean(&cs.iter().map(|c| c[i].0).collect::<Vec<_>>());
                let ys: Vec<f64> = match base {
                    Some(b) => cs.iter().zip(b).map(|(c, b)| c[i].1 - b[i].1).collect(),
                    None => cs.iter().map(|c| c[i].1).collect(),
                };
                let sm = summarize(&ys);
                let (lo, hi) = sm.ci95.unwrap_or((sm.mean, sm.mean));
                BandPoint { x, mid: sm.mean, lo, hi }
            })
            .collect();
        Band { label, points }
    };
    let base = s.arms.iter().find(|a| a.is_baseline()).map(curves);
    let loss = s.arms.iter().map(|a| band(a.name.clone(), &curves(a), None)).collect();
    let delta = match &base {
        Some(b) => s
            .arms
            .iter()
            .filter(|a| !a.is_baseline())
            .map(|a| band(format!("{} − baseline", a.name), &curves(a), Some(b)))
            .collect(),
        None => Vec::new(),
    };
    (loss, delta)
}

fn arm_runs<'a>(runs: &'a [RunResult], arm: &'a Arm) -> impl Iterator<Item = &'a RunResult> + 'a {
    runs.iter().filter(move |r| r.main && r.arm == *arm)
}

/// The needle JSON averaged cell by cell over an arm's seeds.
fn mean_needle(runs: &[&RunResult]) -> Option<serde_json::Value> {
    let mut mean_v = runs.first()?.results.get("needle")?.clone();
    let sweeps = mean_v["sweeps"].as_array_mut()?;
    for (si, sw) in sweeps.iter_mut().enumerate() {
        let Some(rows) = sw["accuracy"].as_array_mut() else { continue };
        for (li, row) in rows.iter_mut().enumerate() {
            let Some(cells) = row.as_array_mut() else { continue };
            for (di, cell) in cells.iter_mut().enumerate() {
                let xs: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| r.results.get("needle")?["sweeps"][si]["accuracy"][li][di].as_f64())
                    .collect();
                *cell = if xs.is_empty() { serde_json::Value::Null } else { serde_json::json!(mean(&xs)) };
            }
        }
    }
    Some(mean_v)
}

fn draw_plots(out: &Path, s: &Settings, runs: &[RunResult]) -> Result<Vec<(&'static str, &'static str)>> {
    let mut drawn = Vec::new();
    let (loss, delta) = loss_bands(s, runs);
    crate::plot::draw_loss_panels(
        &out.join("loss_curves.png"),
        "loss on the mixture's validation split vs tokens (mean, 95% CI over seeds); right: minus the baseline",
        &loss,
        &delta,
    )?;
    drawn.push(("loss", "loss_curves.png"));
    let mut panels = Vec::new();
    let mut recall_panels = Vec::new();
    for arm in &s.arms {
        let rs: Vec<&RunResult> = arm_runs(runs, arm).collect();
        if let Some(m) = mean_needle(&rs) {
            panels.extend(sweep_panels(&m, &format!("{} ", arm.name)));
        }
        // recall accuracy per pair count, mean over seeds
        let counts = &s.recall.pair_counts;
        let row: Vec<Option<f64>> = (0..counts.len())
            .map(|i| {
                let xs: Vec<f64> = rs
                    .iter()
                    .map(|r| r.value("recall", &format!("/by_pairs/{i}/accuracy")))
                    .filter(|x| x.is_finite())
                    .collect();
                if xs.is_empty() {
                    None
                } else {
                    Some(mean(&xs))
                }
            })
            .collect();
        recall_panels.push(crate::needle::Panel {
            title: arm.name.clone(),
            rows: vec!["accuracy".into()],
            cols: counts.iter().map(|p| format!("{p} pairs")).collect(),
            values: vec![row],
        });
    }
    draw_heatmaps(
        &out.join("needle_heatmaps.png"),
        "needle accuracy, mean over seeds (rows: context tokens, cols: depth; grey: does not fit)",
        &panels,
        0.0,
        1.0,
    )?;
    drawn.push(("needle", "needle_heatmaps.png"));
    draw_heatmaps(&out.join("recall.png"), "associative recall accuracy, mean over seeds", &recall_panels, 0.0, 1.0)?;
    drawn.push(("recall", "recall.png"));
    let bars: Vec<crate::attention::BarSeries> = s
        .arms
        .iter()
        .map(|arm| {
            let rs: Vec<&RunResult> = arm_runs(runs, arm).collect();
            let per = s
                .attention
                .depths
                .iter()
                .enumerate()
                .map(|(di, &d)| {
                    let get = |k: &str| {
                        mean(&rs.iter().map(|r| r.value("attention", &format!("/depths/{di}/{k}"))).collect::<Vec<_>>())
                    };
                    (d, get("answer_alloc"), get("noise_alloc"))
                })
                .collect();
            (arm.name.clone(), per)
        })
        .collect();
    crate::attention::draw_bars(
        &out.join("attention_bars.png"),
        "attention allocation by needle depth (share of absolute mass), mean over seeds",
        &bars,
    )?;
    drawn.push(("attention", "attention_bars.png"));
    let spread: Vec<(String, Vec<f64>)> = s
        .arms
        .iter()
        .map(|arm| {
            let xs = arm_runs(runs, arm)
                .flat_map(|r| {
                    r.results
                        .get("icl")
                        .and_then(|v| v["episodes"].as_array().cloned())
                        .unwrap_or_default()
                        .into_iter()
                        .flat_map(|e| {
                            e["order_accuracies"]
                                .as_array()
                                .cloned()
                                .unwrap_or_default()
                                .into_iter()
                                .filter_map(|x| x.as_f64())
                        })
                })
                .collect();
            (arm.name.clone(), xs)
        })
        .collect();
    let chance = if s.icl.data.is_none() { 1.0 / s.icl.classes.max(1) as f64 } else { 0.0 };
    crate::icl::draw_spread(
        &out.join("icl_spread.png"),
        "in-context accuracy per demonstration order (all seeds, episodes)",
        &spread,
        chance,
    )?;
    drawn.push(("icl", "icl_spread.png"));
    if s.widths.len() > 1 {
        let series: Vec<EfficiencySeries> = s
            .arms
            .iter()
            .map(|arm| {
                let points: Vec<(f64, f64, f64, f64)> = s
                    .widths
                    .iter()
                    .filter_map(|&w| {
                        let rs: Vec<&RunResult> = runs.iter().filter(|r| r.arm == *arm && r.width == w).collect();
                        let sm = summarize(&rs.iter().map(|r| r.value("train", LM_LOSS)).collect::<Vec<_>>());
                        let (lo, hi) = sm.ci95.unwrap_or((sm.mean, sm.mean));
                        Some((rs.first()?.params as f64, sm.mean, lo, hi))
                    })
                    .collect();
                let fit = fit_log_linear(&points.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>()).ok();
                EfficiencySeries { label: arm.name.clone(), points, fit }
            })
            .collect();
        crate::plot::draw_param_efficiency(
            &out.join("param_efficiency.png"),
            "loss on real text vs parameters (mean and 95% CI over seeds, fit a + b·ln N)",
            &series,
        )?;
        drawn.push(("parameter efficiency", "param_efficiency.png"));
    }
    Ok(drawn)
}

/// Aggregates, judges and writes everything; returns the report's paths and JSON.
pub fn write_report(out: &Path, s: &Settings, runs: &[RunResult], start: Instant) -> Result<CompareReport> {
    let claim_specs = claims::claims(&s.needle.sweeps, &s.recall.pair_counts);
    let results: Vec<ClaimResult> = claim_specs.iter().map(|c| judge_claim(c, &s.arms, s.seeds, runs)).collect();
    let params = param_efficiency(s, runs);
    let tokens = token_efficiency(s, runs);
    let abl = ablation(s, runs);
    let drawn = draw_plots(out, s, runs)?;
    let wall = start.elapsed().as_secs_f64();

    let mut md = String::new();
    md.push_str("# Differential Transformer vs baseline: compare report\n\n");
    let main_params: Vec<String> = s
        .arms
        .iter()
        .filter_map(|a| {
            runs.iter().find(|r| r.main && r.arm == *a).map(|r| format!("{} {}", a.name, fmt_count(r.params as f64)))
        })
        .collect();
    let tokens_per_run = runs.iter().filter(|r| r.main).map(|r| r.value("train", "/tokens")).fold(f64::NAN, f64::max);
    md.push_str(&format!(
        "Preset `{}` (context {}), arms {}, {} seed(s), budget {}, batch {} × {} tokens ({} tokens per model), \
         widths {:?}, {} runs side by side × {} thread(s); wall time {:.1} min{}{}.\n\n",
        s.preset,
        s.seq_len,
        s.arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", "),
        s.seeds,
        match (s.budget, s.budget_seconds) {
            (super::Budget::Steps(n), Some(t)) =>
                format!("{n} steps per model (timed to fit {t:.0} s of training in all)"),
            (super::Budget::Steps(n), None) => format!("{n} steps per model"),
            (super::Budget::Seconds(t), _) => format!("{:.0} s of training in all", t),
        },
        s.batch_size,
        s.seq_len,
        fmt_count(tokens_per_run),
        s.widths,
        s.jobs,
        s.threads_per_job,
        wall / 60.0,
        match runs.iter().filter(|r| r.reused).count() {
            0 => String::new(),
            n => format!(
                " ({n} of {} runs trained by an earlier invocation; their training is not in this time)",
                runs.len()
            ),
        },
        if s.quick { " — QUICK smoke run: numbers are not meaningful" } else { "" }
    ));
    md.push_str(&format!("Parameters: {}.\n\n", main_params.join(", ")));
    let m = &s.mixture;
    md.push_str(&format!(
        "Mixture (about {} characters in documents of at most {} characters, windows start at document starts; \
         shares of characters): text {:.2}, needle {:.2}, recall {:.2}, in-context {:.2}; keys of {} letter(s) from {}, values of {} digit(s); {}–{} needles per needle \
         document, {}–{} pairs per recall document (filler {}–{} words), {}–{} demonstrations of {}–{} classes \
         (inputs from {} of each class's group of letters in an episode).\n\n",
        s.windows * m.doc_chars,
        m.doc_chars,
        m.text_fraction,
        m.needle_fraction,
        m.recall_fraction,
        m.icl_fraction,
        m.pairs.key_len,
        m.pairs.key_letters,
        m.pairs.value_digits,
        m.needles.0,
        m.needles.1,
        m.recall_pairs.0,
        m.recall_pairs.1,
        m.recall_filler.0,
        m.recall_filler.1,
        m.shots.0,
        m.shots.1,
        m.classes.0,
        m.classes.1,
        if m.icl_letters == 0 { "every letter".to_string() } else { format!("{} letter(s)", m.icl_letters) },
    ));
    if runs.iter().all(|r| !r.value("train", LM_LOSS).is_finite()) {
        md.push_str(
            "**No loss on real text.** The mixture's validation split holds no real-text document (text \
             fraction 0, or too little text), so \"loss on real text\" is undefined (null in report.json), and \
             the parameter-efficiency fit and the norm ablation, which read it, have no value.\n\n",
        );
    }
    md.push_str(&format!("Paper numbers: {}.\n\n", claims::PAPER_SOURCE));
    md.push_str(
        "**How to read the verdicts.** Each arm is compared with the baseline on paired per-seed differences \
         (same seed, same data). *Reproduced*: the 95% Student-t CI of the difference excludes 0 in the paper's \
         direction; *not reproduced*: it excludes 0 in the other direction; *inconclusive*: it includes 0, and \
         \"detectable\" is the smallest true difference this many seeds would detect with 80% power (an effect \
         smaller than that may exist); *uninformative*: the baseline is at the floor (below chance + 10% of the \
         way to 1) or ceiling (above 90%) of an accuracy instrument, or the value is undefined, so the instrument \
         cannot show a difference. Raw attention masses differ by construction (a differential row sums to about \
         1 − λ) and are reported without a verdict; the allocation rows divide by each row's total absolute mass \
         so signed and softmax maps compare on the same footing.\n\n",
    );

    // Overview.
    let others: Vec<&Arm> = s.arms.iter().filter(|a| !a.is_baseline()).collect();
    md.push_str("## Overview\n\n| claim | baseline |");
    for a in &others {
        md.push_str(&format!(" {} − baseline | verdict |", a.name));
    }
    md.push_str("\n|---|---|");
    for _ in &others {
        md.push_str("---|---|");
    }
    md.push('\n');
    for c in &results {
        let base = c.arms.iter().find(|a| a.vs_baseline.is_none() && a.verdict.is_none() && a.reason.is_none());
        md.push_str(&format!(
            "| {} | {} |",
            c.spec.title,
            base.map(|b| b.summary.display(3)).unwrap_or_else(|| "n/a".into())
        ));
        for a in &others {
            let r = c.arms.iter().find(|x| x.arm == a.name);
            let d = r.and_then(|r| r.vs_baseline.as_ref()).map(|d| d.display(3)).unwrap_or_else(|| "n/a".into());
            let v = r.map(|r| verdict_text(r, 3)).unwrap_or_default();
            md.push_str(&format!(" {d} | {v} |"));
        }
        md.push('\n');
    }
    md.push('\n');
    if !params.is_empty() {
        ratio_md(
            &mut md,
            "Parameters to match the baseline's loss",
            claims::PAPER_PARAM_RATIO,
            &params,
            "parameters needed, % of the baseline's",
        );
        md.push_str("Per seed, the baseline's loss on the real-text documents of the validation split is fitted as a + b·ln(parameters) over the widths; each arm's losses are mapped to the baseline size with the same fitted loss, and the ratio is the geometric mean over widths of (arm parameters / that baseline size).\n\n");
    }
    ratio_md(
        &mut md,
        "Tokens to reach the baseline's final loss",
        claims::PAPER_TOKEN_RATIO,
        &tokens,
        "tokens needed, % of the baseline's",
    );
    md.push_str("Per seed, from the validation curves at the preset's width (loss on the training mixture; linear interpolation between evaluations): the tokens at which the arm first reaches the baseline's final loss, over the baseline's tokens; when it never does, the baseline's tokens to reach the arm's final loss give the ratio (> 100%).\n\n");
    if let Some((d, det, v)) = &abl {
        md.push_str(&format!(
            "## Ablation: diff-v1 without its per-head norm\n\nPaper: {}.\n\n| | diff-v1-nonorm − diff-v1 loss on real text | detectable | verdict |\n|---|---|---|---|\n| loss | {} | {} | {} |\n\n",
            claims::PAPER_ABLATION,
            d.display(4),
            det.map(|x| format!("{x:.4}")).unwrap_or_else(|| "n/a".into()),
            match v {
                Verdict::Reproduced => "reproduced (the norm lowers the loss)",
                Verdict::NotReproduced => "not reproduced (the loss is lower without the norm)",
                Verdict::Inconclusive => "inconclusive: CI includes 0",
                Verdict::Uninformative => "uninformative",
            }
        ));
    }

    // Details.
    md.push_str("## Claims in detail\n\n");
    for c in &results {
        md.push_str(&format!(
            "### {}\n\nPaper: {} (expected: diff {} than the baseline). Instrument `{}`, `{}`.\n\n",
            c.spec.title,
            c.spec.paper,
            if c.spec.direction == Direction::Higher { "higher" } else { "lower" },
            c.spec.instrument,
            c.spec.pointer
        ));
        md.push_str("| arm | ours (mean ± 95% CI) | − baseline (mean ± 95% CI) | detectable | verdict |\n|---|---|---|---|---|\n");
        for a in &c.arms {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                a.arm,
                a.summary.display(4),
                a.vs_baseline.as_ref().map(|d| d.display(4)).unwrap_or_else(|| "—".into()),
                a.detectable.map(|x| format!("{x:.4}")).unwrap_or_else(|| "—".into()),
                verdict_text(a, 4)
            ));
        }
        md.push('\n');
    }
    md.push_str("## Plots\n\n");
    for (name, file) in &drawn {
        md.push_str(&format!("![{name}]({file})\n\n"));
    }
    md.push_str("Per-run instrument outputs (JSON and PNG) are in `runs/ARM-seedN/analysis/`.\n");

    let report = serde_json::json!({
        "settings": s,
        "runs": runs.iter().map(|r| serde_json::json!({
            "arm": r.arm.name, "seed": r.seed, "width": r.width, "main": r.main, "params": r.params,
            "dir": r.dir.display().to_string(), "results": r.results,
        })).collect::<Vec<_>>(),
        "claims": results,
        "param_efficiency": params,
        "token_efficiency": tokens,
        "ablation_nonorm_minus_v1": abl.map(|(d, det, v)| serde_json::json!({"summary": d, "detectable": det, "verdict": v})),
        "wall_secs": wall,
    });
    let md_path = out.join("report.md");
    std::fs::write(&md_path, md)?;
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(CompareReport { out: out.to_path_buf(), report_md: md_path, report_json: report, wall_secs: wall })
}
