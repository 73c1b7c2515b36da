//! Attention allocation (docs/design.md §8) and attention sinks, from the model's effective attention map
//! (`Probe::attn_maps`, [B, heads, T, S]; for diff models A1 − λ·A2, which is SIGNED and whose rows
//! sum to about 1 − λ rather than 1).
//!
//! Allocation: for a needle prompt, the query row is the answer position (the last prompt token,
//! which predicts the answer); the answer span is the needle's value tokens; the context is every
//! token before the question. Per (layer, head), normalised by the row's total ABSOLUTE mass over
//! the context:
//! - `answer_alloc = Σ_{j∈answer} a_j / Σ_{j∈context} |a_j|` (in [−1, 1]),
//! - `noise_alloc = Σ_{j∈context∖answer} |a_j| / Σ_{j∈context} |a_j|` (in [0, 1]).
//!
//! For a softmax map these are the usual shares of the context's attention and sum to 1; for a
//! signed map they stay bounded and comparable across families. A row with zero mass over the
//! context gives NaN and is skipped in every average. Reported: the mean over layers, heads and
//! prompts, and the best retrieval head (highest answer_alloc averaged over prompts).
//!
//! The raw masses (`answer_mass`, `noise_mass`: plain sums of weights, averaged over heads and
//! layers) are kept for reference only: they differ by construction between families (a diff
//! row sums to about 1 − λ and has negative entries), so they must not be compared across families.
//!
//! Attention sinks (the source article's claim that DIFF stops dumping surplus attention on the
//! first token and on punctuation/newlines): on windows of real text, for every query row t ≥ 1
//! (row 0 can only attend to itself), the share |a_{t,0}| / Σ_j |a_{t,j}| on the first token and
//! the share on punctuation/newline tokens other than position 0, averaged over rows, heads and
//! layers; next to it, what a uniform causal map would give (`punct_fraction`: about the
//! fraction of key positions that are punctuation/newline; `first_token_uniform`).
//! Also draws one head's map for a short text.

use crate::mixture::{clean_text, needle_question, needle_sentence, read_corpus, PairFormat};
use crate::needle::{cell_seed, draw_heatmaps, load, needle_prompts, Panel};
use anyhow::{bail, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use difftx_core::model::Probe;
use difftx_core::tokenizer::Tokenizer;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionOptions {
    /// Needle depths in percent.
    pub depths: Vec<f64>,
    /// Needles per context (one is asked).
    pub needles: usize,
    /// Contexts per depth.
    pub trials: usize,
    /// Context length in tokens; None = the model's context minus a few tokens.
    pub context_len: Option<usize>,
    pub seed: u64,
    pub haystack: Option<PathBuf>,
    /// Layer and head of the single-map heatmap; layer None = the last layer.
    pub heatmap_layer: Option<usize>,
    pub heatmap_head: usize,
    /// Text of the heatmap; None = a short needle prompt.
    pub heatmap_text: Option<String>,
    /// Windows of real text (the model's context each, from the end of the evaluation text:
    /// `haystack` or the bundled corpus) for the attention-sink measure; 0 = skip it.
    #[serde(default = "default_sink_windows")]
    pub sink_windows: usize,
    /// Keys and values of the needles (as in training).
    #[serde(default)]
    pub pairs: PairFormat,
}

fn default_sink_windows() -> usize {
    4
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            depths: vec![0.0, 25.0, 50.0, 75.0, 100.0],
            needles: 1,
            trials: 4,
            context_len: None,
            seed: 0,
            haystack: None,
            heatmap_layer: None,
            heatmap_head: 0,
            heatmap_text: None,
            sink_windows: default_sink_windows(),
            pairs: PairFormat::default(),
        }
    }
}

/// Attention mass from one query position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpanMass {
    /// Sum of attention weights on the answer span.
    pub answer: f64,
    /// Sum of attention weights on the context outside the answer span.
    pub noise: f64,
}

