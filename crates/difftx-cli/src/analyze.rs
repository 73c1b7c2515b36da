//! `difftx demo` and `difftx analyze <instrument>`: argument parsing and printing only; the
//! instruments live in difftx-experiments.

use anyhow::Result;
use clap::{Args, Subcommand};
use difftx_experiments::compare::{self, Arm, Budget, CompareOptions};
use difftx_experiments::mixture::{MixtureSpec, PairFormat};
use difftx_experiments::{attention, icl, needle, outliers, quantize, recall, seed_demo};
use std::path::PathBuf;

/// "LO-HI" or "N" as an inclusive range.
/// An inclusive range argument, written `LO-HI` (or `N` for N-N); printed the same way, so the
/// libraries' default ranges can be the CLI's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range(pub usize, pub usize);

impl std::str::FromStr for Range {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid range '{s}' (expected N or LO-HI, e.g. 2-16)");
        let (lo, hi) = match s.split_once('-') {
            Some((a, b)) => (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?),
            None => {
                let n = s.trim().parse().map_err(|_| bad())?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(bad());
        }
        Ok(Range(lo, hi))
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// A comma-separated list of counts (`2,4,8`), shown in `--help` as it is typed.
#[derive(Clone, Debug)]
pub struct Counts(pub Vec<usize>);

impl std::str::FromStr for Counts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let counts = s
            .split(',')
            .map(|c| c.trim().parse::<usize>().map_err(|_| format!("invalid list '{s}' (expected counts like 2,4,8)")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Counts(counts))
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|c| c.to_string()).collect();
        write!(f, "{}", parts.join(","))
    }
}

impl From<(usize, usize)> for Range {
    fn from((lo, hi): (usize, usize)) -> Self {
        Range(lo, hi)
    }
}

impl From<Range> for (usize, usize) {
    fn from(r: Range) -> Self {
        (r.0, r.1)
    }
}

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
    /// Associative recall (MQAR): accuracy per number of key-value pairs in the context.
    Recall(RecallArgs),
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

/// Shapes of the keys and values of the retrieval tasks (their difficulty knobs).
#[derive(Args, Clone)]
pub struct PairArgs {
    /// Letters per key of the retrieval tasks.
    #[arg(long, default_value_t = PairFormat::default().key_len)]
    pub key_len: usize,
    /// Keys use the first N lowercase letters.
    #[arg(long, default_value_t = PairFormat::default().key_letters)]
    pub key_letters: usize,
    /// Digits per value (chance accuracy 10^-N).
    #[arg(long, default_value_t = PairFormat::default().value_digits)]
    pub value_digits: usize,
}

impl PairArgs {
    pub fn format(&self) -> PairFormat {
        PairFormat { key_len: self.key_len, key_letters: self.key_letters, value_digits: self.value_digits }
    }
}

#[derive(Args)]
pub struct RecallArgs {
    #[command(flatten)]
    pub m: ModelOut,
    #[command(flatten)]
    pub pairs: PairArgs,
    /// Key-value pairs per document (comma separated; one accuracy each).
    #[arg(long, default_value_t = Counts(recall::RecallOptions::default().pair_counts))]
    pub pair_counts: Counts,
    /// Documents per pair count.
    #[arg(long, default_value_t = recall::RecallOptions::default().documents)]
    pub documents: usize,
    /// Real-text filler words after each pair, as LO-HI.
    #[arg(long, default_value_t = recall::RecallOptions::default().filler.into())]
    pub filler: Range,
}

