//! Multi-needle retrieval in real haystack text (the paper's multi-needle test at small scale): N
//! needles, key-value pairs `k:v` (shapes in [`PairFormat`]), in a haystack at depths 0..100%,
//! R of them asked (a new line `k:`); a question counts as correct when the greedy answer equals
//! the value exactly. Accuracy per (context length × depth) for each (N, R) sweep, written as
//! JSON and a heatmap per sweep.
//!
//! Placement: the R asked needles sit together at the given depth; the N − R others at random
//! depths. One prompt per asked needle (same context, different question).

use crate::mixture::{
    clean_text, haystack, insert_at_depths, needle_question, needle_sentence, read_corpus, PairFormat,
};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use difftx_core::model::{last_logits, KvCache, Model};
use difftx_core::tokenizer::Tokenizer;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NeedleOptions {
    /// (N needles, R asked) pairs.
    pub sweeps: Vec<(usize, usize)>,
    /// Context lengths in tokens; empty = four evenly spaced from half the model's context to all of it.
    pub context_lengths: Vec<usize>,
    /// Depths in percent, 0..=100.
    pub depths: Vec<f64>,
    /// Contexts per (length, depth) cell.
    pub trials: usize,
    pub seed: u64,
    /// Haystack text; None = the bundled corpus.
    pub haystack: Option<PathBuf>,
    /// Keys and values of the needles.
    #[serde(default)]
    pub pairs: PairFormat,
}

impl Default for NeedleOptions {
    fn default() -> Self {
        NeedleOptions {
            sweeps: vec![(1, 1), (2, 2), (4, 2), (6, 2)],
            context_lengths: Vec::new(),
            depths: vec![0.0, 25.0, 50.0, 75.0, 100.0],
            trials: 4,
            seed: 0,
            haystack: None,
            pairs: PairFormat::default(),
        }
    }
}

impl NeedleOptions {
    pub fn validate(&self) -> Result<()> {
        if self.sweeps.is_empty() || self.depths.is_empty() || self.trials == 0 {
            bail!("needle: sweeps, depths and trials must be non-empty / positive");
        }
        for &(n, r) in &self.sweeps {
            if n == 0 || r == 0 || r > n {
                bail!("needle: sweep N={n}, R={r} is invalid (need 1 <= R <= N)");
            }
        }
        if let Some(d) = self.depths.iter().find(|d| !(0.0..=100.0).contains(*d)) {
            bail!("needle: depth {d} is outside 0..100 percent");
        }
        if let Some(&(n, _)) = self.sweeps.iter().find(|s| s.0 > self.pairs.key_space()) {
            bail!("needle: {n} needles need distinct keys, but the key format has only {}", self.pairs.key_space());
        }
        self.pairs.validate()
    }
}

/// Loads a model folder (or run folder) and its tokenizer, with one-line errors.
/// One asked needle: (prompt text, prompt ids, expected answer, answer byte range in the text).
pub type NeedlePrompt = (String, Vec<u32>, String, std::ops::Range<usize>);

/// Answers a needle prompt: `(prompt ids, answer length in tokens) -> generated ids`.
pub type Answerer<'a> = dyn FnMut(&[u32], usize) -> Result<Vec<u32>> + 'a;

pub(crate) fn load(model_dir: &Path) -> Result<(Model, Tokenizer)> {
    let model = difftx_core::checkpoint::load_runnable(model_dir, &Device::Cpu)
        .with_context(|| format!("cannot load a model from {}", model_dir.display()))?;
    let dir = difftx_core::checkpoint::resolve_model_dir(model_dir)?;
    let tok = Tokenizer::from_model_dir(&dir).with_context(|| format!("no usable tokenizer in {}", dir.display()))?;
    Ok((model, tok))
}

/// Greedy continuation of `prompt` by `n` tokens (stops early at the context end).
pub(crate) fn greedy(model: &Model, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut cache = KvCache::new(model.config());
    let mut out = Vec::with_capacity(n);
    let mut input = Tensor::new(prompt, model.device())?.unsqueeze(0)?;
    for _ in 0..n {
        if cache.seq_len() + input.dim(1)? > model.config().max_seq_len {
            break;
        }
        let logits = model.forward(&input, Some(&mut cache))?;
        let l = last_logits(&logits)?;
        let next = difftx_core::generate::argmax(&l);
        out.push(next);
        input = Tensor::new(&[next], model.device())?.unsqueeze(0)?;
    }
    Ok(out)
}

