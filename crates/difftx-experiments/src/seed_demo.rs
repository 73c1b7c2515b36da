//! The source article's verification ("Step 2"): attention to a planted target vs the average
//! noise weight, and the SNR, for standard attention and for differential attention
//! (`A1 - lambda·A2`, lambda = lambda_init of layer 3), plus the peak/median ratio of |output|.
//!
//! The synthetic setup reproduces the article's numpy code exactly: [`NumpyRandomState`] is a port
//! of numpy's legacy `RandomState` (MT19937 and the polar Box–Muller `legacy_gauss`), so seed 42
//! gives the same Q, K, V as `np.random.seed(42)` + `np.random.randn`. With an `.npz` the same
//! analysis runs on arrays `Q`, `K`, `V` (float64, shape (B, H, N, d_head)). All arithmetic is f64.

use crate::common::{plot_err, write_json};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// numpy's legacy `RandomState` (the generator behind `np.random.seed` / `np.random.randn`).
pub struct NumpyRandomState {
    mt: [u32; 624],
    pos: usize,
    gauss: Option<f64>,
}

impl NumpyRandomState {
    /// `np.random.seed(seed)` for an integer seed (numpy's `init_genrand`).
    pub fn new(seed: u32) -> Self {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1812433253u32.wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_add(i as u32);
        }
        NumpyRandomState { mt, pos: 624, gauss: None }
    }

    fn generate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..624 {
            let y = (self.mt[i] & UPPER) | (self.mt[(i + 1) % 624] & LOWER);
            let mut v = self.mt[(i + 397) % 624] ^ (y >> 1);
            if y & 1 == 1 {
                v ^= MATRIX_A;
            }
            self.mt[i] = v;
        }
        self.pos = 0;
    }

    /// The next raw 32-bit output (tempered MT19937).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= 624 {
            self.generate();
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A double in [0, 1) with 53 random bits (`random_sample`).
    pub fn next_f64(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67108864.0 + b) / 9007199254740992.0
    }

    /// One standard normal draw, as numpy's `legacy_gauss`.
    pub fn gauss(&mut self) -> f64 {
        if let Some(g) = self.gauss.take() {
            return g;
        }
        loop {
            let x1 = 2.0 * self.next_f64() - 1.0;
            let x2 = 2.0 * self.next_f64() - 1.0;
            let r2 = x1 * x1 + x2 * x2;
            if r2 < 1.0 && r2 != 0.0 {
                let f = (-2.0 * r2.ln() / r2).sqrt();
                self.gauss = Some(f * x1);
                return f * x2;
            }
        }
    }

    /// `np.random.randn(n)` (C order for any shape with n elements).
    pub fn randn(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.gauss()).collect()
    }
}

/// A float64 array of shape (B, H, N, d_head), row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Qkv4 {
    pub shape: [usize; 4],
    pub data: Vec<f64>,
}

impl Qkv4 {
    fn idx(&self, b: usize, h: usize, n: usize, d: usize) -> usize {
        ((b * self.shape[1] + h) * self.shape[2] + n) * self.shape[3] + d
    }
}

/// Options of the seed demo. The defaults are the article's.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Read Q, K, V from this `.npz` instead of the synthetic setup.
    pub npz: Option<PathBuf>,
    /// Seed of the synthetic setup (`np.random.seed`).
    pub seed: u32,
    /// Layer index whose `lambda_init = 0.8 - 0.6·exp(-0.3·(layer_idx - 1))` is used (article: 3).
    pub layer_idx: usize,
    /// Planted target position (article: 20).
    pub target_idx: usize,
    /// Query position analysed (article: 60).
    pub query_idx: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions { npz: None, seed: 42, layer_idx: 3, target_idx: 20, query_idx: 60 }
    }
}

/// What the demo measured.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// "synthetic (numpy RandomState seed 42)" or the npz path.
    pub source: String,
    /// (B, H, N, d_head)
    pub shape: [usize; 4],
    pub lambda_init: f64,
    pub target_idx: usize,
    pub query_idx: usize,
    pub std_target_weight: f64,
    pub std_avg_noise_weight: f64,
    pub std_snr: f64,
    pub diff_target_weight: f64,
    pub diff_avg_noise_weight: f64,
    pub diff_snr: f64,
    pub snr_improvement: f64,
    pub std_peak_median_ratio: f64,
    pub diff_peak_median_ratio: f64,
}