#[derive(Args)]
pub struct NeedleArgs {
    #[command(flatten)]
    pub m: ModelOut,
    #[command(flatten)]
    pub pairs: PairArgs,
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
    #[command(flatten)]
    pub pairs: PairArgs,
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
    #[arg(long, default_value_t = icl::IclOptions::default().shots)]
    pub shots: usize,
    /// Random orders of the same demonstrations.
    #[arg(long, default_value_t = icl::IclOptions::default().orders)]
    pub orders: usize,
    /// Classes of the synthetic task (chance accuracy 1/N; ignored with --data).
    #[arg(long, default_value_t = icl::IclOptions::default().classes)]
    pub classes: usize,
    /// Independent sets of demonstrations (and, for the synthetic task, label words).
    #[arg(long, default_value_t = icl::IclOptions::default().episodes)]
    pub episodes: usize,
    /// Input letters per class in one episode of the synthetic task (0: every letter of the
    /// class's group of the alphabet; compare's models are trained with 2).
    #[arg(long, default_value_t = icl::IclOptions::default().letters_per_class)]
    pub letters: usize,
    /// Queries scored per order and episode.
    #[arg(long, default_value_t = icl::IclOptions::default().queries)]
    pub queries: usize,
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
            let opts = needle::NeedleOptions {
                trials: a.trials,
                seed: a.m.seed,
                haystack: a.haystack,
                pairs: a.pairs.format(),
                ..Default::default()
            };
            (needle::run_needle(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
        Instrument::Recall(a) => {
            let opts = recall::RecallOptions {
                pair_counts: a.pair_counts.0,
                documents: a.documents,
                filler: a.filler.into(),
                pairs: a.pairs.format(),
                seed: a.m.seed,
                ..Default::default()
            };
            (recall::run_recall(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
        Instrument::Attention(a) => {
            let opts = attention::AttentionOptions {
                trials: a.trials,
                seed: a.m.seed,
                haystack: a.haystack,
                pairs: a.pairs.format(),
                ..Default::default()
            };
            (attention::run_attention(&a.m.model, &opts, &a.m.out)?, a.m.out)
        }
        Instrument::Icl(a) => {
            let opts = icl::IclOptions {
                shots: a.shots,
                orders: a.orders,
                classes: a.classes,
                letters_per_class: a.letters,
                episodes: a.episodes,
                queries: a.queries,
                seed: a.m.seed,
                data: a.data,
            };
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
    /// Training budget: steps per model ("90", "300steps"), or the training time of the whole
    /// compare ("15m", "900s", "1h"), turned into one step count for every model by timing a few
    /// steps of each first (equal tokens per family and size).
    #[arg(long, default_value_t = compare::DEFAULT_STEPS.to_string())]
    pub budget: String,
    /// A one-minute smoke run (2 seeds, a few steps, small instrument settings).
    #[arg(long)]
    pub quick: bool,
    /// Families to compare (comma-separated): baseline, diff-v1, diff-v2, and diff-v1-nonorm
    /// (diff-v1 without its per-head norm, the paper's ablation).
    #[arg(long, value_delimiter = ',', default_value = "baseline,diff-v1,diff-v2")]
    pub families: Vec<Arm>,
    /// Extra model widths (d_model, comma separated) for the parameter-efficiency fit, e.g.
    /// 64,96 (the preset's width is always trained). Empty: one size.
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Runs trained side by side, each with cores / jobs threads (0: one per core; measured
    /// faster than one run on all cores for small models, see docs/compare/README.md).
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
    /// Model preset shared by all families (parameter-matched by construction).
    #[arg(long, default_value_t = CompareOptions::default().preset)]
    pub preset: String,
    /// Real text of the training mixture (default: the bundled corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Mixture: share of the training characters (tokens) that are real text.
    #[arg(long, default_value_t = MixtureSpec::default().text_fraction)]
    pub text_fraction: f64,
    /// Mixture: share of the characters in needle documents (key-value pairs hidden in real text, then questions).
    #[arg(long, default_value_t = MixtureSpec::default().needle_fraction)]
    pub needle_fraction: f64,
    /// Mixture: share of the characters in associative-recall documents (pairs, then every key queried).
    #[arg(long, default_value_t = MixtureSpec::default().recall_fraction)]
    pub recall_fraction: f64,
    /// Mixture: share of the characters in synthetic in-context classification documents.
    #[arg(long, default_value_t = MixtureSpec::default().icl_fraction)]
    pub icl_fraction: f64,
    #[command(flatten)]
    pub pairs: PairArgs,
    /// Training needle and recall documents ask their questions once, instead of in reshuffled
    /// rounds that fill the document (the default; see docs/compare/calibration.md).
    #[arg(long)]
    pub single_round: bool,
    /// Difficulty: key-value pairs per training recall document, as LO-HI.
    #[arg(long, default_value_t = MixtureSpec::default().recall_pairs.into())]
    pub recall_pairs: Range,
    /// Difficulty: real-text words after each recall pair, as LO-HI (0-0: none).
    #[arg(long, default_value_t = MixtureSpec::default().recall_filler.into())]
    pub recall_filler: Range,
    /// Pair counts the recall instrument measures (comma separated).
    #[arg(long, default_value_t = Counts(CompareOptions::default().recall.pair_counts))]
    pub recall_eval: Counts,
    /// Difficulty: needles per training needle document, as LO-HI.
    #[arg(long, default_value_t = MixtureSpec::default().needles.into())]
    pub needles: Range,
    /// Difficulty: classes of the synthetic in-context task in training, as LO-HI.
    #[arg(long, default_value_t = MixtureSpec::default().classes.into())]
    pub icl_classes: Range,
    /// Classes of the in-context instrument (chance accuracy 1/N).
    #[arg(long, default_value_t = CompareOptions::default().icl.classes)]
    pub icl_eval_classes: usize,
    /// Difficulty: input letters per class in one in-context episode, in training and in the
    /// instrument (0: every letter of the class's group of the alphabet). Few letters make inputs
    /// recur within an episode.
    #[arg(long, default_value_t = MixtureSpec::default().icl_letters)]
    pub icl_letters: usize,
    /// Report folder (training runs go to OUT/runs/).
    #[arg(long, default_value = "runs/compare")]
    pub out: PathBuf,
    /// Training sequence length, also the models' context.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    #[arg(long, default_value_t = CompareOptions::default().lr)]
    pub lr: f64,
}

pub fn cmd_compare(a: CompareArgs) -> Result<()> {
    let budget: Budget = a.budget.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let defaults = CompareOptions::default();
    let opts = CompareOptions {
        seeds: a.seeds,
        budget,
        quick: a.quick,
        arms: a.families,
        sizes: a.sizes,
        jobs: a.jobs,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        preset: a.preset,
        data: a.data,
        mixture: difftx_experiments::mixture::MixtureSpec {
            text_fraction: a.text_fraction,
            needle_fraction: a.needle_fraction,
            recall_fraction: a.recall_fraction,
            icl_fraction: a.icl_fraction,
            pairs: a.pairs.format(),
            recall_pairs: a.recall_pairs.into(),
            recall_filler: a.recall_filler.into(),
            question_rounds: !a.single_round,
            needles: a.needles.into(),
            classes: a.icl_classes.into(),
            icl_letters: a.icl_letters,
            ..defaults.mixture.clone()
        },
        recall: difftx_experiments::recall::RecallOptions { pair_counts: a.recall_eval.0, ..defaults.recall.clone() },
        icl: difftx_experiments::icl::IclOptions { classes: a.icl_eval_classes, ..defaults.icl.clone() },
        out: a.out,
        seq_len: a.seq_len,
        batch_size: a.batch_size,
        lr: a.lr,
        ..defaults
    };
    let report = compare::run_compare(&opts)?;
    // The overview table; the details are in the report file.
    let md = std::fs::read_to_string(&report.report_md)?;
    let overview = md.split("## Overview").nth(1).and_then(|s| s.split("\n## Claims in detail").next()).unwrap_or(&md);
    println!("## Overview{overview}");
    eprintln!("report: {} ({:.0} s)", report.report_md.display(), report.wall_secs);
    Ok(())
}
