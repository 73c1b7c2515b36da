//! `difftx`: the command line. A thin layer over difftx-core and difftx-train: it parses
//! arguments, reads files, and prints; all the work is in the libraries.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Parser, Subcommand};
use difftx_core::checkpoint;
use difftx_core::generate::{
    bf16_draft, check_prompt, generate, generate_fused, generate_speculative, Sampler, SamplingParams,
};
use difftx_core::tokenizer::{StreamDecoder, Tokenizer};
use difftx_core::{Decoder, Family, Kernels, KvPrecision, ModelConfig, Precision, WeightFormat, WeightPrecision};
use difftx_train::data::{load_texts, TokenDataset, WindowStart};
use difftx_train::eval::evaluate_text;
use difftx_train::optim::{AdamWParams, Decay};
use difftx_train::trainer::{self, RunControl, TrainOptions};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

mod analyze;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "difftx",
    version,
    about = "Train, run and inspect Differential Transformers (baseline, diff-v1, diff-v2) on the CPU."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model on text (a file, a folder of .txt files, or JSONL), or resume a run.
    Train(TrainArgs),
    /// Generate text from a model, streamed to stdout.
    Generate(GenerateArgs),
    /// Serve a model over HTTP with OpenAI's completions and chat API (continuous batching,
    /// streaming, Prometheus metrics). Stops gracefully on SIGTERM or Ctrl-C.
    Serve(ServeArgs),
    /// Validation loss, perplexity and bits per byte of a model on a text.
    Eval(EvalArgs),
    /// Dump logits for token ids: IN holds an integer `input_ids` [B, T]; OUT gets f32 `logits` [B, T, V] (and the ids).
    Logits(LogitsArgs),
    /// Write a model as a Hugging Face folder: diff-v1 as DiffLlama, baseline as Llama, diff-v2 as
    /// DifftxDiffV2ForCausalLM with its PyTorch code beside it (load with trust_remote_code=True).
    Export(ExportArgs),
    /// Show a config's shapes and parameter counts for all three families side by side.
    Info(InfoArgs),
    /// The source article's check: SNR and outliers of standard vs differential attention on
    /// synthetic Q, K, V (or Q, K, V from a .npz).
    Demo(analyze::DemoArgs),
    /// Run one of the paper's instruments on a model; writes JSON and a PNG.
    #[command(subcommand)]
    Analyze(analyze::Instrument),
    /// Train parameter-matched baseline, diff-v1 and diff-v2 models with the same seeds and
    /// budget, run every instrument on each, and write report.md / report.json / plots.
    Compare(analyze::CompareArgs),
    /// Tokenizer tools.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Throughput benchmarks (training, decoding, long attention) as JSON.
    Bench(BenchArgs),
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer on text files and write tokenizer.json.
    Train {
        /// Vocabulary size (>= 256: all bytes are always in the vocabulary).
        #[arg(long, default_value_t = 1024)]
        vocab: usize,
        /// Output tokenizer.json.
        #[arg(long)]
        out: PathBuf,
        /// Text files to learn from (default: the bundled corpus).
        files: Vec<PathBuf>,
    },
}

/// Where the model's shape comes from: a preset or a JSON config, plus the family.
#[derive(Args, Clone)]
struct ModelSource {
    /// Model preset: tiny (tests, demo), bench-s (benchmarks), small (~20M parameters).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// A JSON model config (overrides --preset); see `difftx info --print-config`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Attention family: baseline, diff-v1 (the paper) or diff-v2.
    #[arg(long, default_value = "diff-v1")]
    family: Family,
}