/// The article's synthetic Q, K, V (B=1, H=4, N=128, d_head=16) from numpy's RandomState(seed).
pub fn synthetic_qkv(seed: u32) -> (Qkv4, Qkv4, Qkv4) {
    let (b, h, n, dm) = (1usize, 4usize, 128usize, 64usize);
    let d_head = dm / h;
    let d_k = d_head / 2;
    let shape = [b, h, n, d_head];
    let size = b * h * n * d_head;
    let mut rs = NumpyRandomState::new(seed);
    let mut q = Qkv4 { shape, data: rs.randn(size).into_iter().map(|x| x * 0.1).collect() };
    let mut k = Qkv4 { shape, data: rs.randn(size).into_iter().map(|x| x * 0.1).collect() };
    let v = Qkv4 { shape, data: rs.randn(size) };
    let target_idx = 20;
    let common: Vec<f64> = rs.randn(d_k).into_iter().map(|x| x * 1.5).collect();
    for bi in 0..b {
        for hi in 0..h {
            for d in 0..d_k {
                let i = k.idx(bi, hi, target_idx, d);
                k.data[i] += 3.0;
            }
            for ni in 0..n {
                for d in 0..d_k {
                    let i = q.idx(bi, hi, ni, d);
                    q.data[i] += 0.8;
                }
            }
        }
    }
    // The additions in the article's order (K first half, K second half, Q second half).
    for bi in 0..b {
        for hi in 0..h {
            for ni in 0..n {
                for (d, c) in common.iter().enumerate() {
                    let i = k.idx(bi, hi, ni, d);
                    k.data[i] += c;
                }
                for d in d_k..d_head {
                    let i = k.idx(bi, hi, ni, d);
                    k.data[i] += common[d - d_k];
                    let i = q.idx(bi, hi, ni, d);
                    q.data[i] += common[d - d_k];
                }
            }
        }
    }
    (q, k, v)
}

/// Reads and validates arrays `Q`, `K`, `V` (float64, rank 4, equal shapes) from an `.npz`.
pub fn read_qkv_npz(path: &Path) -> Result<(Qkv4, Qkv4, Qkv4)> {
    if !path.is_file() {
        bail!("npz file {} does not exist", path.display());
    }
    let arrays = candle_core::Tensor::read_npz(path).map_err(|e| {
        anyhow::anyhow!(
            "cannot read {} as .npz ({e}); save uncompressed with np.savez(path, Q=Q, K=K, V=V)",
            path.display()
        )
    })?;
    let get = |name: &str| -> Result<Qkv4> {
        let t = arrays.iter().find(|(n, _)| n == name).map(|(_, t)| t).with_context(|| {
            let names: Vec<&str> = arrays.iter().map(|(n, _)| n.as_str()).collect();
            format!("{}: no array '{name}' (found {:?}); expected arrays Q, K, V", path.display(), names)
        })?;
        if t.dtype() != candle_core::DType::F64 {
            bail!("{}: array '{name}' is {:?}, expected float64", path.display(), t.dtype());
        }
        let dims = t.dims();
        if dims.len() != 4 {
            bail!("{}: array '{name}' has shape {:?}, expected rank 4 (B, H, N, d_head)", path.display(), dims);
        }
        Ok(Qkv4 { shape: [dims[0], dims[1], dims[2], dims[3]], data: t.flatten_all()?.to_vec1::<f64>()? })
    };
    let (q, k, v) = (get("Q")?, get("K")?, get("V")?);
    if q.shape != k.shape || q.shape != v.shape {
        bail!(
            "{}: Q, K, V must have the same shape, got Q {:?}, K {:?}, V {:?}",
            path.display(),
            q.shape,
            k.shape,
            v.shape
        );
    }
    Ok((q, k, v))
}

