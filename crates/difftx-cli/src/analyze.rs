//! `difftx demo` and `difftx analyze <instrument>`: argument parsing and printing only; the
//! instruments live in difftx-experiments.

use anyhow::Result;
use clap::{Args, Subcommand};
use difftx_core::Family;
use difftx_experiments::compare::{self, Budget, ClaimSpec, CompareOptions, ExtraInstrument};
use difftx_experiments::stats::Direction;
use difftx_experiments::{attention, icl, needle, outliers, quantize, seed_demo};
use std::path::PathBuf;

#[derive(Args)]
pub struct DemoArgs {
    /// Read Q, K, V (float64, shape (B, H, N, d_head)) from this .npz instead of the article's
    /// synthetic setup.
    #[arg(long)]
    pub npz: Option<PathBuf>,
    /// Also write demo.json and demo.png into this folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seed of the synthetic setup (numpy's np.random.seed; the article uses 42).
    #[arg(long, default_value_t = 42)]
    pub seed: u32,
}

pub fn cmd_demo(a: DemoArgs) -> Result<()> {
    let opts = seed_demo::DemoOptions { npz: a.npz, seed: a.seed, ..Default::default() };
    let report = seed_demo::run_demo(&opts, a.out.as_deref())?;
    println!("{}", seed_demo::format_report(&report));
    if let Some(out) = a.out {
        eprintln!("wrote {}/demo.json and demo.png", out.display());
    }
    Ok(())
}

/// Options every instrument shares.
#[derive(Args, Clone)]
pub struct Common {
    /// Model folder, training run, or Hugging Face folder.
    #[arg(long)]
    pub model: PathBuf,
    /// Folder for the JSON and PNG results.
    #[arg(long, default_value = "analysis")]
    pub out: PathBuf,
    /// Evaluation text (default: the bundled data/shakespeare.txt; windows from its end, which is
    /// the validation split of models trained on it).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Window length (default: the model's context).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Tokens of text to run through the model.
    #[arg(long, default_value_t = 8192)]
    pub max_tokens: usize,
}

#[derive(Subcommand)]
pub enum Instrument {
    /// Top-1/2/3/10/100 and median of |attention logits| and |hidden states| per layer.
    Outliers(Common),
    /// Loss with attention logits at 16/8/6/4 bits, int8/int4 weights, and W8A8 / W4A4.
    Quantize(Common),
    /// Multi-needle retrieval accuracy per context length x depth (N needles, R asked).
    Needle(NeedleArgs),
    /// Attention mass from the answer position to the answer span vs the rest, per needle depth.
    Attention(AttentionArgs),
    /// k-shot classification over many demonstration orders: mean accuracy and best-worst margin.
    Icl(IclArgs),
}

