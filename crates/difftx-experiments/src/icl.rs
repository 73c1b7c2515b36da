//! In-context order robustness (docs/design.md §8): k-shot classification where the same demonstrations
//! are shown in many random orders. Each label is scored by its total log-probability after the
//! prompt (prediction = best label of the task's label set). Reports mean accuracy and the
//! best-minus-worst accuracy margin over orders.
//!
//! Tasks: the synthetic task of `mixture` (default; per-episode random label words) or a JSONL
//! file of {"text", "label"} objects (e.g. `data/eval/snips_intent.jsonl`, for models that read).
//! Prompt format: lines `input -> label`, then `query ->`; a label is scored as " label".
//!
//! Fitting the model's context (`max_tokens`): long labelled texts (e.g. reviews) may not fit k
//! demonstrations plus a query. Each episode then TRUNCATES its texts (demonstrations and
//! queries alike) to their first B tokens, with B the largest common per-example budget that fits
//! all k demonstrations, the longest query and the longest label. Only when B would fall below
//! [`MIN_TEXT_TOKENS`] are demonstrations dropped (from the end of the drawn set) until one fits;
//! when not even one demonstration plus a query fits at that budget, the run fails with a one-line
//! error. The output records "skipped_examples" (demonstrations dropped) and "truncated_examples"
//! (texts cut), summed over episodes, and a "note" (null when nothing was changed).

use crate::mixture::{icl_line, icl_query, SyntheticTask};
use crate::needle::{cell_seed, load};
use anyhow::{bail, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use difftx_core::model::Model;
use difftx_core::tokenizer::Tokenizer;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IclOptions {
    /// Demonstrations per prompt (k).
    pub shots: usize,
    /// Classes of the synthetic task (ignored with `data`).
    pub classes: usize,
    /// Input letters per class of the synthetic task in one episode (0: every letter of the
    /// class's group); compare uses its mixture's `icl_letters`.
    #[serde(default)]
    pub letters_per_class: usize,
    /// Random orders of the same demonstrations.
    pub orders: usize,
    /// Independent sets of demonstrations (and, for the synthetic task, label words).
    pub episodes: usize,
    /// Queries scored per order.
    pub queries: usize,
    pub seed: u64,
    /// JSONL file of {"text","label"}; None = the synthetic task.
    pub data: Option<PathBuf>,
}

impl Default for IclOptions {
    fn default() -> Self {
        let mixture = crate::mixture::MixtureSpec::default();
        IclOptions {
            shots: 8,
            classes: mixture.classes.0,
            letters_per_class: mixture.icl_letters,
            orders: 10,
            episodes: 4,
            queries: 8,
            seed: 0,
            data: None,
        }
    }
}

/// Scores a label: `(prompt ids, label ids) -> score` (higher = more likely).
pub type Scorer<'a> = dyn FnMut(&[u32], &[u32]) -> Result<f64> + 'a;

/// Total log-probability of `cont` after `prompt`, from one forward pass over prompt + cont.
pub fn continuation_logprob(model: &Model, prompt: &[u32], cont: &[u32]) -> Result<f64> {
    if prompt.is_empty() || cont.is_empty() {
        bail!("prompt and continuation must be non-empty");
    }
    let mut ids = prompt.to_vec();
    ids.extend_from_slice(&cont[..cont.len() - 1]);
    if ids.len() > model.config().max_seq_len {
        bail!(
            "icl: prompt and label need {} tokens, more than the model's context of {}; lower --shots",
            ids.len() + 1,
            model.config().max_seq_len
        );
    }
    let x = Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?;
    let logits = model.forward(&x, None)?.i(0)?.to_dtype(DType::F64)?; // [T, V]
    let rows = logits.i(prompt.len() - 1..ids.len())?.to_vec2::<f64>()?;
    let mut total = 0.0;
    for (row, &t) in rows.iter().zip(cont) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        total += row[t as usize] - lse;
    }
    Ok(total)
}