fn softmax_row(x: &mut [f64]) {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Softmax attention maps [B, H, N, N] of Q[..., lo..hi]·K[..., lo..hi]ᵀ·scale.
fn attention_maps(q: &Qkv4, k: &Qkv4, lo: usize, hi: usize, scale: f64) -> Vec<f64> {
    let [b, h, n, _] = q.shape;
    let mut out = vec![0.0; b * h * n * n];
    for bi in 0..b {
        for hi_ in 0..h {
            for i in 0..n {
                let row = &mut out[((bi * h + hi_) * n + i) * n..][..n];
                for (j, r) in row.iter_mut().enumerate() {
                    let mut s = 0.0;
                    for d in lo..hi {
                        s += q.data[q.idx(bi, hi_, i, d)] * k.data[k.idx(bi, hi_, j, d)];
                    }
                    *r = s * scale;
                }
                softmax_row(row);
            }
        }
    }
    out
}

/// maps [B, H, N, N] times V -> [B, H, N, d_head], each scaled by `mult`.
fn apply(maps: &[f64], v: &Qkv4, mult: f64) -> Vec<f64> {
    let [b, h, n, d] = v.shape;
    let mut out = vec![0.0; b * h * n * d];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..n {
                let row = &maps[((bi * h + hi) * n + i) * n..][..n];
                for dd in 0..d {
                    let mut s = 0.0;
                    for (j, a) in row.iter().enumerate() {
                        s += a * v.data[v.idx(bi, hi, j, dd)];
                    }
                    out[v.idx(bi, hi, i, dd)] = s * mult;
                }
            }
        }
    }
    out
}

/// numpy's median (mean of the two middle values for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn peak_median(out: &[f64]) -> f64 {
    let abs: Vec<f64> = out.iter().map(|x| x.abs()).collect();
    abs.iter().cloned().fold(0.0, f64::max) / median(&abs)
}

/// The article's analysis on given Q, K, V (same arithmetic as its numpy code, in f64).
pub fn analyze(q: &Qkv4, k: &Qkv4, v: &Qkv4, opts: &DemoOptions, source: String) -> Result<DemoReport> {
    let [b, h, n, d_head] = q.shape;
    if b == 0 || h == 0 || n == 0 || d_head == 0 {
        bail!("Q, K, V have an empty dimension: shape {:?}", q.shape);
    }
    if d_head % 2 != 0 {
        bail!("head dimension d_head = {d_head} must be even for differential attention");
    }
    if n < 2 {
        bail!("sequence length N = {n}: need at least 2 positions (a target and noise)");
    }
    if opts.target_idx >= n || opts.query_idx >= n {
        bail!(
            "target position {} and query position {} must both be below N = {n} (the article uses 20 and 60, so N > 60)",
            opts.target_idx,
            opts.query_idx
        );
    }
    if opts.layer_idx == 0 {
        bail!("layer index must be at least 1");
    }
    let d_k = d_head / 2;
    let lambda_init = 0.8 - 0.6 * (-0.3 * (opts.layer_idx as f64 - 1.0)).exp();
    let std_attn = attention_maps(q, k, 0, d_head, 1.0 / (d_head as f64).sqrt());
    let std_out = apply(&std_attn, v, 1.0);
    let diff_scale = 1.0 / (d_k as f64).sqrt();
    let a1 = attention_maps(q, k, 0, d_k, diff_scale);
    let a2 = attention_maps(q, k, d_k, d_head, diff_scale);
    let diff_attn: Vec<f64> = a1.iter().zip(&a2).map(|(x, y)| x - lambda_init * y).collect();
    let diff_out = apply(&diff_attn, v, 1.0 - lambda_init);

    let (qi, ti) = (opts.query_idx, opts.target_idx);
    let std_row = &std_attn[qi * n..][..n]; // batch 0, head 0
    let diff_row = &diff_attn[qi * n..][..n];
    let noise = |row: &[f64], abs: bool| -> f64 {
        let vals: Vec<f64> = (0..n).filter(|&i| i != ti).map(|i| if abs { row[i].abs() } else { row[i] }).collect();
        vals.iter().sum::<f64>() / vals.len() as f64
    };
    let std_target = std_row[ti];
    let std_noise = noise(std_row, false);
    let std_snr = std_target / (std_noise + 1e-9);
    let diff_target = diff_row[ti];
    let diff_noise = noise(diff_row, true);
    let diff_snr = diff_target / (diff_noise + 1e-9);
    Ok(DemoReport {
        source,
        shape: q.shape,
        lambda_init,
        target_idx: ti,
        query_idx: qi,
        std_target_weight: std_target,
        std_avg_noise_weight: std_noise,
        std_snr,
        diff_target_weight: diff_target,
        diff_avg_noise_weight: diff_noise,
        diff_snr,
        snr_improvement: diff_snr / std_snr,
        std_peak_median_ratio: peak_median(&std_out),
        diff_peak_median_ratio: peak_median(&diff_out),
    })
}