impl ModelSource {
    fn resolve(&self) -> Result<ModelConfig> {
        let cfg = match &self.config {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
                let cfg: ModelConfig = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not a valid model config", path.display()))?;
                cfg.with_family(self.family)
            }
            None => ModelConfig::preset(&self.preset, self.family)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelSource,
    /// Training text: a file, a folder of .txt files, or a .jsonl file (see --field).
    #[arg(long)]
    data: Option<PathBuf>,
    /// JSONL field holding the text.
    #[arg(long, default_value = "text")]
    field: String,
    /// A tokenizer.json (default: bytes, vocabulary 256).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Fine-tune: start from this model's weights (a difftx run or model folder, or a Hugging Face
    /// DiffLlama / Llama / exported diff-v2 folder) with its config and tokenizer, instead of a
    /// random initialisation. Excludes --preset, --config, --family and --tokenizer.
    #[arg(long, conflicts_with_all = ["preset", "config", "family", "tokenizer", "resume"])]
    init: Option<PathBuf>,
    /// Run folder: checkpoint/, metrics.jsonl, train_config.json.
    #[arg(long, default_value = "runs/default")]
    out: PathBuf,
    /// Continue the run in --out from its last checkpoint (its saved options are used).
    #[arg(long)]
    resume: bool,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 600)]
    steps: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Tokens per training sequence (default: the model's context).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// Decay after warmup: cosine, linear or constant.
    #[arg(long, default_value = "cosine")]
    schedule: Decay,
    /// Final learning rate as a fraction of the peak.
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    #[arg(long, default_value_t = 200)]
    checkpoint_every: usize,
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fraction of the token stream held out for validation (taken from its end).
    #[arg(long, default_value_t = 0.05)]
    val_fraction: f64,
    /// Where training windows start: anywhere, or document-start (short documents of a
    /// folder or JSONL file are never cut; what `compare` uses).
    #[arg(long, default_value = "anywhere", value_parser = parse_windows)]
    windows: WindowStart,
    /// Stop after this many seconds in this invocation (a checkpoint is written; --resume continues).
    #[arg(long)]
    time_limit: Option<f64>,
    /// Stop after this many steps in this invocation (a checkpoint is written; --resume continues).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Print a sample of this many tokens when training ends (0: none).
    #[arg(long, default_value_t = 200)]
    sample_tokens: usize,
    /// Hot-op implementation: fused (flash attention and fused norms/softmax with hand-written
    /// backward) or reference (composed candle ops; slower, for checking).
    #[arg(long, default_value = "fused")]
    kernels: KernelChoice,
    /// Matrix products of the linear layers and of the fused attention kernels' tiles: f32, or
    /// bf16 (inputs rounded to bf16, sums in f32, on AMX or AVX512_BF16; where the CPU has
    /// neither, or only Intel's AVX512_BF16, which is slower than f32, training says so and runs
    /// in f32). Weights, gradients, optimizer state and checkpoints stay f32 either way.
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum KernelChoice {
    Fused,
    Reference,
}

impl KernelChoice {
    fn get(self) -> Kernels {
        match self {
            KernelChoice::Fused => Kernels::Fused,
            KernelChoice::Reference => Kernels::Reference,
        }
    }
}

#[derive(Args)]
struct GenerateArgs {
    /// Model folder or training run folder.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight format of the linear layers: f32, q8_0 (8-bit) or q4k (4-bit).
    #[arg(long, default_value = "f32")]
    weights: WeightFormat,
    /// Decoding precision of the linear layers' weights in the fused decoder: f32, bf16 (half the
    /// bytes per token, and bf16 products: each product's inputs rounded to bf16 too, sums in
    /// f32, by AVX512_BF16 where the CPU has it) or int8 (symmetric per output channel, a
    /// quarter; f32 arithmetic). Activations between the products stay f32. Needs `--weights f32`.
    #[arg(long, default_value = "f32")]
    precision: WeightPrecision,
    /// How the fused decoder caches keys and values: f32, bf16 (half the bytes read per cached
    /// position; the logits move by bf16 rounding) or int8 (each position of a head as codes and
    /// one scale: 9/32 of f32's bytes at head size 32; the logits move about twice as far as
    /// bf16's). Needs `--weights f32`.
    #[arg(long, default_value = "f32")]
    kv_cache: KvPrecision,
    /// Speculative decoding: a copy of the model with bf16 weights and a bf16 cache drafts up to
    /// this many tokens at a time and the decoder at --precision checks them in one pass, keeping
    /// the drafts it would have picked itself (greedy, or sampled: a draw depends only on --seed,
    /// the token's index and the logits). The text is that of plain decoding at --precision with
    /// the same --temperature, --top-k, --top-p and --seed; what changes is the speed: faster when
    /// reading the weights from memory bounds a step, as f32 at batch 1 does on most hosts
    /// (docs/design.md §7.27, §7.32), slower where the f32 weights stay in the L3 cache (a Zen 4
    /// with 32 MiB: 0.67-1.00x plain, §7.34), and more so where they fit it but not with the
    /// draft's (bench-s on a Zen 3 with 32 MiB: 0.52-0.76x, §7.42); `difftx bench` measures both.
    /// Needs --weights f32.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    speculative: Option<u64>,
}

#[derive(Args)]
struct ServeArgs {
    /// Model folder: a training run, a difftx model folder, or a Hugging Face DiffLlama / Llama
    /// folder (its tokenizer.json and the chat template in tokenizer_config.json are used).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on (loopback by default; 0.0.0.0 exposes the server to the network).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Weights of the linear layers: f32, bf16 (bf16 products with f32 sums, as `generate
    /// --precision bf16`) or int8 (per output channel) run all requests of a step in one batched
    /// pass of the fused decoder; q8_0 and q4k (ggml blocks) run them one after the other.
    #[arg(long, default_value = "f32")]
    weights: difftx_serve::engine::ServeWeights,
    /// How the fused decoder caches keys and values: f32, bf16 (half the bytes read per cached
    /// position: faster when many requests run together, logits within bf16 rounding of f32's)
    /// or int8 (codes and one scale per position of a head: 9/32 of f32's bytes at head size 32,
    /// the logits moving about twice as far as bf16's). Needs --weights f32, bf16 or int8.
    #[arg(long, default_value = "f32")]
    kv_cache: KvPrecision,
    /// Requests decoded together at most; more wait in the queue.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Speculative decoding for a request while it runs alone: a copy of the model with bf16
    /// weights and a bf16 cache drafts up to this many tokens at a time and the model checks
    /// them in one pass (`generate --speculative`). A request gets the same text as without,
    /// greedy or sampled with its seed; a lone request is faster where reading the weights from
    /// memory bounds a step (f32 weights: docs/design.md §7.27, §7.32), no faster where they
    /// stay in the L3 cache (§7.34), slower where they fit it but not with the copy's (§7.42:
    /// 0.52-0.76x on a Zen 3), at the cost of the copy's memory (half the f32 weights) and
    /// its cache per request. Needs --weights f32, bf16 or int8.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    speculative: Option<u64>,
    /// Requests waiting for a slot at most; beyond it the server answers 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest max_tokens a request may ask for [default: the model's context].
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Require 'Authorization: Bearer KEY' on /v1 endpoints (also read from DIFFTX_API_KEY).
    #[arg(long, env = "DIFFTX_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Seconds running requests may go on after SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    shutdown_grace: f64,
    /// The model's id in the API [default: the folder's name].
    #[arg(long)]
    model_id: Option<String>,
}

#[derive(Args)]
struct EvalArgs {
    #[arg(long)]
    model: PathBuf,
    /// Text to evaluate on (file, folder of .txt, or JSONL).
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value = "text")]
    field: String,
    /// Sequence length (default: the model's context).
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// At most this many batches.
    #[arg(long, default_value_t = 50)]
    max_batches: usize,
    /// Weight format of the linear layers: f32, q8_0 (8-bit) or q4k (4-bit).
    #[arg(long, default_value = "f32")]
    weights: WeightFormat,
}