/// Encodes `text`, trimming haystack characters until it fits `max_tokens`; `build(h)` makes the
/// text from a haystack budget of `h` characters. Returns None if even an empty haystack is too long.
pub(crate) fn fit_tokens(
    tok: &Tokenizer,
    max_tokens: usize,
    mut hay: usize,
    build: impl Fn(usize) -> String,
) -> Result<Option<(String, Vec<u32>, usize)>> {
    for _ in 0..12 {
        let text = build(hay);
        let ids = tok.encode(&text)?;
        if ids.len() <= max_tokens {
            return Ok(Some((text, ids, hay)));
        }
        if hay == 0 {
            return Ok(None);
        }
        hay = hay.saturating_sub((ids.len() - max_tokens).max(hay / 8).max(1));
    }
    Ok(None)
}

/// One cell's contexts (public for tests): for a sweep (n, r), length `len` tokens, depth fraction `depth`.
/// Returns (prompt text, prompt ids, answer, answer byte range in the prompt) per asked needle, or None when the needles and question do not fit.
#[allow(clippy::too_many_arguments)]
pub fn needle_prompts(
    tok: &Tokenizer,
    clean: &str,
    fmt: &PairFormat,
    n: usize,
    r: usize,
    len: usize,
    depth: f64,
    rng: &mut impl Rng,
) -> Result<Option<Vec<NeedlePrompt>>> {
    let needles = fmt.pairs(n, rng);
    let mut depths: Vec<f64> = Vec::with_capacity(n);
    for i in 0..n {
        depths.push(if i < r { depth } else { rng.random_range(0.0..=1.0) });
    }
    let sentences: Vec<(String, f64)> =
        needles.iter().zip(&depths).map(|((k, v), d)| (needle_sentence(k, v), *d)).collect();
    let fixed: usize =
        sentences.iter().map(|s| s.0.len() + 1).sum::<usize>() + needle_question(&needles[0].0).len() + 1;
    let hay_source = haystack(clean, len.saturating_sub(fixed) + 64, rng);
    let build_ctx = |h: usize| -> (String, Vec<std::ops::Range<usize>>) {
        let h = h.min(hay_source.len());
        let mut cut = &hay_source[..h];
        if h < hay_source.len() {
            if let Some(p) = cut.rfind(' ') {
                cut = &cut[..p];
            }
        }
        insert_at_depths(cut, &sentences)
    };
    let Some((_, _, hay)) = fit_tokens(tok, len, len.saturating_sub(fixed), |h| {
        format!("{}\n{}", build_ctx(h).0, needle_question(&needles[0].0))
    })?
    else {
        return Ok(None);
    };
    let (ctx, ranges) = build_ctx(hay);
    let mut out = Vec::new();
    for (i, (k, v)) in needles.iter().enumerate().take(r) {
        let prompt = format!("{ctx}\n{}", needle_question(k));
        let ids = tok.encode(&prompt)?;
        if ids.len() > len {
            return Ok(None);
        }
        // the value's byte range inside the needle sentence
        let s = ranges[i].start + needle_sentence(k, v).rfind(v.as_str()).unwrap_or(0);
        out.push((prompt, ids, v.clone(), s..s + v.len()));
    }
    Ok(Some(out))
}

fn auto_lengths(max: usize, answer_tokens: usize) -> Vec<usize> {
    let top = max.saturating_sub(answer_tokens);
    let mut v: Vec<usize> = (3..=6).map(|i| top * i / 6).filter(|&l| l > 0).collect();
    v.dedup();
    v
}

pub(crate) fn cell_seed(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(seed ^ 0x5151_2024, |h, &p| (h ^ p).wrapping_mul(0x100_0000_01b3).rotate_left(17))
}