/// One layer's map as `[heads, T, S]` (accepts `[1, heads, T, S]`).
fn heads_map(map: &Tensor) -> Result<Tensor> {
    match map.rank() {
        4 => {
            if map.dim(0)? != 1 {
                bail!("attention map has batch {}, expected 1", map.dim(0)?);
            }
            Ok(map.i(0)?)
        }
        3 => Ok(map.clone()),
        r => bail!("attention map must be [heads, T, S] or [1, heads, T, S], got rank {r}"),
    }
}

/// Row `query` of every head of one layer's map, after checking the spans fit.
fn query_rows(map: &Tensor, query: usize, answer: &Range<usize>, context: &Range<usize>) -> Result<Vec<Vec<f64>>> {
    let map = heads_map(map)?;
    let (_, t, s) = map.dims3()?;
    if query >= t {
        bail!("query position {query} is outside the map's {t} rows");
    }
    if answer.end > s || context.end > s || answer.start > answer.end || context.start > context.end {
        bail!("spans {answer:?} / {context:?} do not fit the map's {s} key positions");
    }
    Ok(map.i((.., query, ..))?.to_dtype(DType::F64)?.to_vec2()?)
}

/// Pure computation on one layer's map `[heads, T, S]` (or `[1, heads, T, S]`): for query row
/// `query`, the mass on key positions `answer` and on `context` minus `answer`, each averaged
/// over heads. Errors on bad shapes or ranges.
pub fn span_mass(map: &Tensor, query: usize, answer: Range<usize>, context: Range<usize>) -> Result<SpanMass> {
    let rows = query_rows(map, query, &answer, &context)?;
    let h = rows.len();
    let (mut a, mut n) = (0.0, 0.0);
    for row in &rows {
        a += row[answer.clone()].iter().sum::<f64>();
        n += row[context.clone()]
            .iter()
            .enumerate()
            .filter(|(j, _)| !answer.contains(&(j + context.start)))
            .map(|(_, v)| v)
            .sum::<f64>();
    }
    Ok(SpanMass { answer: a / h as f64, noise: n / h as f64 })
}

/// `span_mass` averaged over layers (one map per layer, as in `Probe::attn_maps`).
pub fn allocation(maps: &[Tensor], query: usize, answer: Range<usize>, context: Range<usize>) -> Result<SpanMass> {
    if maps.is_empty() {
        bail!("no attention maps were captured");
    }
    let mut acc = SpanMass { answer: 0.0, noise: 0.0 };
    for m in maps {
        let s = span_mass(m, query, answer.clone(), context.clone())?;
        acc.answer += s.answer;
        acc.noise += s.noise;
    }
    Ok(SpanMass { answer: acc.answer / maps.len() as f64, noise: acc.noise / maps.len() as f64 })
}

/// Allocation of one query row's attention (see the module doc): `answer` = answer_alloc,
/// `noise` = noise_alloc. NaN in both when the row has no mass over the context.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpanAlloc {
    pub answer: f64,
    pub noise: f64,
}

impl SpanAlloc {
    pub const NAN: SpanAlloc = SpanAlloc { answer: f64::NAN, noise: f64::NAN };
}

/// Allocation of one attention row: `Σ_{answer∩context} a_j / Σ_context |a_j|` and
/// `Σ_{context∖answer} |a_j| / Σ_context |a_j|`. Ranges are clipped to the row. None when the
/// absolute mass over the context is zero or not finite.
pub fn row_allocation(row: &[f64], answer: Range<usize>, context: Range<usize>) -> Option<SpanAlloc> {
    let context = context.start.min(row.len())..context.end.min(row.len());
    let total: f64 = row[context.clone()].iter().map(|v| v.abs()).sum();
    if !(total.is_finite() && total > 0.0) {
        return None;
    }
    let a: f64 = context.clone().filter(|j| answer.contains(j)).map(|j| row[j]).sum();
    let n: f64 = context.filter(|j| !answer.contains(j)).map(|j| row[j].abs()).sum();
    Some(SpanAlloc { answer: a / total, noise: n / total })
}

