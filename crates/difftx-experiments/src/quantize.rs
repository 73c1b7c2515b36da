//! Post-training quantisation probe (docs/design.md §8): validation loss with (i) nothing quantised, (ii) the
//! attention logits fake-quantised by dynamic absmax (per query row) to 16/8/6/4 bits before the
//! softmax, (iii) int8 / int4 weights (per output channel, or per group of g inputs), (iv) W8A8 and
//! W4A4 (weights plus the input of every linear layer, per token). All quantisation is fake
//! (quantise, round, scale back) in f32; only linear-layer weights are quantised: q/k/v/o, the MLP,
//! diff-v2's lambda_proj and the LM head (the embedding only when it is tied to the LM head), never
//! norms or lambda vectors.

use crate::common::{eval_windows, mean_loss, plot_err, read_eval_text, write_json};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use difftx_core::config::ModelConfig;
use difftx_core::model::Model;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Options of the quantisation instrument.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// Evaluation text (UTF-8 file); `None` = the bundled `data/shakespeare.txt`.
    pub text: Option<PathBuf>,
    /// Input tokens evaluated (windows from the end of the text).
    pub max_tokens: usize,
    /// Window length; `None` = the model's context.
    pub seq_len: Option<usize>,
    /// Windows per forward pass.
    pub batch: usize,
    /// Attention-logit bit widths.
    pub logit_bits: Vec<u32>,
    /// Weight bit widths (weight-only settings).
    pub weight_bits: Vec<u32>,
    /// Weight granularities: `None` = per output channel, `Some(g)` = groups of g inputs.
    pub weight_groups: Vec<Option<usize>>,
    /// Bit widths of the WxAx settings (same bits for weights and activations).
    pub wa_bits: Vec<u32>,
    /// Weight granularity of the WxAx settings.
    pub wa_group: Option<usize>,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            text: None,
            max_tokens: 8192,
            seq_len: None,
            batch: 8,
            logit_bits: vec![16, 8, 6, 4],
            weight_bits: vec![8, 4],
            weight_groups: vec![None, Some(128), Some(32)],
            wa_bits: vec![8, 4],
            wa_group: None,
        }
    }
}

fn check_bits(b: u32, what: &str) -> Result<()> {
    if !(2..=16).contains(&b) {
        bail!("{what} bit width {b} is out of range (2 to 16)");
    }
    Ok(())
}

/// Fake-quantises a row-major [rows, cols] matrix in place: each row is cut into groups of
/// `group` consecutive columns (the last may be shorter; `None` = the whole row), and each group is
/// scaled so its largest |value| maps to 2^(bits-1) - 1, rounded (half away from zero), scaled back.
pub fn quantize_matrix(data: &mut [f32], cols: usize, group: Option<usize>, bits: u32) -> Result<()> {
    check_bits(bits, "weight")?;
    if cols == 0 || !data.len().is_multiple_of(cols) {
        bail!("matrix of {} values does not have rows of {cols}", data.len());
    }
    let g = match group {
        Some(0) => bail!("group size must be at least 1"),
        Some(g) => g.min(cols),
        None => cols,
    };
    let qmax = ((1u32 << (bits - 1)) - 1) as f32;
    for row in data.chunks_mut(cols) {
        for chunk in row.chunks_mut(g) {
            let absmax = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = absmax.max(1e-30) / qmax;
            for x in chunk.iter_mut() {
                *x = (*x / scale).round() * scale;
            }
        }
    }
    Ok(())
}

/// Whether a weight is quantised: linear-layer weights only (and the embedding when tied).
pub fn is_quantized_weight(name: &str, cfg: &ModelConfig) -> bool {
    name.ends_with("_proj.weight")
        || name == "lm_head.weight"
        || (cfg.tie_embeddings && name == "model.embed_tokens.weight")
}

/// A copy of `weights` with every linear-layer weight fake-quantised (see [`quantize_matrix`]).
/// Returns the map and the names quantised.
pub fn quantize_weights(
    cfg: &ModelConfig,
    weights: &HashMap<String, Tensor>,
    bits: u32,
    group: Option<usize>,
) -> Result<(HashMap<String, Tensor>, Vec<String>)> {
    let mut out = HashMap::with_capacity(weights.len());
    let mut names = Vec::new();
    for (name, t) in weights {
        if is_quantized_weight(name, cfg) {
            let (rows, cols) = t.dims2().with_context(|| format!("weight '{name}' is not a matrix"))?;
            let mut data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            quantize_matrix(&mut data, cols, group, bits)?;
            out.insert(name.clone(), Tensor::from_vec(data, (rows, cols), t.device())?.to_dtype(t.dtype())?);
            names.push(name.clone());
        } else {
            out.insert(name.clone(), t.clone());
        }
    }
    names.sort();
    Ok((out, names))
}

fn group_label(g: Option<usize>) -> String {
    match g {
        None => "per-channel".into(),
        Some(g) => format!("group{g}"),
    }
}