/// Mean and best-minus-worst margin of per-order accuracies.
pub fn order_stats(accuracies: &[f64]) -> (f64, f64) {
    let max = accuracies.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let min = accuracies.iter().cloned().fold(f64::INFINITY, f64::min);
    (crate::stats::mean(accuracies), if accuracies.is_empty() { f64::NAN } else { max - min })
}

/// Smallest per-example token budget texts are truncated to before demonstrations are dropped.
pub const MIN_TEXT_TOKENS: usize = 16;

/// (text, label index) examples plus label names.
#[derive(Clone)]
struct Episode {
    labels: Vec<String>,
    demos: Vec<(String, usize)>,
    queries: Vec<(String, usize)>,
}

fn read_labelled(path: &Path) -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("icl: cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}:{}: not JSON ({e})", path.display(), i + 1))?;
        match (v.get("text").and_then(|x| x.as_str()), v.get("label").and_then(|x| x.as_str())) {
            (Some(t), Some(l)) => out.push((t.replace('\n', " "), l.to_string())),
            _ => bail!("{}:{}: needs string fields \"text\" and \"label\"", path.display(), i + 1),
        }
    }
    if out.len() < 4 {
        bail!("icl: {} has {} examples; at least 4 are needed", path.display(), out.len());
    }
    Ok(out)
}

fn episodes(opts: &IclOptions) -> Result<Vec<Episode>> {
    let mut eps = Vec::new();
    match &opts.data {
        None => {
            if opts.classes < 2 || opts.classes > crate::mixture::LABEL_WORDS.len() {
                bail!("icl: classes must be 2..={}, got {}", crate::mixture::LABEL_WORDS.len(), opts.classes);
            }
            for e in 0..opts.episodes {
                let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[31, e as u64]));
                let task = SyntheticTask::random(opts.classes, opts.letters_per_class, &mut rng);
                // demonstrations cover every class when shots allow
                let mut demos: Vec<(String, usize)> = (0..opts.shots)
                    .map(|i| (task.input_of_class(i % opts.classes, &mut rng), i % opts.classes))
                    .collect();
                demos.shuffle(&mut rng);
                let queries = task.examples(opts.queries, &mut rng);
                eps.push(Episode { labels: task.labels.clone(), demos, queries });
            }
        }
        Some(path) => {
            let all = read_labelled(path)?;
            let mut labels: Vec<String> = all.iter().map(|x| x.1.clone()).collect();
            labels.sort();
            labels.dedup();
            if labels.len() < 2 {
                bail!("icl: {} has a single label", path.display());
            }
            if opts.shots + opts.queries > all.len() {
                bail!(
                    "icl: {} has {} examples, fewer than shots + queries = {}",
                    path.display(),
                    all.len(),
                    opts.shots + opts.queries
                );
            }
            let idx = |l: &str| labels.iter().position(|x| x == l).unwrap_or(0);
            for e in 0..opts.episodes {
                let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[37, e as u64]));
                let mut pool = all.clone();
                pool.shuffle(&mut rng);
                let demos = pool[..opts.shots].iter().map(|(t, l)| (t.clone(), idx(l))).collect();
                let queries =
                    pool[opts.shots..opts.shots + opts.queries].iter().map(|(t, l)| (t.clone(), idx(l))).collect();
                eps.push(Episode { labels: labels.clone(), demos, queries });
            }
        }
    }
    Ok(eps)
}

/// How an episode was fitted to the context.
struct Fitted {
    ep: Episode,
    skipped: usize,
    truncated: usize,
    /// The per-example token budget when texts had to be cut.
    budget: Option<usize>,
}