/// Per head of one layer's map `[heads, T, S]` (or `[1, heads, T, S]`): the allocation of row
/// `query` ([`SpanAlloc::NAN`] for a zero row). Errors on bad shapes or ranges.
pub fn head_allocations(
    map: &Tensor,
    query: usize,
    answer: Range<usize>,
    context: Range<usize>,
) -> Result<Vec<SpanAlloc>> {
    let rows = query_rows(map, query, &answer, &context)?;
    Ok(rows.iter().map(|r| row_allocation(r, answer.clone(), context.clone()).unwrap_or(SpanAlloc::NAN)).collect())
}

/// [`head_allocations`] for every layer: `[layer][head]`.
pub fn layer_head_allocations(
    maps: &[Tensor],
    query: usize,
    answer: Range<usize>,
    context: Range<usize>,
) -> Result<Vec<Vec<SpanAlloc>>> {
    if maps.is_empty() {
        bail!("no attention maps were captured");
    }
    maps.iter().map(|m| head_allocations(m, query, answer.clone(), context.clone())).collect()
}

/// Mean of the finite values; NaN when there are none.
fn finite_mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.into_iter().filter(|x| x.is_finite()).collect();
    crate::stats::mean(&v)
}

/// Mean allocation over layers and heads of a `[layer][head]` grid, skipping NaN entries.
pub fn mean_allocation(grid: &[Vec<SpanAlloc>]) -> SpanAlloc {
    SpanAlloc {
        answer: finite_mean(grid.iter().flatten().map(|a| a.answer)),
        noise: finite_mean(grid.iter().flatten().map(|a| a.noise)),
    }
}

/// The best retrieval head: highest answer_alloc averaged over prompts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BestHead {
    pub layer: usize,
    pub head: usize,
    pub answer_alloc: f64,
}

/// The (layer, head) with the highest answer_alloc averaged over prompts (each prompt a
/// `[layer][head]` grid of the same shape; NaN entries skipped); ties go to the lowest layer, then
/// head. None when no head has a finite value.
pub fn best_head(prompts: &[Vec<Vec<SpanAlloc>>]) -> Option<BestHead> {
    let first = prompts.first()?;
    let mut best: Option<BestHead> = None;
    for (l, heads) in first.iter().enumerate() {
        for h in 0..heads.len() {
            let m = finite_mean(prompts.iter().filter_map(|g| g.get(l)?.get(h)).map(|a| a.answer));
            if m.is_finite() && best.is_none_or(|b| m > b.answer_alloc) {
                best = Some(BestHead { layer: l, head: h, answer_alloc: m });
            }
        }
    }
    best
}

/// Attention-sink shares of one map (see the module doc): mean over the counted rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SinkShares {
    /// Mean |a_{t,0}| / Σ_j |a_{t,j}| over query rows t ≥ 1 (and heads, layers).
    pub first_token_share: f64,
    /// Mean share on punctuation/newline key positions other than position 0.
    pub punct_share: f64,
    /// (row, head) pairs counted (rows with zero mass are skipped).
    pub rows: usize,
}

/// Whether a token's text is punctuation or a newline: it contains a newline, or it is non-empty
/// after trimming spaces and tabs and consists only of ASCII punctuation.
pub fn is_punct_or_newline(piece: &str) -> bool {
    let t = piece.trim_matches(|c| c == ' ' || c == '\t');
    piece.contains('\n') || (!t.is_empty() && t.chars().all(|c| c.is_ascii_punctuation()))
}

/// Per position of `ids`: whether the token is punctuation or a newline ([`is_punct_or_newline`]).
pub fn punct_mask(tok: &Tokenizer, ids: &[u32]) -> Result<Vec<bool>> {
    ids.iter().map(|&i| Ok(is_punct_or_newline(&tok.decode(&[i])?))).collect()
}

