//! Activation outliers (docs/design.md §8): the top-1, top-2, top-3, top-10 and top-100 largest values
//! (the k-th largest, as in the paper's table) and the median of |attention logits| (every map
//! `q·kᵀ/√d`, both maps for differential models; causal entries only, the masked ones are never
//! used) and of |hidden states| (each layer's output), per layer and over all layers.

use crate::common::{eval_windows, load_model_and_tokenizer, plot_err, read_eval_text, write_json};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use difftx_core::model::Probe;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The ranks reported.
pub const TOP_KS: [usize; 5] = [1, 2, 3, 10, 100];

/// Statistics of a set of |values|; a top-k is `None` when there are fewer than k values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutlierStats {
    pub count: u64,
    pub top1: Option<f64>,
    pub top2: Option<f64>,
    pub top3: Option<f64>,
    pub top10: Option<f64>,
    pub top100: Option<f64>,
    pub median: Option<f64>,
    /// false when the median came from the histogram (bf16 resolution, see [`Accumulator`]).
    pub median_exact: bool,
    /// top1 / median
    pub top1_over_median: Option<f64>,
}

/// Streams |values| in and keeps the exact 100 largest and, up to `exact_cap` values, all of
/// them for an exact median; past that it switches to a 65536-bin histogram of the upper 16 bits
/// of the f32 bit pattern (monotone for non-negative floats) and interpolates inside the median's
/// bin, which bounds the relative error of the median by 2⁻⁷.
pub struct Accumulator {
    top: Vec<f32>,
    values: Option<Vec<f32>>,
    hist: Option<Vec<u64>>,
    count: u64,
    exact_cap: usize,
}

impl Accumulator {
    pub fn new(exact_cap: usize) -> Self {
        Accumulator { top: Vec::new(), values: Some(Vec::new()), hist: None, count: 0, exact_cap }
    }

    fn prune_top(&mut self) {
        let k = TOP_KS[TOP_KS.len() - 1];
        if self.top.len() > k {
            self.top.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            self.top.truncate(k);
        }
    }

    fn hist_add(hist: &mut [u64], v: f32) {
        hist[(v.to_bits() >> 16) as usize] += 1;
    }

    /// Adds |v| for every v (NaNs are an error).
    pub fn add(&mut self, values: impl IntoIterator<Item = f32>) -> Result<()> {
        for v in values {
            let a = v.abs();
            if a.is_nan() {
                bail!("activation is NaN: the model's weights or inputs are broken");
            }
            self.count += 1;
            self.top.push(a);
            if self.top.len() >= 4096 {
                self.prune_top();
            }
            if let Some(vals) = self.values.as_mut() {
                vals.push(a);
                if vals.len() > self.exact_cap {
                    let mut hist = vec![0u64; 1 << 16];
                    for &x in vals.iter() {
                        Self::hist_add(&mut hist, x);
                    }
                    self.values = None;
                    self.hist = Some(hist);
                }
            } else if let Some(hist) = self.hist.as_mut() {
                Self::hist_add(hist, a);
            }
        }
        Ok(())
    }

    /// Merges another accumulator in (for the "all layers" row).
    pub fn merge(&mut self, other: &Accumulator) -> Result<()> {
        match (&other.values, &other.hist) {
            (Some(vals), _) => {
                // Re-adding also takes care of its top values.
                self.add(vals.iter().copied())?;
            }
            (None, Some(h)) => {
                let own = self.hist.get_or_insert_with(|| vec![0u64; 1 << 16]);
                if let Some(vals) = self.values.take() {
                    for &x in vals.iter() {
                        Self::hist_add(own, x);
                    }
                }
                for (a, b) in own.iter_mut().zip(h) {
                    *a += b;
                }
                self.count += other.count;
                self.top.extend_from_slice(&other.top);
                self.prune_top();
            }
            (None, None) => {}
        }
        Ok(())
    }

    fn value_at_rank_hist(hist: &[u64], rank: u64) -> f64 {
        // rank is 0-based in ascending order.
        let mut seen = 0u64;
        for (bin, &c) in hist.iter().enumerate() {
            if c > 0 && seen + c > rank {
                let lo = f32::from_bits((bin as u32) << 16) as f64;
                let hi = f32::from_bits(((bin as u32) << 16) | 0xffff) as f64;
                let frac = (rank - seen) as f64 / c as f64 + 0.5 / c as f64;
                return lo + (hi - lo) * frac;
            }
            seen += c;
        }
        f64::NAN
    }

