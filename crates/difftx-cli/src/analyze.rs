//! `difftx demo` and `difftx analyze <instrument>`: argument parsing and printing only; the
//! instruments live in difftx-experiments.

use anyhow::Result;
use clap::{Args, Subcommand};
use difftx_experiments::{outliers, quantize, seed_demo};
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
    };
    println!("{}", serde_json::to_string_pretty(&value)?);
    eprintln!("results in {}", out.display());
    Ok(())
}