/// Sink shares of one layer's map `[heads, T, S]` (or `[1, heads, T, S]`), with `punct` the
/// per-key-position mask (length S). Rows t ≥ 1 only; a row whose absolute mass is zero is
/// skipped; NaN shares when no row counts.
pub fn sink_shares(map: &Tensor, punct: &[bool]) -> Result<SinkShares> {
    let map = heads_map(map)?;
    let (_, t, s) = map.dims3()?;
    if punct.len() != s {
        bail!("punctuation mask has {} positions but the map has {s} keys", punct.len());
    }
    let all: Vec<Vec<Vec<f64>>> = map.to_dtype(DType::F64)?.to_vec3()?;
    let (mut first, mut pun, mut rows) = (0.0, 0.0, 0usize);
    for head in &all {
        for row in head.iter().take(t).skip(1) {
            let total: f64 = row.iter().map(|v| v.abs()).sum();
            if !(total.is_finite() && total > 0.0) {
                continue;
            }
            first += row[0].abs() / total;
            pun += row.iter().zip(punct).skip(1).filter(|(_, p)| **p).map(|(v, _)| v.abs()).sum::<f64>() / total;
            rows += 1;
        }
    }
    let n = rows as f64;
    Ok(SinkShares {
        first_token_share: if rows == 0 { f64::NAN } else { first / n },
        punct_share: if rows == 0 { f64::NAN } else { pun / n },
        rows,
    })
}

/// [`sink_shares`] averaged over layers (each layer weighs the same; NaN layers skipped); `rows`
/// is the total over layers.
pub fn sink_over_layers(maps: &[Tensor], punct: &[bool]) -> Result<SinkShares> {
    if maps.is_empty() {
        bail!("no attention maps were captured");
    }
    let per: Vec<SinkShares> = maps.iter().map(|m| sink_shares(m, punct)).collect::<Result<_>>()?;
    Ok(SinkShares {
        first_token_share: finite_mean(per.iter().map(|s| s.first_token_share)),
        punct_share: finite_mean(per.iter().map(|s| s.punct_share)),
        rows: per.iter().map(|s| s.rows).sum(),
    })
}

/// What a uniform causal map over `punct.len()` tokens would give for [`sink_shares`]:
/// (first_token_share, punct_share) = mean over rows t ≥ 1 of 1/(t+1) and of
/// `#{1 ≤ j ≤ t: punct[j]}/(t+1)`. NaN for fewer than two tokens.
pub fn uniform_causal_shares(punct: &[bool]) -> (f64, f64) {
    if punct.len() < 2 {
        return (f64::NAN, f64::NAN);
    }
    let (mut first, mut pun, mut count) = (0.0, 0.0, 0usize);
    for (t, &is_punct) in punct.iter().enumerate().skip(1) {
        if is_punct {
            count += 1;
        }
        first += 1.0 / (t + 1) as f64;
        pun += count as f64 / (t + 1) as f64;
    }
    let n = (punct.len() - 1) as f64;
    (first / n, pun / n)
}

/// Token range of the byte range `bytes` of `text` (by encoding prefixes).
fn token_span(tok: &Tokenizer, text: &str, bytes: Range<usize>) -> Result<Range<usize>> {
    let a = tok.encode(&text[..bytes.start])?.len();
    let b = tok.encode(&text[..bytes.end])?.len();
    Ok(a..b.max(a + 1))
}

fn capture(model: &difftx_core::Model, ids: &[u32]) -> Result<Vec<Tensor>> {
    let x = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    let mut probe = Probe { capture_attention: true, ..Default::default() };
    model.forward_probe(&x, None, Some(&mut probe))?;
    if probe.attn_maps.len() != model.config().n_layers {
        bail!("the model recorded {} attention maps for {} layers", probe.attn_maps.len(), model.config().n_layers);
    }
    Ok(probe.attn_maps)
}

/// One measured needle prompt, in tokens: the prompt ids (the query row is the last one), the
/// answer span (the needle's value) and the context (every token before the question).
struct NeedleCase {
    ids: Vec<u32>,
    answer: Range<usize>,
    context: Range<usize>,
}