#[derive(Args)]
struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    /// safetensors file with an integer tensor `input_ids` [B, T].
    #[arg(long)]
    ids: PathBuf,
    /// Output safetensors file (f32 `logits` [B, T, V]).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct ExportArgs {
    /// difftx model folder, training run, or Hugging Face folder.
    #[arg(long)]
    model: PathBuf,
    /// Output folder (config.json, model.safetensors, tokenizer.json when the model has one).
    #[arg(long)]
    out: PathBuf,
    /// hf: a Hugging Face folder (DiffLlama, Llama, or diff-v2 with its PyTorch code); official:
    /// diff-v1 in the layout of the authors' MultiheadDiffAttn (interleaved pairs and RoPE,
    /// sub-layer-norm gain, out_proj), which difftx reads back.
    #[arg(long, default_value = "hf", value_parser = ["hf", "official"])]
    layout: String,
}

#[derive(Args)]
struct InfoArgs {
    #[command(flatten)]
    model: ModelSource,
    /// Also print the full JSON config of the chosen family.
    #[arg(long)]
    print_config: bool,
}

/// Thread setup, measured on the 2-core machines (docs/design.md §7.3): candle's
/// own spinning thread pool for element-wise ops fights rayon (gemm, the fused kernels) for the
/// cores, making steps 2-4x slower under load; and without RAYON_NUM_THREADS every candle matmul
/// re-reads /proc/cpuinfo. Must run before candle's first op; child processes inherit it. A value
/// the user set wins.
fn configure_threads() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// mimalloc's `mi_option_purge_delay`: its index in `mi_option_t` (mimalloc 2 and 3), which
/// libmimalloc-sys does not name.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps the memory mimalloc frees instead of returning it to the OS once it has been free for the
/// purge delay (1 s in mimalloc 3). Training allocates the same buffers every step, and memory
/// given back comes back as page faults that the kernel zero-fills: 61-67 thousand faults in a
/// bench-s diff-v1 `difftx bench` run against ~770 with this, and shorter steps in 12 of 16
/// alternating runs (docs/design.md §7.2). Peak memory is the same; the process only stops
/// shrinking, so the long-running server keeps mimalloc's default.
fn keep_freed_memory() {
    // SAFETY: sets a plain integer option; mimalloc reads it whenever it considers a purge.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

fn main() {
    configure_threads();
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        keep_freed_memory();
    }
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => cmd_train(a),
        Command::Generate(a) => cmd_generate(a),
        Command::Serve(a) => cmd_serve(a),
        Command::Eval(a) => cmd_eval(a),
        Command::Logits(a) => cmd_logits(a),
        Command::Info(a) => cmd_info(a),
        Command::Export(a) => cmd_export(a),
        Command::Demo(a) => analyze::cmd_demo(a),
        Command::Compare(a) => analyze::cmd_compare(a),
        Command::Analyze(what) => analyze::cmd_analyze(what),
        Command::Bench(a) => cmd_bench(a),
        Command::Tokenizer(TokenizerCommand::Train { vocab, out, files }) => {
            let files = if files.is_empty() { vec![difftx_train::data::bundled_corpus()?] } else { files };
            difftx_core::tokenizer::train_bpe(&files, vocab, &out)?;
            println!("wrote {}", out.display());
            Ok(())
        }
    }
}