/// Runs the instrument; writes `out_dir/quantize.json` and `out_dir/quantize.png`.
pub fn run_quantize(model_dir: &Path, opts: &QuantizeOptions, out_dir: &Path) -> Result<serde_json::Value> {
    for &b in &opts.logit_bits {
        check_bits(b, "attention-logit")?;
    }
    for &b in opts.weight_bits.iter().chain(&opts.wa_bits) {
        check_bits(b, "weight/activation")?;
    }
    if opts.weight_groups.iter().chain(std::iter::once(&opts.wa_group)).any(|g| *g == Some(0)) {
        bail!("group size must be at least 1");
    }
    if opts.batch == 0 {
        bail!("batch must be at least 1");
    }
    let dir = difftx_core::checkpoint::resolve_model_dir(model_dir)?;
    let (cfg, weights) = difftx_core::checkpoint::load_model(&dir, DType::F32, &Device::Cpu)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let base = Model::from_weights(&cfg, &weights)
        .with_context(|| format!("{}: weights do not fit the config", dir.display()))?;
    let tok = difftx_core::tokenizer::Tokenizer::from_model_dir(&dir)?;
    let (text, text_path) = read_eval_text(opts.text.as_deref())?;
    let (windows, seq_len) = eval_windows(&base, &tok, &text, opts.seq_len, opts.max_tokens)?;

    let baseline = mean_loss(&base, &windows, opts.batch)?;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut push = |family: &str, setting: String, bits: Option<u32>, group: Option<String>, loss: f64| {
        rows.push(serde_json::json!({
            "family": family, "setting": setting, "bits": bits, "granularity": group,
            "loss": loss, "delta": loss - baseline, "ppl": loss.exp(),
        }));
    };
    push("none", "fp32".into(), None, None, baseline);

    let mut model = base;
    for &b in &opts.logit_bits {
        model.opts.attn_logit_bits = Some(b);
        let loss = mean_loss(&model, &windows, opts.batch)?;
        push("attn_logits", format!("logits int{b}"), Some(b), Some("per-row".into()), loss);
    }
    model.opts.attn_logit_bits = None;
    drop(model);

    let mut quantized_names = Vec::new();
    for &g in &opts.weight_groups {
        for &b in &opts.weight_bits {
            let (w, names) = quantize_weights(&cfg, &weights, b, g)?;
            quantized_names = names;
            let m = Model::from_weights(&cfg, &w)?;
            let loss = mean_loss(&m, &windows, opts.batch)?;
            push("weights", format!("W{b} {}", group_label(g)), Some(b), Some(group_label(g)), loss);
        }
    }
    for &b in &opts.wa_bits {
        let (w, names) = quantize_weights(&cfg, &weights, b, opts.wa_group)?;
        quantized_names = names;
        let mut m = Model::from_weights(&cfg, &w)?;
        m.opts.act_bits = Some(b);
        let loss = mean_loss(&m, &windows, opts.batch)?;
        push("weights_acts", format!("W{b}A{b}"), Some(b), Some(group_label(opts.wa_group)), loss);
    }

    let value = serde_json::json!({
        "instrument": "quantize",
        "model": dir.display().to_string(),
        "family": cfg.family.as_str(),
        "text": text_path.display().to_string(),
        "windows": windows.len(),
        "seq_len": seq_len,
        "tokens": windows.len() * seq_len,
        "baseline_loss": baseline,
        "results": rows,
        "quantized_weights": quantized_names,
        "note": "fake quantisation by absmax: attention logits per query row before the softmax; weights per output channel or per group of inputs; activations (inputs of every linear layer) per token",
    });
    write_json(out_dir, "quantize.json", &value)?;
    plot_quantize(cfg.family.as_str(), baseline, &rows, &out_dir.join("quantize.png"))?;
    Ok(value)
}

fn plot_quantize(family: &str, baseline: f64, rows: &[serde_json::Value], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    crate::plot::init_fonts();
    // One curve per (family, granularity): loss against bits.
    let mut curves: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows.iter().filter(|r| r["bits"].is_u64()) {
        let name = match r["family"].as_str().unwrap_or("") {
            "attn_logits" => "attention logits".to_string(),
            "weights" => format!("weights {}", r["granularity"].as_str().unwrap_or("")),
            "weights_acts" => format!("weights+acts {}", r["granularity"].as_str().unwrap_or("")),
            other => other.to_string(),
        };
        let pt = (r["bits"].as_u64().unwrap_or(0) as f64, r["loss"].as_f64().unwrap_or(f64::NAN));
        match curves.iter_mut().find(|(n, _)| *n == name) {
            Some((_, pts)) => pts.push(pt),
            None => curves.push((name, vec![pt])),
        }
    }
    let losses: Vec<f64> =
        curves.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).chain([baseline]).filter(|x| x.is_finite()).collect();
    let (lo, hi) = losses.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let pad = ((hi - lo) * 0.1).max(1e-3);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err(path))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{family}: validation loss under fake quantisation"), ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(17f64..3f64, (lo - pad)..(hi + pad))
        .map_err(plot_err(path))?;
    chart
        .configure_mesh()
        .x_desc("bits")
        .y_desc("loss (nats)")
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(plot_err(path))?;
    chart
        .draw_series(LineSeries::new([(17.0, baseline), (3.0, baseline)], BLACK.stroke_width(1)))
        .map_err(plot_err(path))?
        .label("unquantised")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (i, (name, pts)) in curves.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut pts = pts.clone();
        pts.sort_by(|a, b| b.0.total_cmp(&a.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(plot_err(path))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled()))).map_err(plot_err(path))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 12))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(plot_err(path))?;
    root.present().map_err(plot_err(path))?;
    Ok(())
}