/// The ONLY code that knows the needle prompt's format (adapt here when it changes): one prompt
/// with `needles` needles, the asked one at `depth` (0..=1), in `len` tokens. The question is
/// taken to be the prompt's last line (its exact text is not used). None when it does not fit.
fn needle_case(
    tok: &Tokenizer,
    clean: &str,
    pairs: &PairFormat,
    needles: usize,
    len: usize,
    depth: f64,
    rng: &mut StdRng,
) -> Result<Option<NeedleCase>> {
    let Some(prompts) = needle_prompts(tok, clean, pairs, needles, 1, len, depth, rng)? else {
        return Ok(None);
    };
    let (text, ids, _, bytes) = prompts.into_iter().next().context("no needle prompt was built")?;
    let q_start = text.rfind('\n').context("needle prompt has no question line")?;
    if bytes.end > q_start {
        bail!("the needle's answer lies inside the question line");
    }
    let context = 0..tok.encode(&text[..q_start])?.len();
    let answer = token_span(tok, &text, bytes)?;
    Ok(Some(NeedleCase { ids, answer, context }))
}

/// Sink measure on up to `windows` windows of the model's context from the end of `text`:
/// `{"first_token_share", "punct_share", "punct_fraction", "first_token_uniform", "windows",
/// "window_tokens"}` (means over windows).
fn sink_measure(model: &difftx_core::Model, tok: &Tokenizer, text: &str, windows: usize) -> Result<serde_json::Value> {
    let ctx = model.config().max_seq_len;
    // the tail of the text is enough (and keeps tokenising a large corpus cheap)
    let mut cut = text.len().saturating_sub(windows * ctx * 16 + 16);
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    let tokens = tok.encode(&text[cut..])?;
    if tokens.len() < 3 {
        bail!("attention: the evaluation text has {} tokens; the sink measure needs at least 3", tokens.len());
    }
    let seq = ctx.min(tokens.len() - 1);
    let wins = crate::common::token_windows(&tokens, seq, windows * seq)?;
    let (mut first, mut pun, mut frac, mut ufirst) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for w in &wins {
        let ids = &w[..seq];
        let mask = punct_mask(tok, ids)?;
        let s = sink_over_layers(&capture(model, ids)?, &mask)?;
        let (uf, up) = uniform_causal_shares(&mask);
        first.push(s.first_token_share);
        pun.push(s.punct_share);
        ufirst.push(uf);
        frac.push(up);
    }
    Ok(serde_json::json!({
        "first_token_share": finite_mean(first),
        "punct_share": finite_mean(pun),
        "punct_fraction": finite_mean(frac),
        "first_token_uniform": finite_mean(ufirst),
        "windows": wins.len(),
        "window_tokens": seq,
    }))
}

const DEFINITIONS: &str = "answer_alloc = sum of weights on the answer span / sum of |weights| over the context; \
noise_alloc = sum of |weights| on the context outside the answer / sum of |weights| over the context (per layer \
and head at the answer query row; rows with no mass skipped; mean over layers, heads, prompts). These compare \
across families. answer_mass / noise_mass are raw sums of weights (mean over heads and layers): a differential \
map A1 - lambda*A2 is signed and its rows sum to about 1 - lambda, so raw masses differ between families by \
construction; reference only. best_head: the (layer, head) with the highest answer_alloc averaged over prompts. \
sink: on windows of real text, for query rows t >= 1, |a_t0| / sum_j |a_tj| (first_token_share) and the share on \
punctuation/newline tokens other than position 0 (punct_share), mean over rows, heads, layers, windows; \
punct_fraction and first_token_uniform are what a uniform causal map would give.";