/// `text` cut to at most `budget` tokens (its first tokens), and whether it was cut.
fn truncate_text(tok: &Tokenizer, text: &str, budget: usize) -> Result<(String, bool)> {
    let ids = tok.encode(text)?;
    if ids.len() <= budget {
        return Ok((text.to_string(), false));
    }
    // decoding a cut can change the count (a split character, BPE merges): shrink until it fits
    let mut cut = budget;
    loop {
        let t = tok.decode(&ids[..cut])?;
        if cut == 0 || tok.encode(&t)?.len() <= budget {
            return Ok((t, true));
        }
        cut -= 1;
    }
}

/// Fits one episode to `max_tokens` (see the module doc): prompt + label − 1 tokens must fit.
fn fit_episode(tok: &Tokenizer, ep: &Episode, max_tokens: usize, label_tokens: usize) -> Result<Fitted> {
    let len = |t: &str| -> Result<usize> { Ok(tok.encode(t)?.len()) };
    let demo_len: Vec<usize> = ep.demos.iter().map(|(t, _)| len(t)).collect::<Result<_>>()?;
    let demo_ov: Vec<usize> =
        ep.demos.iter().map(|(_, c)| len(&icl_line("", &ep.labels[*c]))).collect::<Result<_>>()?;
    let query_len: Vec<usize> = ep.queries.iter().map(|(t, _)| len(t)).collect::<Result<_>>()?;
    let query_ov = len(&icl_query(""))? + label_tokens.saturating_sub(1);
    let longest = demo_len.iter().chain(&query_len).copied().max().unwrap_or(0);
    // tokens needed with k demonstrations and every text cut to b tokens
    let needed = |k: usize, b: usize| -> usize {
        let d: usize = (0..k).map(|i| demo_len[i].min(b) + demo_ov[i]).sum();
        d + query_len.iter().map(|&q| q.min(b)).max().unwrap_or(0) + query_ov
    };
    let mut slack = 0usize;
    for _ in 0..8 {
        let limit = max_tokens.saturating_sub(slack);
        let choice = if needed(ep.demos.len(), longest) <= limit {
            Some((ep.demos.len(), None))
        } else {
            // the largest budget for as many demonstrations as possible (b = longest: no cut)
            (1..=ep.demos.len()).rev().find_map(|k| {
                let b = (MIN_TEXT_TOKENS.min(longest)..=longest).rev().find(|&b| needed(k, b) <= limit)?;
                Some((k, (b < longest).then_some(b)))
            })
        };
        let Some((k, budget)) = choice else {
            bail!(
                "icl: not even one demonstration plus a query fits the model's context of {max_tokens} tokens \
                 (texts cut to {MIN_TEXT_TOKENS} tokens, labels up to {label_tokens} tokens)"
            );
        };
        let mut out = Episode { labels: ep.labels.clone(), demos: Vec::new(), queries: Vec::new() };
        let mut truncated = 0usize;
        for (src, dst) in [(&ep.demos[..k], &mut out.demos), (&ep.queries[..], &mut out.queries)] {
            for (t, c) in src {
                let (t, cut) = match budget {
                    Some(b) => truncate_text(tok, t, b)?,
                    None => (t.clone(), false),
                };
                truncated += cut as usize;
                dst.push((t, *c));
            }
        }
        // check the real prompts (token counts of a concatenation can differ from the sum)
        let context: String = out.demos.iter().map(|(x, c)| icl_line(x, &out.labels[*c])).collect();
        let mut worst = 0usize;
        for (q, _) in &out.queries {
            worst = worst.max(len(&format!("{context}{}", icl_query(q)))? + label_tokens.saturating_sub(1));
        }
        if worst <= max_tokens {
            return Ok(Fitted { ep: out, skipped: ep.demos.len() - k, truncated, budget });
        }
        slack += worst - max_tokens;
    }
    bail!("icl: could not fit the prompts into the model's context of {max_tokens} tokens")
}