/// The sweeps of `opts` answered by `answer(prompt_ids, n_answer_tokens) -> generated ids`
/// (the model's greedy decoding in [`run_needle`]; any oracle in tests). `max_seq_len` is the
/// model's context. Returns `{"context_lengths", "sweeps": [{n, r, accuracy[len][depth] (null:
/// does not fit), mean_accuracy, questions}], "mean_accuracy"}`; errors if nothing fits.
pub fn evaluate_needles(
    tok: &Tokenizer,
    opts: &NeedleOptions,
    max_seq_len: usize,
    answer: &mut Answerer<'_>,
) -> Result<serde_json::Value> {
    opts.validate()?;
    let clean = clean_text(&read_corpus(opts.haystack.as_deref())?);
    if clean.len() < 1000 {
        bail!("needle: haystack text is too short ({} usable characters)", clean.len());
    }
    let max = max_seq_len;
    let ans_tokens = tok.encode(&"9".repeat(opts.pairs.value_digits))?.len();
    let lengths =
        if opts.context_lengths.is_empty() { auto_lengths(max, ans_tokens) } else { opts.context_lengths.clone() };
    if let Some(l) = lengths.iter().find(|&&l| l + ans_tokens > max || l == 0) {
        bail!("needle: context length {l} does not fit the model's context of {max} tokens (answer needs {ans_tokens} more)");
    }
    let mut sweeps_json = Vec::new();
    let mut all_correct = 0usize;
    let mut all_total = 0usize;
    for (si, &(n, r)) in opts.sweeps.iter().enumerate() {
        let mut grid: Vec<Vec<Option<f64>>> = Vec::new();
        let (mut sc, mut st) = (0usize, 0usize);
        for (li, &len) in lengths.iter().enumerate() {
            let mut row = Vec::new();
            for (di, &d) in opts.depths.iter().enumerate() {
                let (mut c, mut t, mut fits) = (0usize, 0usize, true);
                for trial in 0..opts.trials {
                    let mut rng =
                        StdRng::seed_from_u64(cell_seed(opts.seed, &[si as u64, li as u64, di as u64, trial as u64]));
                    let Some(prompts) = needle_prompts(tok, &clean, &opts.pairs, n, r, len, d / 100.0, &mut rng)?
                    else {
                        fits = false;
                        break;
                    };
                    for (_, ids, want, _) in prompts {
                        let k = tok.encode(&want)?.len();
                        let got = tok.decode(&answer(&ids, k)?)?;
                        t += 1;
                        if got == want {
                            c += 1;
                        }
                    }
                }
                if fits && t > 0 {
                    sc += c;
                    st += t;
                    row.push(Some(c as f64 / t as f64));
                } else {
                    row.push(None);
                }
            }
            grid.push(row);
        }
        all_correct += sc;
        all_total += st;
        let mean = if st > 0 { Some(sc as f64 / st as f64) } else { None };
        sweeps_json.push(serde_json::json!({
            "n": n, "r": r, "context_lengths": lengths, "depths": opts.depths,
            "accuracy": grid, "mean_accuracy": mean, "questions": st,
            "note": if mean.is_none() { "no context length fits these needles and question" } else { "" },
        }));
    }
    if all_total == 0 {
        bail!("needle: the model's context of {max} tokens is too short for any sweep's needles and question");
    }
    Ok(serde_json::json!({
        "context_lengths": lengths,
        "sweeps": sweeps_json,
        "mean_accuracy": all_correct as f64 / all_total as f64,
        "chance_accuracy": opts.pairs.chance(),
    }))
}