fn parse_windows(s: &str) -> Result<WindowStart, String> {
    match s {
        "anywhere" => Ok(WindowStart::Anywhere),
        "document-start" => Ok(WindowStart::DocumentStart),
        _ => Err(format!("unknown window start '{s}' (expected anywhere or document-start)")),
    }
}

fn load_tokenizer(path: Option<&Path>) -> Result<Tokenizer> {
    match path {
        Some(p) => Tokenizer::from_file(p),
        None => Ok(Tokenizer::bytes()),
    }
}

fn cmd_train(a: TrainArgs) -> Result<()> {
    let (precision, fallback) = a.precision.resolve();
    if let Some(why) = fallback {
        eprintln!("{why}");
    } else if precision != Precision::F32 {
        eprintln!("precision: {}", precision.describe());
    }
    let ctl = RunControl {
        stop_after: a.stop_after,
        time_limit_secs: a.time_limit,
        kernels: a.kernels.get(),
        precision,
        progress: std::io::stderr().is_terminal(),
        overall: None,
    };
    let (opts, summary) = if a.resume {
        let opts = trainer::read_options(&a.out)?;
        let tok = load_tokenizer(opts.tokenizer.as_deref())?;
        let texts = load_texts(&opts.data, &opts.jsonl_field)?;
        let ds = TokenDataset::build(&texts, &tok, opts.seq_len, opts.val_fraction)?;
        eprintln!(
            "resuming {} ({} {}, {} steps)",
            a.out.display(),
            opts.model.family,
            param_summary(&opts.model),
            opts.steps
        );
        let s = trainer::train_resume(&a.out, &tok, &ds, &ctl)?;
        (opts, s)
    } else {
        // --init: the model's shape and tokenizer are the starting model's own.
        let (model, tok, tokenizer, init_dir) = match &a.init {
            Some(init) => {
                let dir = checkpoint::resolve_model_dir(init)?;
                let model = checkpoint::read_config(&dir)?;
                let tok = Tokenizer::from_model_dir(&dir)?;
                let file = dir.join(difftx_core::tokenizer::TOKENIZER_JSON);
                (model, tok, file.is_file().then_some(file), Some(dir))
            }
            None => {
                let mut model = a.model.resolve()?;
                let tok = load_tokenizer(a.tokenizer.as_deref())?;
                if a.tokenizer.is_some() {
                    model.vocab_size = tok.vocab_size();
                }
                (model, tok, a.tokenizer.clone(), None)
            }
        };
        let data = match &a.data {
            Some(d) => d.clone(),
            None => difftx_train::data::bundled_corpus()?,
        };
        let seq_len = a.seq_len.unwrap_or(model.max_seq_len);
        let opts = TrainOptions {
            model,
            data: data.clone(),
            jsonl_field: a.field.clone(),
            tokenizer,
            steps: a.steps,
            batch_size: a.batch_size,
            seq_len,
            grad_accum: a.grad_accum,
            lr: a.lr,
            min_lr_ratio: a.min_lr_ratio,
            warmup_steps: a.warmup,
            decay: a.schedule,
            adamw: AdamWParams { weight_decay: a.weight_decay, ..Default::default() },
            grad_clip: a.grad_clip,
            eval_every: a.eval_every,
            eval_batches: a.eval_batches,
            checkpoint_every: a.checkpoint_every,
            log_every: a.log_every,
            seed: a.seed,
            val_fraction: a.val_fraction,
            windows: a.windows,
            init: init_dir,
        };
        opts.validate()?;
        let texts = load_texts(&data, &a.field)?;
        let ds = TokenDataset::build(&texts, &tok, seq_len, opts.val_fraction)?;
        eprintln!(
            "training {} {} on {} ({} train / {} validation tokens) -> {}",
            opts.model.family,
            param_summary(&opts.model),
            data.display(),
            ds.train.len(),
            ds.val.len(),
            a.out.display()
        );
        let s = trainer::train_new(&a.out, &opts, &tok, &ds, &ctl)?;
        (opts, s)
    };
    let st = &summary.state;
    let (init, last) = (st.initial_val_loss.unwrap_or(f64::NAN), st.last_val_loss.unwrap_or(f64::NAN));
    println!(
        "{} after {}/{} steps ({} tokens, {:.0} tokens/s): validation loss {:.4} -> {:.4} ({:.1}% lower)",
        if summary.finished { "finished" } else { "stopped" },
        st.step,
        opts.steps,
        st.tokens_seen,
        summary.tokens_per_sec,
        init,
        last,
        100.0 * (init - last) / init
    );
    println!("checkpoint: {}", a.out.join(checkpoint::RUN_CHECKPOINT).display());
    if !summary.finished {
        println!("continue with: difftx train --resume --out {}", a.out.display());
    }
    if a.sample_tokens > 0 {
        let model = checkpoint::load_runnable(&a.out, &Device::Cpu)?;
        let tok = Tokenizer::from_model_dir(&checkpoint::resolve_model_dir(&a.out)?)?;
        println!("--- sample (temperature 0.8) ---");
        stream_generate(
            &model,
            &tok,
            "ROMEO:",
            a.sample_tokens,
            SamplingParams { temperature: 0.8, seed: 0, ..Default::default() },
            DecodeChoice::default(),
        )?;
        println!();
    }
    Ok(())
}