#[derive(Args, Clone)]
pub struct ModelOut {
    /// Model folder, training run, or Hugging Face folder.
    #[arg(long)]
    pub model: PathBuf,
    /// Folder for the JSON and PNG results.
    #[arg(long, default_value = "analysis")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args)]
pub struct NeedleArgs {
    #[command(flatten)]
    pub m: ModelOut,
    /// Contexts per (length, depth) cell.
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
    /// Haystack text (default: the bundled corpus).
    #[arg(long)]
    pub haystack: Option<PathBuf>,
}

#[derive(Args)]
pub struct AttentionArgs {
    #[command(flatten)]
    pub m: ModelOut,
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
    #[arg(long)]
    pub haystack: Option<PathBuf>,
}

#[derive(Args)]
pub struct IclArgs {
    #[command(flatten)]
    pub m: ModelOut,
    /// Demonstrations per prompt (k).
    #[arg(long, default_value_t = 8)]
    pub shots: usize,
    /// Random orders of the same demonstrations.
    #[arg(long, default_value_t = 10)]
    pub orders: usize,
    /// JSONL of {"text","label"} (e.g. data/eval/snips_intent.jsonl); default: a synthetic task.
    #[arg(long)]
    pub data: Option<PathBuf>,
}

pub fn cmd_analyze(what: Instrument) -> Result<()> {
    let (value, out) = match what {
        Instrument::Outliers(c) => {
            let opts = outliers::OutliersOptions {
                text: c.text,
                max_tokens: c.max_tokens,
                seq_len: c.seq_len,
                ..Default::default()
            };
            (outliers::run_outliers(&c.model, &opts, &c.out)?, c.out)
        }
        Instrument::Quantize(c) => {
            let opts = quantize::QuantizeOptions {
                text: c.text,
                max_tokens: c.max_tokens,
                seq_len: c.seq_len,
                ..Default::default()
            };
            (quantize::run_quantize(&c.model, &opts, &c.out)?, c.out)
        }
        Instrument::Needle(a) => {
            let opts = needle::NeedleOptions { trials: a.trials, seed: a.m.seed, haystack: a.haystack, ..Default::default() };
            (needle::run_needle(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
        Instrument::Attention(a) => {
            let opts =
                attention::AttentionOptions { trials: a.trials, seed: a.m.seed, haystack: a.haystack, ..Default::default() };
            (attention::run_attention(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
        Instrument::Icl(a) => {
            let opts = icl::IclOptions { shots: a.shots, orders: a.orders, seed: a.m.seed, data: a.data, ..Default::default() };
            (icl::run_icl(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
    };
    println!("{}", serde_json::to_string_pretty(&value)?);
    eprintln!("results in {}", out.display());
    Ok(())
}

#[derive(Args)]
pub struct CompareArgs {
    /// Seeds per family (error bars are 95% t-intervals over seeds).
    #[arg(long, default_value_t = 3)]
    pub seeds: usize,
    /// Training budget per model: steps ("90", "300steps") or total wall time split over all
    /// models ("15m", "900s", "1h").
    #[arg(long, default_value_t = compare::DEFAULT_STEPS.to_string())]
    pub budget: String,
    /// A one-minute smoke run (2 seeds, a few steps, small instrument settings).
    #[arg(long)]
    pub quick: bool,
    /// Families to compare (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "baseline,diff-v1,diff-v2")]
    pub families: Vec<Family>,
    /// Model preset shared by all families (parameter-matched by construction).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Real text of the training mixture (default: the bundled corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Mixture: fraction of documents that are real text.
    #[arg(long, default_value_t = 0.4)]
    pub text_fraction: f64,
    /// Mixture: fraction of synthetic retrieval (needle) documents.
    #[arg(long, default_value_t = 0.4)]
    pub needle_fraction: f64,
    /// Mixture: fraction of synthetic in-context classification documents.
    #[arg(long, default_value_t = 0.2)]
    pub icl_fraction: f64,
    /// Report folder (training runs go to OUT/runs/).
    #[arg(long, default_value = "runs/compare")]
    pub out: PathBuf,
    /// Training sequence length, also the models' context.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
}

fn claim(id: &str, title: &str, paper: &str, pointer: &str, direction: Direction) -> ClaimSpec {
    ClaimSpec { id: id.into(), title: title.into(), paper: paper.into(), pointer: pointer.into(), direction }
}

/// Outliers and quantisation, run on every trained model by `compare`.
fn extra_instruments(quick: bool) -> Vec<ExtraInstrument> {
    let max_tokens = if quick { 512 } else { 4096 };
    let outliers_run = move |model: &std::path::Path, out: &std::path::Path| {
        let opts = outliers::OutliersOptions { max_tokens, ..Default::default() };
        outliers::run_outliers(model, &opts, out)
    };
    // Settings in a fixed order so the claims can point into the results array:
    // 0 fp32, 1-4 logits 16/8/6/4, 5 W8, 6 W4 (per channel), 7 W8A8, 8 W4A4.
    let quantize_run = move |model: &std::path::Path, out: &std::path::Path| {
        let opts = quantize::QuantizeOptions {
            max_tokens,
            logit_bits: vec![16, 8, 6, 4],
            weight_bits: vec![8, 4],
            weight_groups: vec![None],
            wa_bits: vec![8, 4],
            wa_group: None,
            ..Default::default()
        };
        quantize::run_quantize(model, &opts, out)
    };
    vec![
        ExtraInstrument {
            name: "outliers".into(),
            run: Box::new(outliers_run),
            claims: vec![
                claim("outlier_logits", "Largest |attention logit| (top-1)", "3B models: 318.0 (Transformer) vs 38.8 (DIFF)", "/attention_logits/all_layers/top1", Direction::Lower),
                claim("outlier_hidden", "Largest |hidden state| (top-1)", "3B models: 3608.6 (Transformer) vs 1688.2 (DIFF)", "/hidden_states/all_layers/top1", Direction::Lower),
            ],
        },
        ExtraInstrument {
            name: "quantize".into(),
            run: Box::new(quantize_run),
            claims: vec![
                claim("quant_logits4", "Loss increase with 4-bit attention logits", "DIFF degrades far less than the Transformer at 4-bit attention logits (HellaSwag accuracy)", "/results/4/delta", Direction::Lower),
                claim("quant_w4", "Loss increase with int4 weights (per channel)", "not measured in the paper; the source article claims easier low-bit quantisation", "/results/6/delta", Direction::Lower),
                claim("quant_w4a4", "Loss increase with W4A4", "the source article claims W4A4 with negligible degradation (not a paper experiment)", "/results/8/delta", Direction::Lower),
            ],
        },
    ]
}

pub fn cmd_compare(a: CompareArgs) -> Result<()> {
    let budget: Budget = a.budget.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let defaults = CompareOptions::default();
    let opts = CompareOptions {
        seeds: a.seeds,
        budget,
        quick: a.quick,
        families: a.families,
        preset: a.preset,
        data: a.data,
        mixture: difftx_experiments::mixture::MixtureSpec {
            text_fraction: a.text_fraction,
            needle_fraction: a.needle_fraction,
            icl_fraction: a.icl_fraction,
            ..defaults.mixture.clone()
        },
        out: a.out,
        seq_len: a.seq_len,
        batch_size: a.batch_size,
        lr: a.lr,
        extra_instruments: extra_instruments(a.quick),
        ..defaults
    };
    let report = compare::run_compare(&opts)?;
    println!("{}", std::fs::read_to_string(&report.report_md)?);
    eprintln!("report: {} ({:.0} s)", report.report_md.display(), report.wall_secs);
    Ok(())
}
