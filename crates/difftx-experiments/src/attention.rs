//! Attention allocation (SPEC §4): attention mass from the answer position (the last prompt
//! token, which predicts the answer) to the answer span (the needle's value tokens) versus to the
//! rest of the context ("noise"), per needle depth, averaged over heads and layers. The map is the
//! model's effective attention map (`Probe::attn_maps`; for diff models A1 − λ·A2).
//! Also draws one head's map for a short text.

use crate::mixture::{clean_text, needle_question, needle_sentence, read_corpus};
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

/// Pure computation on one layer's map `[heads, T, S]` (or `[1, heads, T, S]`): for query row
/// `query`, the mass on key positions `answer` and on `context` minus `answer`, each averaged
/// over heads. Errors on bad shapes or ranges.
pub fn span_mass(map: &Tensor, query: usize, answer: Range<usize>, context: Range<usize>) -> Result<SpanMass> {
    let map = match map.rank() {
        4 => {
            if map.dim(0)? != 1 {
                bail!("attention map has batch {}, expected 1", map.dim(0)?);
            }
            map.i(0)?
        }
        3 => map.clone(),
        r => bail!("attention map must be [heads, T, S] or [1, heads, T, S], got rank {r}"),
    };
    let (h, t, s) = map.dims3()?;
    if query >= t {
        bail!("query position {query} is outside the map's {t} rows");
    }
    if answer.end > s || context.end > s || answer.start > answer.end || context.start > context.end {
        bail!("spans {answer:?} / {context:?} do not fit the map's {s} key positions");
    }
    let rows: Vec<Vec<f64>> = map.i((.., query, ..))?.to_dtype(DType::F64)?.to_vec2()?;
    let (mut a, mut n) = (0.0, 0.0);
    for row in &rows {
        a += row[answer.clone()].iter().sum::<f64>();
        n += row[context.clone()].iter().enumerate().filter(|(j, _)| !answer.contains(&(j + context.start))).map(|(_, v)| v).sum::<f64>();
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

/// Runs the attention-allocation measurement; writes `attention.json`, `attention.png` (bars per
/// depth) and `attention_head.png` (one head's map for a short text).
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
        bail!("attention: heatmap layer {layer} / head {} not in the model ({} layers, {} heads)", opts.heatmap_head, cfg.n_layers, cfg.n_heads);
    }
    let len = opts.context_len.unwrap_or(cfg.max_seq_len.saturating_sub(4));
    if len > cfg.max_seq_len {
        bail!("attention: context length {len} exceeds the model's context of {}", cfg.max_seq_len);
    }
    let clean = clean_text(&read_corpus(opts.haystack.as_deref())?);
    let mut per_depth = Vec::new();
    let mut shares = Vec::new();
    for (di, &d) in opts.depths.iter().enumerate() {
        let (mut a, mut n, mut share) = (Vec::new(), Vec::new(), Vec::new());
        for trial in 0..opts.trials {
            let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[77, di as u64, trial as u64]));
            let Some(prompts) = needle_prompts(&tok, &clean, &crate::mixture::PairFormat::default(), opts.needles, 1, len, d / 100.0, &mut rng)? else {
                bail!("attention: {} needle(s) and a question do not fit {len} tokens", opts.needles);
            };
            let (text, ids, _, bytes) = &prompts[0];
            let q_start = text.rfind('\n').context("question not found")?;
            let ctx = 0..tok.encode(&text[..q_start])?.len();
            let span = token_span(&tok, text, bytes.clone())?;
            let maps = capture(&model, ids)?;
            let m = allocation(&maps, ids.len() - 1, span, ctx)?;
            a.push(m.answer);
            n.push(m.noise);
            share.push(m.answer / (m.answer + m.noise));
        }
        per_depth.push((d, crate::stats::mean(&a), crate::stats::mean(&n)));
        shares.push(crate::stats::mean(&share));
    }
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    draw_bars(&out_dir.join("attention.png"), &format!("attention allocation ({})", cfg.family.as_str()), &[(cfg.family.as_str().to_string(), per_depth.clone())])?;

    // One head's map for a short text.
    let text = opts.heatmap_text.clone().unwrap_or_else(|| format!("Once upon a time. {} Then more. {}", needle_sentence("k", "4"), needle_question("k")));
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
    draw_heatmaps(&out_dir.join("attention_head.png"), "one head's attention map (rows: queries, cols: keys)", &[panel], lo, hi)?;

    let v = serde_json::json!({
        "instrument": "attention",
        "model": model_dir.display().to_string(),
        "family": cfg.family.as_str(),
        "options": opts,
        "context_len": len,
        "depths": per_depth.iter().zip(&shares).map(|((d, a, n), s)| serde_json::json!({"depth": d, "answer_mass": a, "noise_mass": n, "answer_share": s})).collect::<Vec<_>>(),
        "mean_answer_mass": crate::stats::mean(&per_depth.iter().map(|x| x.1).collect::<Vec<_>>()),
        "mean_noise_mass": crate::stats::mean(&per_depth.iter().map(|x| x.2).collect::<Vec<_>>()),
        // answer / (answer + noise): comparable across families even though a diff map's rows
        // sum to about 1 − λ rather than 1
        "mean_answer_share": crate::stats::mean(&shares),
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
        .y_desc("attention mass (mean over heads, layers)")
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let w = 0.8 / (2 * ns) as f64;
    for (si, (name, vals)) in series.iter().enumerate() {
        let c = Palette99::pick(si).to_rgba();
        let light = RGBAColor(c.0, c.1, c.2, 0.35);
        for (di, &(_, a, n)) in vals.iter().enumerate() {
            let x0 = di as f64 - 0.4 + (2 * si) as f64 * w;
            chart.draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (x0 + w, a)], c.filled()))).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
            chart.draw_series(std::iter::once(Rectangle::new([(x0 + w, 0.0), (x0 + 2.0 * w, n)], light.filled()))).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        }
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], c.filled())))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?
            .label(format!("{name}: answer span (solid) / noise (light)"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart.configure_series_labels().position(SeriesLabelPosition::UpperRight).background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 12)).draw().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