fn param_summary(cfg: &ModelConfig) -> String {
    format!("{:.2}M params", cfg.param_counts().total as f64 / 1e6)
}

/// How `stream_generate` decodes: the fused decoder's weights and cache (`generate --precision`,
/// `--kv-cache`), and speculative decoding's drafts per pass (`--speculative`).
#[derive(Clone, Copy)]
struct DecodeChoice {
    precision: WeightPrecision,
    kv_cache: KvPrecision,
    speculative: Option<u64>,
}

impl Default for DecodeChoice {
    fn default() -> Self {
        DecodeChoice { precision: WeightPrecision::F32, kv_cache: KvPrecision::F32, speculative: None }
    }
}

fn stream_generate(
    model: &difftx_core::Model,
    tok: &Tokenizer,
    prompt: &str,
    n: usize,
    params: SamplingParams,
    choice: DecodeChoice,
) -> Result<()> {
    let DecodeChoice { precision, kv_cache, speculative } = choice;
    if speculative.is_some() && !Decoder::supports(model) {
        bail!("--speculative runs the fused decoder, which needs f32 weights: drop --weights");
    }
    let fused = precision != WeightPrecision::F32 || kv_cache != KvPrecision::F32;
    if fused && !Decoder::supports(model) {
        let (precision, kv_cache) = (format!("{precision:?}"), format!("{kv_cache:?}"));
        bail!(
            "--precision {} --kv-cache {} run the fused decoder, which needs f32 weights: drop --weights",
            precision.to_lowercase(),
            kv_cache.to_lowercase()
        );
    }
    let ids = tok.encode(prompt)?;
    // Refused before the prompt is echoed, so that a refusal prints no text.
    check_prompt(&ids, model.config().max_seq_len)?;
    let mut sampler = Sampler::new(params)?.limited_to(tok.id_limit());
    let mut out = std::io::stdout().lock();
    write!(out, "{prompt}")?;
    let mut dec = StreamDecoder::new(tok);
    let on_token = |id| {
        write!(out, "{}", dec.push(id)?)?;
        out.flush()?;
        Ok(())
    };
    if fused || speculative.is_some() {
        let mut decoder = Decoder::with_precision(model, precision)?;
        decoder.set_kv_precision(kv_cache);
        if let Some(draft_len) = speculative {
            let draft = bf16_draft(model)?;
            let (_, stats) =
                generate_speculative(&decoder, &draft, &ids, n, draft_len as usize, &mut sampler, on_token)?;
            eprintln!(
                "\nspeculative decoding: {} of {} drafted tokens kept ({:.1}%) in {} passes",
                stats.accepted,
                stats.drafted,
                100.0 * stats.acceptance(),
                stats.rounds
            );
        } else {
            generate_fused(&decoder, &ids, n, &mut sampler, on_token)?;
        }
    } else {
        generate(model, &ids, n, &mut sampler, on_token)?;
    }
    write!(out, "{}", dec.finish()?)?;
    out.flush()?;
    Ok(())
}