/// Accuracy of one ordering of `demos` on the episode's queries.
fn order_accuracy(
    tok: &Tokenizer,
    ep: &Episode,
    demos: &[(String, usize)],
    label_ids: &[Vec<u32>],
    score: &mut Scorer<'_>,
) -> Result<f64> {
    let context: String = demos.iter().map(|(x, c)| icl_line(x, &ep.labels[*c])).collect();
    let mut correct = 0usize;
    for (q, c) in &ep.queries {
        let prompt = tok.encode(&format!("{context}{}", icl_query(q)))?;
        let mut best = (f64::NEG_INFINITY, 0usize);
        for (li, ids) in label_ids.iter().enumerate() {
            let lp = score(&prompt, ids)?;
            if lp > best.0 {
                best = (lp, li);
            }
        }
        if best.1 == *c {
            correct += 1;
        }
    }
    Ok(correct as f64 / ep.queries.len() as f64)
}

/// The order-robustness measurement with any label scorer `score(prompt_ids, label_ids)` (the
/// model's log-probability in [`run_icl`]; an oracle in tests), for a model whose context is
/// `max_tokens` (prompts are fitted to it: see the module doc). Returns `{"episodes": [{labels,
/// shots, text_budget, order_accuracies, mean_accuracy, margin}], "chance_accuracy",
/// "mean_accuracy", "margin", "max_tokens", "skipped_examples", "truncated_examples", "note"}`
/// where `margin` is the mean over episodes of best − worst order accuracy. The first order of
/// each episode is the drawn order, the others random permutations of it.
pub fn evaluate_icl(
    tok: &Tokenizer,
    opts: &IclOptions,
    max_tokens: usize,
    score: &mut Scorer<'_>,
) -> Result<serde_json::Value> {
    if opts.shots == 0 || opts.orders == 0 || opts.episodes == 0 || opts.queries == 0 {
        bail!("icl: shots, orders, episodes and queries must be positive");
    }
    let eps = episodes(opts)?;
    let mut per_episode = Vec::new();
    let mut all_acc = Vec::new();
    let mut margins = Vec::new();
    let (mut skipped, mut truncated, mut budgets) = (0usize, 0usize, Vec::new());
    for (e, ep) in eps.iter().enumerate() {
        let label_ids: Vec<Vec<u32>> = ep.labels.iter().map(|l| tok.encode(&format!(" {l}"))).collect::<Result<_>>()?;
        let label_tokens = label_ids.iter().map(|l| l.len()).max().unwrap_or(1);
        let fitted = fit_episode(tok, ep, max_tokens, label_tokens)?;
        skipped += fitted.skipped;
        truncated += fitted.truncated;
        budgets.extend(fitted.budget);
        let ep = &fitted.ep;
        let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[41, e as u64]));
        let mut accs = Vec::with_capacity(opts.orders);
        for o in 0..opts.orders {
            let mut demos = ep.demos.clone();
            if o > 0 {
                demos.shuffle(&mut rng);
            }
            accs.push(order_accuracy(tok, ep, &demos, &label_ids, score)?);
        }
        let (m, margin) = order_stats(&accs);
        all_acc.extend_from_slice(&accs);
        margins.push(margin);
        per_episode.push(serde_json::json!({
            "labels": ep.labels,
            "shots": ep.demos.len(),
            "text_budget": fitted.budget,
            "order_accuracies": accs,
            "mean_accuracy": m,
            "margin": margin,
        }));
    }
    let chance = crate::stats::mean(&eps.iter().map(|e| 1.0 / e.labels.len() as f64).collect::<Vec<_>>());
    let note = if skipped + truncated == 0 {
        serde_json::Value::Null
    } else {
        let lo = budgets.iter().min().copied().unwrap_or(0);
        let hi = budgets.iter().max().copied().unwrap_or(0);
        let cut = if budgets.is_empty() {
            String::new()
        } else if lo == hi {
            format!(" to their first {lo} tokens")
        } else {
            format!(" to their first {lo}..{hi} tokens (per episode)")
        };
        serde_json::json!(format!(
            "to fit the model's context of {max_tokens} tokens, {truncated} text(s) were truncated{cut} and \
             {skipped} demonstration(s) dropped (over {} episodes of {} shots)",
            eps.len(),
            opts.shots
        ))
    };
    Ok(serde_json::json!({
        "task": opts.data.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "synthetic".into()),
        "chance_accuracy": chance,
        "episodes": per_episode,
        "mean_accuracy": crate::stats::mean(&all_acc),
        "margin": crate::stats::mean(&margins),
        "max_tokens": max_tokens,
        "skipped_examples": skipped,
        "truncated_examples": truncated,
        "note": note,
    }))
}