    pub fn stats(&self) -> OutlierStats {
        let mut top = self.top.clone();
        top.sort_by(|a, b| b.total_cmp(a));
        let kth = |k: usize| top.get(k - 1).map(|&v| v as f64);
        let (median, exact) = if self.count == 0 {
            (None, true)
        } else if let Some(vals) = &self.values {
            let mut v = vals.clone();
            let n = v.len();
            let (_, &mut m, _) = v.select_nth_unstable_by(n / 2, |a, b| a.total_cmp(b));
            let m = if n % 2 == 1 {
                m as f64
            } else {
                let lower = v[..n / 2].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                (lower as f64 + m as f64) / 2.0
            };
            (Some(m), true)
        } else {
            let h = self.hist.as_ref().expect("histogram mode");
            let n = self.count;
            let m = if n % 2 == 1 {
                Self::value_at_rank_hist(h, n / 2)
            } else {
                (Self::value_at_rank_hist(h, n / 2 - 1) + Self::value_at_rank_hist(h, n / 2)) / 2.0
            };
            (Some(m), false)
        };
        let top1 = kth(1);
        OutlierStats {
            count: self.count,
            top1,
            top2: kth(2),
            top3: kth(3),
            top10: kth(10),
            top100: kth(100),
            median,
            median_exact: exact,
            top1_over_median: match (top1, median) {
                (Some(t), Some(m)) if m > 0.0 => Some(t / m),
                _ => None,
            },
        }
    }
}

/// Exact statistics of a slice of values (their absolute values are taken).
pub fn outlier_stats(values: &[f32]) -> Result<OutlierStats> {
    let mut acc = Accumulator::new(usize::MAX);
    acc.add(values.iter().copied())?;
    Ok(acc.stats())
}

/// Options of the outlier instrument.
#[derive(Debug, Clone)]
pub struct OutliersOptions {
    /// Evaluation text (UTF-8 file); `None` = the bundled `data/shakespeare.txt`.
    pub text: Option<PathBuf>,
    /// Input tokens to run through the model (windows of `seq_len` from the end of the text).
    pub max_tokens: usize,
    /// Window length; `None` = the model's context.
    pub seq_len: Option<usize>,
    /// Values kept per statistic for an exact median before switching to the histogram.
    pub exact_median_cap: usize,
}

impl Default for OutliersOptions {
    fn default() -> Self {
        OutliersOptions { text: None, max_tokens: 8192, seq_len: None, exact_median_cap: 4_000_000 }
    }
}

/// |values| of the causal part (s ≤ t) of attention logits [B, M, T, S] (T = S, no cache).
fn causal_abs(logits: &Tensor) -> Result<Vec<f32>> {
    let (b, m, t, s) = logits.dims4()?;
    let data = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let offset = s - t;
    let mut out = Vec::with_capacity(b * m * t * (offset + t.div_ceil(2) + 1));
    for bm in 0..b * m {
        for ti in 0..t {
            let row = &data[(bm * t + ti) * s..][..s];
            out.extend(row[..=ti + offset].iter().map(|x| x.abs()));
        }
    }
    Ok(out)
}