/// Runs the attention-allocation and attention-sink measurements; writes `attention.json`,
/// `attention.png` (allocation bars per depth) and `attention_head.png` (one head's map for a
/// short text). JSON keys: "mean_answer_alloc", "mean_noise_alloc", "best_head" {"layer",
/// "head", "answer_alloc"}, "sink" {"first_token_share", "punct_share", "punct_fraction",
/// "first_token_uniform", "windows", "window_tokens"} (null when `sink_windows` is 0),
/// "mean_answer_mass", "mean_noise_mass" (raw, reference only), "depths" [{"depth",
/// "answer_alloc", "noise_alloc", "answer_mass", "noise_mass"}], "definitions", plus the run's
/// description ("instrument", "model", "family", "options", "context_len", "heatmap").
pub fn run_attention(model_dir: &Path, opts: &AttentionOptions, out_dir: &Path) -> Result<serde_json::Value> {
    if opts.depths.is_empty() || opts.trials == 0 || opts.needles == 0 {
        bail!("attention: depths, trials and needles must be non-empty / positive");
    }
    if let Some(d) = opts.depths.iter().find(|d| !(0.0..=100.0).contains(*d)) {
        bail!("attention: depth {d} is outside 0..100 percent");
    }
    let (model, tok) = load(model_dir)?;
    let cfg = model.config().clone();
    let layer = opts.heatmap_layer.unwrap_or(cfg.n_layers - 1);
    if layer >= cfg.n_layers || opts.heatmap_head >= cfg.n_heads {
        bail!(
            "attention: heatmap layer {layer} / head {} not in the model ({} layers, {} heads)",
            opts.heatmap_head,
            cfg.n_layers,
            cfg.n_heads
        );
    }
    let len = opts.context_len.unwrap_or(cfg.max_seq_len.saturating_sub(4));
    if len > cfg.max_seq_len {
        bail!("attention: context length {len} exceeds the model's context of {}", cfg.max_seq_len);
    }
    let clean = clean_text(&read_corpus(opts.haystack.as_deref())?);
    // (depth, answer mass, noise mass, answer alloc, noise alloc)
    let mut per_depth: Vec<(f64, f64, f64, f64, f64)> = Vec::new();
    let mut grids: Vec<Vec<Vec<SpanAlloc>>> = Vec::new();
    for (di, &d) in opts.depths.iter().enumerate() {
        let (mut a, mut n, mut aa, mut na) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for trial in 0..opts.trials {
            let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[77, di as u64, trial as u64]));
            let Some(case) = needle_case(&tok, &clean, &opts.pairs, opts.needles, len, d / 100.0, &mut rng)? else {
                bail!("attention: {} needle(s) and a question do not fit {len} tokens", opts.needles);
            };
            let maps = capture(&model, &case.ids)?;
            let q = case.ids.len() - 1;
            let m = allocation(&maps, q, case.answer.clone(), case.context.clone())?;
            let grid = layer_head_allocations(&maps, q, case.answer, case.context)?;
            let al = mean_allocation(&grid);
            a.push(m.answer);
            n.push(m.noise);
            aa.push(al.answer);
            na.push(al.noise);
            grids.push(grid);
        }
        per_depth.push((d, crate::stats::mean(&a), crate::stats::mean(&n), finite_mean(aa), finite_mean(na)));
    }
    let best = best_head(&grids);
    let sink = if opts.sink_windows == 0 {
        serde_json::Value::Null
    } else {
        let (text, _) = crate::common::read_eval_text(opts.haystack.as_deref())?;
        sink_measure(&model, &tok, &text, opts.sink_windows)?
    };
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let bars = vec![(cfg.family.as_str().to_string(), per_depth.iter().map(|x| (x.0, x.3, x.4)).collect())];
    draw_bars_labelled(
        &out_dir.join("attention.png"),
        &format!("attention allocation ({})", cfg.family.as_str()),
        "share of |attention| over the context",
        &bars,
    )?;

    // One head's map for a short text.
    let text = opts.heatmap_text.clone().unwrap_or_else(|| {
        format!("Once upon a time. {} Then more. {}", needle_sentence("k", "4"), needle_question("k"))
    });
    let ids = tok.encode(&text)?;
    if ids.is_empty() || ids.len() > cfg.max_seq_len {
        bail!("attention: heatmap text has {} tokens; it must have 1..={}", ids.len(), cfg.max_seq_len);
    }
    let maps = capture(&model, &ids)?;
    let head: Vec<Vec<f64>> = maps[layer].i((0, opts.heatmap_head))?.to_dtype(DType::F64)?.to_vec2()?;
    let labels: Vec<String> = ids.iter().map(|&i| tok.decode(&[i]).unwrap_or_default().replace(' ', "_")).collect();
    let lo = head.iter().flatten().cloned().fold(0.0, f64::min);
    let hi = head.iter().flatten().cloned().fold(0.0, f64::max).max(1e-6);
    let panel = Panel {
        title: format!("layer {layer} head {} ({})", opts.heatmap_head, cfg.family.as_str()),
        // rows drawn bottom-up: reverse so the first query is on top
        rows: labels.iter().rev().cloned().collect(),
        cols: labels.clone(),
        values: head.iter().rev().map(|r| r.iter().map(|v| Some(*v)).collect()).collect(),
    };
    let title = "one head's attention map (rows: queries, cols: keys)";
    draw_heatmaps(&out_dir.join("attention_head.png"), title, &[panel], lo, hi)?;

    let depths: Vec<serde_json::Value> = per_depth
        .iter()
        .map(|(d, a, n, aa, na)| {
            serde_json::json!({"depth": d, "answer_alloc": aa, "noise_alloc": na, "answer_mass": a, "noise_mass": n})
        })
        .collect();
    let col = |k: fn(&(f64, f64, f64, f64, f64)) -> f64| per_depth.iter().map(k).collect::<Vec<f64>>();
    let v = serde_json::json!({
        "instrument": "attention",
        "model": model_dir.display().to_string(),
        "family": cfg.family.as_str(),
        "options": opts,
        "context_len": len,
        "definitions": DEFINITIONS,
        "depths": depths,
        "mean_answer_alloc": finite_mean(col(|x| x.3)),
        "mean_noise_alloc": finite_mean(col(|x| x.4)),
        "best_head": best,
        "sink": sink,
        // raw masses: reference only, they differ between families by construction
        "mean_answer_mass": crate::stats::mean(&col(|x| x.1)),
        "mean_noise_mass": crate::stats::mean(&col(|x| x.2)),
        "heatmap": {"layer": layer, "head": opts.heatmap_head, "tokens": ids.len()},
    });
    std::fs::write(out_dir.join("attention.json"), serde_json::to_string_pretty(&v)?)?;
    Ok(v)
}