/// Runs the order-robustness measurement on a model; writes `icl.json` and `icl.png`.
pub fn run_icl(model_dir: &Path, opts: &IclOptions, out_dir: &Path) -> Result<serde_json::Value> {
    if opts.shots == 0 || opts.orders == 0 || opts.episodes == 0 || opts.queries == 0 {
        bail!("icl: shots, orders, episodes and queries must be positive");
    }
    let (model, tok) = load(model_dir)?;
    let ctx = model.config().max_seq_len;
    let res = evaluate_icl(&tok, opts, ctx, &mut |p, l| continuation_logprob(&model, p, l))?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let series: Vec<(String, Vec<f64>)> = res["episodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                format!("episode {i}"),
                e["order_accuracies"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                    .unwrap_or_default(),
            )
        })
        .collect();
    let chance = res["chance_accuracy"].as_f64().unwrap_or(0.0);
    draw_spread(
        &out_dir.join("icl.png"),
        &format!("{}-shot accuracy over demonstration orders ({})", opts.shots, model.config().family.as_str()),
        &series,
        chance,
    )?;
    let v = serde_json::json!({
        "instrument": "icl",
        "model": model_dir.display().to_string(),
        "family": model.config().family.as_str(),
        "options": opts,
        "task": res["task"],
        "chance_accuracy": res["chance_accuracy"],
        "episodes": res["episodes"],
        "mean_accuracy": res["mean_accuracy"],
        "margin": res["margin"],
        "max_tokens": res["max_tokens"],
        "skipped_examples": res["skipped_examples"],
        "truncated_examples": res["truncated_examples"],
        "note": res["note"],
    });
    std::fs::write(out_dir.join("icl.json"), serde_json::to_string_pretty(&v)?)?;
    Ok(v)
}

/// Per series: each value a dot, plus a min–max bar and the mean; a dashed chance line.
pub(crate) fn draw_spread(path: &Path, title: &str, series: &[(String, Vec<f64>)], chance: f64) -> Result<()> {
    crate::plot::init_fonts();
    let n = series.len().max(1);
    let root = BitMapBackend::new(path, (200 + 110 * n as u32, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..1.05)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let names: Vec<String> = series.iter().map(|s| s.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|x| crate::needle::seg_label(x, &names))
        .y_desc("accuracy")
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(-0.5, chance), (n as f64 - 0.5, chance)],
            6,
            4,
            BLACK.mix(0.5).stroke_width(1),
        ))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    for (i, (_, vals)) in series.iter().enumerate() {
        if vals.is_empty() {
            continue;
        }
        let x = i as f64;
        let c = Palette99::pick(i).to_rgba();
        let lo = vals.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let m = crate::stats::mean(vals);
        chart
            .draw_series(std::iter::once(Rectangle::new([(x - 0.25, lo), (x + 0.25, hi)], c.mix(0.25).filled())))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        chart
            .draw_series(std::iter::once(PathElement::new(vec![(x - 0.3, m), (x + 0.3, m)], c.stroke_width(3))))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        chart
            .draw_series(
                vals.iter().enumerate().map(|(j, v)| {
                    Circle::new((x - 0.2 + 0.4 * j as f64 / vals.len().max(2) as f64, *v), 3, c.filled())
                }),
            )
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    }
    root.present().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