/// Runs the instrument; writes `out_dir/outliers.json` and `out_dir/outliers.png`.
pub fn run_outliers(model_dir: &Path, opts: &OutliersOptions, out_dir: &Path) -> Result<serde_json::Value> {
    let (model, tok, dir) = load_model_and_tokenizer(model_dir)?;
    let (text, text_path) = read_eval_text(opts.text.as_deref())?;
    let (windows, seq_len) = eval_windows(&model, &tok, &text, opts.seq_len, opts.max_tokens)?;
    let cfg = model.config().clone();
    let n_layers = cfg.n_layers;
    let cap = opts.exact_median_cap;
    let mut logit_acc: Vec<Accumulator> = (0..n_layers).map(|_| Accumulator::new(cap)).collect();
    let mut hidden_acc: Vec<Accumulator> = (0..n_layers).map(|_| Accumulator::new(cap)).collect();
    let mut maps_per_layer = 0usize;
    for w in &windows {
        let ids = Tensor::from_slice(&w[..seq_len], (1, seq_len), model.device())?;
        let mut probe = Probe { capture_hidden: true, capture_attention: true, ..Default::default() };
        model.forward_probe(&ids, None, Some(&mut probe)).context("forward pass failed")?;
        if probe.attn_logits.len() != n_layers || probe.hidden.len() != n_layers + 1 {
            bail!(
                "{}: the model recorded {} attention-logit and {} hidden-state tensors for {n_layers} layers; cannot measure outliers",
                dir.display(),
                probe.attn_logits.len(),
                probe.hidden.len()
            );
        }
        for l in 0..n_layers {
            maps_per_layer = probe.attn_logits[l].dim(1)?;
            logit_acc[l].add(causal_abs(&probe.attn_logits[l])?)?;
            hidden_acc[l].add(probe.hidden[l + 1].flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)?;
        }
    }
    let summarise = |accs: &[Accumulator]| -> Result<(Vec<OutlierStats>, OutlierStats)> {
        let mut all = Accumulator::new(cap);
        for a in accs {
            all.merge(a)?;
        }
        Ok((accs.iter().map(|a| a.stats()).collect(), all.stats()))
    };
    let (logit_layers, logit_all) = summarise(&logit_acc)?;
    let (hidden_layers, hidden_all) = summarise(&hidden_acc)?;
    let value = serde_json::json!({
        "instrument": "outliers",
        "model": dir.display().to_string(),
        "family": cfg.family.as_str(),
        "text": text_path.display().to_string(),
        "windows": windows.len(),
        "seq_len": seq_len,
        "tokens": windows.len() * seq_len,
        "attention_maps_per_layer": maps_per_layer,
        "attention_logits": { "per_layer": logit_layers, "all_layers": logit_all },
        "hidden_states": { "per_layer": hidden_layers, "all_layers": hidden_all },
        "note": "top-k = k-th largest |value|; attention logits are q·kᵀ·scale of every map (both maps for differential models), causal entries only; hidden states are each block's output",
    });
    write_json(out_dir, "outliers.json", &value)?;
    plot_outliers(
        &cfg.family.to_string(),
        &[("attention logits", &logit_layers, &logit_all), ("hidden states", &hidden_layers, &hidden_all)],
        &out_dir.join("outliers.png"),
    )?;
    Ok(value)
}

type Panel<'a> = (&'a str, &'a [OutlierStats], &'a OutlierStats);

fn plot_outliers(family: &str, panels: &[Panel], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    crate::plot::init_fonts();
    let root = BitMapBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err(path))?;
    let areas = root.split_evenly((1, panels.len()));
    let stat_names = ["top-1", "top-10", "top-100", "median"];
    let colors = [RGBColor(214, 39, 40), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(31, 119, 180)];
    for ((title, layers, all), area) in panels.iter().zip(areas.iter()) {
        let groups: Vec<(String, &OutlierStats)> = layers
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("L{i}"), s))
            .chain(std::iter::once(("all".to_string(), *all)))
            .collect();
        let vals = |s: &OutlierStats| [s.top1, s.top10, s.top100, s.median].map(|v| v.unwrap_or(0.0));
        let ymax = groups.iter().flat_map(|(_, s)| vals(s)).fold(0.0f64, f64::max).max(1e-9) * 1.1;
        let n = groups.len() as f64;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{family}: |{title}|"), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..n, 0f64..ymax)
            .map_err(plot_err(path))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(plot_err(path))?;
        for (gi, (name, s)) in groups.iter().enumerate() {
            for (si, v) in vals(s).iter().enumerate() {
                let x0 = gi as f64 + 0.1 + si as f64 * 0.2;
                let bar = Rectangle::new([(x0, 0.0), (x0 + 0.18, *v)], colors[si].filled());
                chart.draw_series(std::iter::once(bar)).map_err(plot_err(path))?;
            }
            let label = Text::new(name.clone(), (gi as f64 + 0.35, -ymax * 0.0), ("sans-serif", 12).into_font());
            chart.draw_series(std::iter::once(label)).map_err(plot_err(path))?;
        }
        for (si, name) in stat_names.iter().enumerate() {
            let y = ymax * (0.95 - 0.06 * si as f64);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(n * 0.75, y), (n * 0.78, y - ymax * 0.03)],
                    colors[si].filled(),
                )))
                .map_err(plot_err(path))?;
            chart
                .draw_series(std::iter::once(Text::new(name.to_string(), (n * 0.8, y), ("sans-serif", 12).into_font())))
                .map_err(plot_err(path))?;
        }
    }
    root.present().map_err(plot_err(path))?;
    Ok(())
}