/// Loads a model for inference with its linear layers in `weights` format.
fn load_for_inference(dir: &Path, weights: WeightFormat) -> Result<difftx_core::Model> {
    let mut model = checkpoint::load_runnable(dir, &Device::Cpu)?;
    if weights != WeightFormat::F32 {
        let used = model.quantize_weights(weights)?;
        eprintln!("quantised linear layers: {used:?}");
    }
    Ok(model)
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let dir = checkpoint::resolve_model_dir(&a.model)?;
    let model = load_for_inference(&dir, a.weights)?;
    let tok = Tokenizer::from_model_dir(&dir)?;
    let params = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed };
    let choice = DecodeChoice { precision: a.precision, kv_cache: a.kv_cache, speculative: a.speculative };
    stream_generate(&model, &tok, &a.prompt, a.max_new_tokens, params, choice)?;
    println!();
    Ok(())
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    if !(a.shutdown_grace.is_finite() && a.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a number of seconds >= 0, got {}", a.shutdown_grace);
    }
    let opts = difftx_serve::ServeOptions {
        host: a.host,
        port: a.port,
        weights: a.weights,
        kv_cache: a.kv_cache,
        max_batch: a.max_batch,
        speculative: a.speculative.map(|k| k as usize),
        max_queue: a.max_queue,
        max_tokens: a.max_tokens,
        api_key: a.api_key,
        shutdown_grace: std::time::Duration::from_secs_f64(a.shutdown_grace),
        model_id: a.model_id,
    };
    difftx_serve::run(&a.model, opts)
}