/// Heatmap panels (one per sweep) from the JSON of [`evaluate_needles`].
pub(crate) fn sweep_panels(v: &serde_json::Value, prefix: &str) -> Vec<Panel> {
    v["sweeps"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|sw| Panel {
            title: format!("{prefix}N={}, R={}", sw["n"], sw["r"]),
            rows: sw["context_lengths"]
                .as_array()
                .map(|a| a.iter().map(|x| x.to_string()).collect())
                .unwrap_or_default(),
            cols: sw["depths"]
                .as_array()
                .map(|a| a.iter().map(|x| format!("{:.0}%", x.as_f64().unwrap_or(0.0))).collect())
                .unwrap_or_default(),
            values: sw["accuracy"]
                .as_array()
                .map(|rows| {
                    rows.iter()
                        .map(|r| r.as_array().map(|c| c.iter().map(|x| x.as_f64()).collect()).unwrap_or_default())
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Runs the multi-needle sweeps on the model in `model_dir` (greedy answers); writes
/// `needle.json` and `needle.png` (one heatmap per sweep).
pub fn run_needle(model_dir: &Path, opts: &NeedleOptions, out_dir: &Path) -> Result<serde_json::Value> {
    opts.validate()?;
    let (model, tok) = load(model_dir)?;
    let max = model.config().max_seq_len;
    let res = evaluate_needles(&tok, opts, max, &mut |ids, k| greedy(&model, ids, k))?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    draw_heatmaps(
        &out_dir.join("needle.png"),
        "multi-needle retrieval accuracy (rows: context tokens, cols: depth; grey: does not fit)",
        &sweep_panels(&res, ""),
        0.0,
        1.0,
    )?;
    let v = serde_json::json!({
        "instrument": "needle",
        "model": model_dir.display().to_string(),
        "family": model.config().family.as_str(),
        "max_seq_len": max,
        "options": opts,
        "context_lengths": res["context_lengths"],
        "sweeps": res["sweeps"],
        "mean_accuracy": res["mean_accuracy"],
        "chance_accuracy": res["chance_accuracy"],
    });
    std::fs::write(out_dir.join("needle.json"), serde_json::to_string_pretty(&v)?)?;
    Ok(v)
}

/// One heatmap panel: `values[row][col]`, None drawn grey.
pub(crate) struct Panel {
    pub title: String,
    pub rows: Vec<String>,
    pub cols: Vec<String>,
    pub values: Vec<Vec<Option<f64>>>,
}

pub(crate) fn color(v: f64, lo: f64, hi: f64) -> RGBColor {
    if lo < 0.0 && hi > 0.0 {
        // diverging: blue (neg) - white - red (pos)
        let t = if v >= 0.0 { (v / hi).clamp(0.0, 1.0) } else { -(v / lo).clamp(0.0, 1.0) };
        if t >= 0.0 {
            RGBColor(255, (255.0 * (1.0 - t)) as u8, (255.0 * (1.0 - t)) as u8)
        } else {
            RGBColor((255.0 * (1.0 + t)) as u8, (255.0 * (1.0 + t)) as u8, 255)
        }
    } else {
        let t = ((v - lo) / (hi - lo).max(1e-12)).clamp(0.0, 1.0);
        RGBColor((255.0 * (1.0 - t)) as u8, (255.0 * (1.0 - 0.5 * t)) as u8, (255.0 * (1.0 - 0.2 * t)) as u8)
    }
}

/// Tick label at integer positions (cell centres), empty elsewhere.
pub(crate) fn seg_label(v: &f64, names: &[String]) -> String {
    if (v - v.round()).abs() < 1e-6 && *v >= 0.0 {
        names.get(v.round() as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

/// Draws panels side by side (wrapping after 4) with value labels when cells are large enough.
pub(crate) fn draw_heatmaps(path: &Path, title: &str, panels: &[Panel], lo: f64, hi: f64) -> Result<()> {
    crate::plot::init_fonts();
    let per_row = panels.len().clamp(1, 4);
    let n_rows = panels.len().div_ceil(per_row).max(1);
    let (pw, ph) = if panels.len() == 1 { (760u32, 720u32) } else { (400u32, 340u32) };
    let root = BitMapBackend::new(path, (pw * per_row as u32, ph * n_rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.draw_text(title, &("sans-serif", 18).into_font().color(&BLACK), (10, 10))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let area = root.margin(40, 0, 0, 0);
    let cells = area.split_evenly((n_rows, per_row));
    for (p, a) in panels.iter().zip(cells.iter()) {
        let nr = p.rows.len().max(1);
        let nc = p.cols.len().max(1);
        let mut chart = ChartBuilder::on(a)
            .caption(&p.title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(-0.5f64..nc as f64 - 0.5, -0.5f64..nr as f64 - 0.5)
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        let cols = p.cols.clone();
        let rows = p.rows.clone();
        let big = nr <= 12 && nc <= 12;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(if nc <= 12 { nc + 1 } else { 12 })
            .y_labels(if nr <= 12 { nr + 1 } else { 12 })
            .x_label_formatter(&|i| seg_label(i, &cols))
            .y_label_formatter(&|i| seg_label(i, &rows))
            .label_style(("sans-serif", 11))
            .draw()
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        for (ri, row) in p.values.iter().enumerate() {
            for (ci, v) in row.iter().enumerate() {
                let c = match v {
                    Some(x) if x.is_finite() => color(*x, lo, hi),
                    _ => RGBColor(200, 200, 200),
                };
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(ci as f64 - 0.5, ri as f64 - 0.5), (ci as f64 + 0.5, ri as f64 + 0.5)],
                        c.filled(),
                    )))
                    .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
                if big {
                    if let Some(x) = v {
                        let (px, py) = chart.backend_coord(&(ci as f64 - 0.5, ri as f64 + 0.5));
                        let (qx, qy) = chart.backend_coord(&(ci as f64 + 0.5, ri as f64 - 0.5));
                        a.draw_text(
                            &format!("{x:.2}"),
                            &("sans-serif", 11).into_font().color(&BLACK),
                            (((px + qx) / 2 - 12) - a.get_base_pixel().0, ((py + qy) / 2 - 6) - a.get_base_pixel().1),
                        )
                        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
                    }
                }
            }
        }
    }
    root.present().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