/// Grouped bars: for each series (e.g. a family), per depth, answer mass (solid) and noise mass
/// (hatched lighter). `series`: (name, [(depth, answer, noise)]).
/// A bar series: name and (depth, answer mass, noise mass) per depth.
pub(crate) type BarSeries = (String, Vec<(f64, f64, f64)>);

pub(crate) fn draw_bars(path: &Path, title: &str, series: &[BarSeries]) -> Result<()> {
    draw_bars_labelled(path, title, "attention mass (mean over heads, layers)", series)
}

/// [`draw_bars`] with a y-axis label of choice.
pub(crate) fn draw_bars_labelled(path: &Path, title: &str, y_desc: &str, series: &[BarSeries]) -> Result<()> {
    crate::plot::init_fonts();
    let depths: Vec<f64> = series.first().map(|s| s.1.iter().map(|x| x.0).collect()).unwrap_or_default();
    let nd = depths.len().max(1);
    let ns = series.len().max(1);
    let ymax = series.iter().flat_map(|s| s.1.iter().flat_map(|x| [x.1, x.2])).fold(0.0f64, f64::max).max(0.05) * 1.45;
    let ymin = series.iter().flat_map(|s| s.1.iter().flat_map(|x| [x.1, x.2])).fold(0.0f64, f64::min) * 1.15;
    let root = BitMapBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..nd as f64 - 0.5, ymin..ymax)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let d2 = depths.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(nd + 1)
        .x_label_formatter(&|x| crate::needle::seg_label(x, &d2.iter().map(|d| format!("{d:.0}%")).collect::<Vec<_>>()))
        .x_desc("needle depth")
        .y_desc(y_desc)
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let w = 0.8 / (2 * ns) as f64;
    for (si, (name, vals)) in series.iter().enumerate() {
        let c = Palette99::pick(si).to_rgba();
        let light = RGBAColor(c.0, c.1, c.2, 0.35);
        for (di, &(_, a, n)) in vals.iter().enumerate() {
            let x0 = di as f64 - 0.4 + (2 * si) as f64 * w;
            chart
                .draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (x0 + w, a)], c.filled())))
                .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
            chart
                .draw_series(std::iter::once(Rectangle::new([(x0 + w, 0.0), (x0 + 2.0 * w, n)], light.filled())))
                .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        }
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], c.filled())))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?
            .label(format!("{name}: answer span (solid) / noise (light)"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