/// Runs the demo (synthetic setup or `opts.npz`); with `out_dir`, writes `demo.json` and `demo.png`.
pub fn run_demo(opts: &DemoOptions, out_dir: Option<&Path>) -> Result<DemoReport> {
    let report = match &opts.npz {
        Some(path) => {
            let (q, k, v) = read_qkv_npz(path)?;
            analyze(&q, &k, &v, opts, path.display().to_string())?
        }
        None => {
            let (q, k, v) = synthetic_qkv(opts.seed);
            analyze(&q, &k, &v, opts, format!("synthetic (numpy RandomState seed {})", opts.seed))?
        }
    };
    if let Some(dir) = out_dir {
        let mut value = serde_json::to_value(&report)?;
        value["output"] = serde_json::Value::String(format_report(&report));
        write_json(dir, "demo.json", &value)?;
        plot_demo(&report, &dir.join("demo.png"))?;
    }
    Ok(report)
}

/// The article's printed lines, same labels and precision.
pub fn format_report(r: &DemoReport) -> String {
    let mut s = String::new();
    s.push_str("--- 1. Attention Signal-to-Noise Ratio (SNR) ---\n");
    s.push_str(&format!("Standard Attention Target Weight: {:.4}\n", r.std_target_weight));
    s.push_str(&format!("Standard Attention Avg Noise Weight: {:.6}\n", r.std_avg_noise_weight));
    s.push_str(&format!("Standard Attention SNR: {:.1}x\n", r.std_snr));
    s.push_str(&format!("DiffAttn Target Net Weight: {:.4}\n", r.diff_target_weight));
    s.push_str(&format!("DiffAttn Avg Residual Noise Weight: {:.6}\n", r.diff_avg_noise_weight));
    s.push_str(&format!("DiffAttn SNR: {:.1}x\n", r.diff_snr));
    s.push_str(&format!("Signal-to-Noise Improvement: {:.1}x cleaner attention!\n", r.snr_improvement));
    s.push_str("\n--- 2. Activation Outlier Profile ---\n");
    s.push_str(&format!("Standard Attention Peak/Median Outlier Ratio: {:.2}\n", r.std_peak_median_ratio));
    s.push_str(&format!("DiffAttn Peak/Median Outlier Ratio: {:.2}\n", r.diff_peak_median_ratio));
    s.push_str("DiffAttn successfully suppresses extreme activation spikes for low-bit quantization.\n");
    s
}

fn plot_demo(r: &DemoReport, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    crate::plot::init_fonts();
    let root = BitMapBackend::new(path, (1000, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err(path))?;
    let (left, right) = root.split_horizontally(500);
    let panels = [
        (
            "Attention weight of query (target vs avg noise)",
            [(r.std_target_weight, r.std_avg_noise_weight), (r.diff_target_weight, r.diff_avg_noise_weight)],
            &left,
        ),
        (
            "Signal-to-noise ratio (x) and peak/median |out|",
            [(r.std_snr, r.std_peak_median_ratio), (r.diff_snr, r.diff_peak_median_ratio)],
            &right,
        ),
    ];
    for (pi, (title, vals, area)) in panels.iter().enumerate() {
        let ymax = vals.iter().flat_map(|(a, b)| [*a, *b]).fold(0.0f64, f64::max).max(1e-9) * 1.35;
        let ymin = vals.iter().flat_map(|(a, b)| [*a, *b]).fold(0.0f64, f64::min).min(0.0);
        let mut chart = ChartBuilder::on(area)
            .caption(*title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..2f64, ymin..ymax)
            .map_err(plot_err(path))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(plot_err(path))?;
        let names = ["standard", "differential"];
        let series = if pi == 0 { ["target", "avg noise"] } else { ["SNR", "peak/median"] };
        let colors = [RGBColor(31, 119, 180), RGBColor(255, 127, 14)];
        for (gi, (a, b)) in vals.iter().enumerate() {
            for (si, v) in [*a, *b].iter().enumerate() {
                let x0 = gi as f64 + 0.15 + si as f64 * 0.35;
                chart
                    .draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (x0 + 0.3, *v)], colors[si].filled())))
                    .map_err(plot_err(path))?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!("{} {v:.3}", series[si]),
                        (x0, v.max(0.0) + (ymax - ymin) * 0.02),
                        ("sans-serif", 11).into_font(),
                    )))
                    .map_err(plot_err(path))?;
            }
            chart
                .draw_series(std::iter::once(Text::new(
                    names[gi].to_string(),
                    (gi as f64 + 0.35, ymin + (ymax - ymin) * 0.96),
                    ("sans-serif", 14).into_font(),
                )))
                .map_err(plot_err(path))?;
        }
    }
    root.present().map_err(plot_err(path))?;
    Ok(())
}