fn cmd_eval(a: EvalArgs) -> Result<()> {
    let dir = checkpoint::resolve_model_dir(&a.model)?;
    let model = load_for_inference(&dir, a.weights)?;
    let tok = Tokenizer::from_model_dir(&dir)?;
    let seq_len = a.seq_len.unwrap_or(model.config().max_seq_len);
    let texts = load_texts(&a.data, &a.field)?;
    let r = evaluate_text(&model, &tok, &texts, seq_len, a.batch_size, a.max_batches)
        .with_context(|| format!("cannot evaluate on {}", a.data.display()))?;
    let report = serde_json::json!({
        "model": dir, "data": a.data, "weights": format!("{:?}", a.weights), "tokens_evaluated": r.tokens_evaluated,
        "loss": r.loss, "perplexity": r.perplexity, "bits_per_byte": r.bits_per_byte, "bytes_per_token": r.bytes_per_token,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn cmd_logits(a: LogitsArgs) -> Result<()> {
    let model = checkpoint::load_runnable(&a.model, &Device::Cpu)?;
    let inputs = checkpoint::read_safetensors(&a.ids, &Device::Cpu)?;
    let ids =
        inputs.get("input_ids").with_context(|| format!("{} has no tensor named 'input_ids'", a.ids.display()))?;
    if ids.rank() != 2 {
        bail!("{}: input_ids must have shape [B, T], got {:?}", a.ids.display(), ids.dims());
    }
    let as_i64 = ids.to_dtype(DType::I64)?;
    let vals = as_i64.flatten_all()?.to_vec1::<i64>()?;
    let vocab = model.config().vocab_size as i64;
    if let Some(bad) = vals.iter().find(|&&v| v < 0 || v >= vocab) {
        bail!("{}: input_ids contains {bad}, outside the model's vocabulary 0..{vocab}", a.ids.display());
    }
    let ids = Tensor::from_vec(vals.iter().map(|&v| v as u32).collect::<Vec<_>>(), ids.dims(), &Device::Cpu)?;
    let logits = model.forward(&ids, None)?.to_dtype(DType::F32)?;
    // The ids travel with the logits so the file is self-describing (scripts/export_roundtrip.py).
    let bytes = checkpoint::safetensors_bytes(&[("logits".to_string(), logits), ("input_ids".to_string(), as_i64)])?;
    checkpoint::write_atomic(&a.out, &bytes)?;
    eprintln!("wrote logits {:?} to {}", [ids.dim(0)?, ids.dim(1)?, vocab as usize], a.out.display());
    Ok(())
}

fn cmd_export(a: ExportArgs) -> Result<()> {
    let dir = checkpoint::resolve_model_dir(&a.model)?;
    let (cfg, weights) = checkpoint::load_model(&dir, DType::F32, &Device::Cpu)?;
    if a.layout == "official" {
        difftx_core::official::export_official(&cfg, &weights, &a.out)?;
    } else {
        difftx_core::hf::export_hf(&cfg, &weights, &a.out)?;
    }
    let tok = dir.join("tokenizer.json");
    if tok.is_file() {
        std::fs::copy(&tok, a.out.join("tokenizer.json")).with_context(|| format!("cannot copy {}", tok.display()))?;
    } else {
        eprintln!("note: the model uses the byte tokenizer (token id = byte value); no tokenizer.json was written");
    }
    println!(
        "wrote {} ({} as {})",
        a.out.display(),
        cfg.family,
        match cfg.family {
            _ if a.layout == "official" => "the official MultiheadDiffAttn layout",
            Family::DiffV1 => "DiffLlamaForCausalLM",
            Family::Baseline => "LlamaForCausalLM",
            Family::DiffV2 => "DifftxDiffV2ForCausalLM, remote code beside it",
        }
    );
    Ok(())
}

fn cmd_info(a: InfoArgs) -> Result<()> {
    let cfg = a.model.resolve()?;
    println!(
        "D {}  layers {}  baseline heads {} (kv {})  head dim {}  SwiGLU {}  vocab {}  context {}",
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim(),
        cfg.d_ff,
        cfg.vocab_size,
        cfg.max_seq_len
    );
    println!("{:<28}{:>14}{:>14}{:>14}", "parameters", "baseline", "diff-v1", "diff-v2");
    let counts: Vec<_> = Family::ALL.iter().map(|f| cfg.with_family(*f).param_counts()).collect();
    type Field = fn(&difftx_core::config::ParamCounts) -> usize;
    let rows: [(&str, Field); 7] = [
        ("embedding", |c| c.embedding),
        ("attention projections", |c| c.attention_projections),
        ("attention extra (λ, norm)", |c| c.attention_extra),
        ("SwiGLU", |c| c.mlp),
        ("norms", |c| c.norms),
        ("LM head", |c| c.lm_head),
        ("total", |c| c.total),
    ];
    for (name, get) in rows {
        println!("{:<28}{:>14}{:>14}{:>14}", name, get(&counts[0]), get(&counts[1]), get(&counts[2]));
    }
    let heads = |f: Family| {
        let c = cfg.with_family(f);
        match f {
            Family::Baseline => format!("{} heads x d {}", c.n_heads, c.head_dim()),
            Family::DiffV1 => format!("{} diff heads (2 maps of d {}, value 2d)", c.n_heads / 2, c.head_dim()),
            Family::DiffV2 => {
                format!("{} query heads, {} kv heads, d {}", c.n_q_proj_heads(), c.n_kv_proj_heads(), c.head_dim())
            }
        }
    };
    for f in Family::ALL {
        println!("{:<10}{}", f.as_str(), heads(f));
    }
    if a.print_config {
        println!("{}", serde_json::to_string_pretty(&cfg)?);
    }
    Ok(())
}

#[derive(Args)]
struct BenchArgs {
    /// Families to benchmark (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "baseline,diff-v1,diff-v2")]
    families: Vec<Family>,
    /// Timed training steps per family, after the warmup steps (default 10; 2 with --quick).
    #[arg(long)]
    steps: Option<usize>,
    /// Untimed training steps per family first, so that the allocator's pages and the caches are
    /// warm when timing starts (default 3; 1 with --quick).
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// attn-long sequence lengths (comma separated; default 4096,16384,65536).
    #[arg(long, value_delimiter = ',')]
    attn_lengths: Option<Vec<usize>>,
    /// Skip the attn-long measurement.
    #[arg(long)]
    no_attn: bool,
    /// Skip the reference-kernel training measurement.
    #[arg(long)]
    no_reference: bool,
    /// Skip the bf16 training measurement (run by default where `--precision bf16` trains in
    /// bf16: AMX-BF16, or AVX512_BF16 other than Intel's half-rate one).
    #[arg(long)]
    no_bf16: bool,
    /// Skip every training measurement (decode and attn-long only).
    #[arg(long)]
    no_train: bool,
    /// Skip every decode measurement (training and attn-long only: a profile of the training
    /// steps alone).
    #[arg(long)]
    no_decode: bool,
    /// Numbers of sequences the fused decoder steps together (comma separated; default 1,4,16).
    #[arg(long, value_delimiter = ',')]
    decode_batches: Option<Vec<usize>>,
    /// A smoke run on small shapes (seconds), not the benchmark shapes.
    #[arg(long)]
    quick: bool,
    /// Internal: run one attn-long measurement in this process and print its JSON.
    #[arg(long, hide = true, requires = "attn_child_n")]
    attn_child_family: Option<Family>,
    #[arg(long, hide = true)]
    attn_child_n: Option<usize>,
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    if let (Some(family), Some(n)) = (a.attn_child_family, a.attn_child_n) {
        println!("{}", difftx_train::bench::attn_long_child(family, n, 0)?);
        return Ok(());
    }
    use difftx_train::bench::{run_bench, AttnRunner, BenchOptions};
    let exe = std::env::current_exe().context("cannot locate the difftx binary for the attn-long child processes")?;
    let runner = AttnRunner::ChildProcess { exe, args: vec!["bench".into()] };
    let mut opts = if a.quick { BenchOptions::quick(runner) } else { BenchOptions::full(runner) };
    opts.families = a.families;
    opts.attn_families.retain(|f| opts.families.contains(f));
    if opts.reference_family.is_some_and(|f| !opts.families.contains(&f)) || a.no_reference {
        opts.reference_family = None;
    }
    opts.train = !a.no_train;
    opts.bf16 = !a.no_bf16;
    if a.no_decode {
        opts.decode_tokens = 0;
    }
    if let Some(b) = a.decode_batches {
        opts.decode_batches = b;
    }
    opts.steps = a.steps.unwrap_or(opts.steps);
    opts.warmup_steps = a.warmup_steps.unwrap_or(opts.warmup_steps);
    if let Some(l) = a.attn_lengths {
        opts.attn_lengths = l;
    }
    if a.no_attn {
        opts.attn_lengths.clear();
    }
    println!("{}", serde_json::to_string_pretty(&run_bench(&opts)?)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `MI_OPTION_PURGE_DELAY` is the purge delay of the mimalloc linked in: its default there is
    /// mimalloc 3's 1000 ms, and `keep_freed_memory` turns it off (-1). Fails if a mimalloc
    /// update moves the option.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: reads an integer option.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), 1000);
        }
        keep_freed_memory();
        assert_eq!(get(), -1);
    }
}
