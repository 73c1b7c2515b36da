//! Throughput benchmarks on the shapes of docs/design.md §4.3, as JSON.
//!
//! * `train`: tokens/s of full training steps on `bench-s` (batch 8 × 256 tokens, f32): forward,
//!   loss, backward, global-norm clipping and AdamW, the same pieces and order as the trainer.
//!   Warmup steps first, then timed steps; per-phase means are reported too. All families (and
//!   their bf16 runs) are timed side by side: one step of each in turn, so that a shared host's
//!   swings in speed fall on all of them alike and their ratios hold.
//! * `train_bf16`: the same steps with bf16 products in the linear layers (`Precision::Bf16`:
//!   AMX or AVX512_BF16), interleaved with the f32 runs; empty where `--precision bf16` runs f32
//!   (no backend, or Intel's half-rate AVX512_BF16 without AMX: `train_bf16_note` says which).
//! * `train_reference_kernels`: the same with `Kernels::Reference` (composed candle ops) for one
//!   family, so the gain of the fused kernels is visible.
//! * `decode`: tokens/s generating `decode_tokens` new tokens after a short prompt, batch 1,
//!   greedy — the fused decoder (what `generate` runs), the tensor path beside it, and the fused
//!   decoder stepping `decode_batches` sequences at once, with f32, with f32 weights and a bf16 KV
//!   cache, with bf16 weights and KV cache, and with bf16 weights and an int8 KV cache. The
//!   families' fused decoders are timed side by side too, a block of steps of each in turn, and
//!   each of their figures is the median of `DECODE_RUNS` runs.
//! * `cpu`: the CPU's model name and ISA extensions, so every report says where it ran.
//! * `host_matmul`: the GFLOP/s of one f32 product of the training step's shape (a SwiGLU input
//!   projection, `[batch·seq, d_model] · [d_ff, d_model]ᵀ`) before the training runs and after
//!   everything: how fast the host multiplied at that hour. `bench/pytorch_ref.py` times the same
//!   product with torch, so a round of `bench/side_by_side.py` shows how far the two engines'
//!   training ratio follows their matmuls (a shared host's speed moves by the hour).
//! * `attn_long`: one layer's attention sub-layer forward (projections, RoPE, attention, the
//!   family's combination, output projection) on `[1, N, 256]` hidden states. Each N runs in a
//!   fresh child process (the caller says how to start it) so that its peak resident memory
//!   (`VmHWM`) is its own; the figure includes the process baseline (binary, allocator, the
//!   one-layer model and the input), which is reported separately as `rss_before_forward_mib`.
//! * `ratios`: DIFF (diff-v1, diff-v2) over baseline step times / decode times, and over the
//!   baseline's model FLOPs per training step (`ModelConfig::training_flops_per_token`): the step
//!   time ratio that kernels running every product at one speed would give. The step-time ratios
//!   (means over the steps, as `bench/pytorch_ref.py` computes PyTorch's) come again as
//!   `..._paired`: the median of the rounds' own ratios (each DIFF step over the baseline step
//!   of its round, seconds apart) with a distribution-free 95% confidence interval
//!   (`median_with_ci95`), so that one run says whether a ratio is below a target or only
//!   near it. Each training report has its step's model GFLOP (linear layers, attention), the
//!   time its steps spent in the attention kernels (`difftx_core::profile`) and the model
//!   GFLOP/s achieved by the whole step, inside the attention kernels and outside them
//!   (attention's FLOPs over its time, the linear layers' over the rest: element-wise work
//!   counts as time but not as FLOPs).
//!
//! Threads: `difftx bench` sets `CANDLE_NUM_THREADS=1` (candle's spinning barrier pool for
//! element-wise ops otherwise competes with rayon's gemm and kernel threads: on the shared
//! 2-core machines steps were 2-4x slower under load) and `RAYON_NUM_THREADS` (else candle reads
//! /proc/cpuinfo on every matmul), unless the caller set them; the report echoes both.

use crate::optim::{grad_norm, AdamW, AdamWParams};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use difftx_core::generate::{
    bf16_draft, generate_fused, generate_speculative, generate_with_forward, Sampler, SamplingParams,
};
use difftx_core::model::{init_weights, Model};
use difftx_core::profile::{attention_time, Pass};
use difftx_core::{Decoder, KvPrecision, SequenceCache, WeightPrecision};
use difftx_core::{Family, Kernels, ModelConfig, Precision};
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

/// How the attn-long measurements are run.
#[derive(Debug, Clone)]
pub enum AttnRunner {
    /// Start `exe args... --attn-child-family F --attn-child-n N`; the child must call
    /// [`attn_long_child`] and print its JSON on stdout. Peak RSS is then per measurement.
    ChildProcess { exe: PathBuf, args: Vec<String> },
    /// Run in this process (peak RSS is then the whole process's so far: an upper bound).
    InProcess,
}

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub families: Vec<Family>,
    /// Measure training (false: decode and attn-long only).
    pub train: bool,
    /// Model preset for training and decoding (docs/design.md §4.3: `bench-s`).
    pub preset: String,
    pub batch_size: usize,
    pub seq_len: usize,
    pub warmup_steps: usize,
    pub steps: usize,
    /// Also time training with bf16 products (skipped where `--precision bf16` runs f32).
    pub bf16: bool,
    /// Family whose training is also timed with `Kernels::Reference` (None: skip).
    pub reference_family: Option<Family>,
    pub reference_steps: usize,
    pub decode_tokens: usize,
    /// Numbers of sequences decoded together by the fused decoder (empty: skip).
    pub decode_batches: Vec<usize>,
    pub prompt_tokens: usize,
    /// Sequence lengths of the attn-long measurement (empty: skip).
    pub attn_lengths: Vec<usize>,
    /// Families measured at attn-long (empty: skip).
    pub attn_families: Vec<Family>,
    pub attn_runner: AttnRunner,
    pub seed: u64,
}

impl BenchOptions {
    /// The full benchmark of docs/design.md §4.3 (a few minutes on 2 cores).
    pub fn full(attn_runner: AttnRunner) -> Self {
        BenchOptions {
            families: Family::ALL.to_vec(),
            train: true,
            preset: "bench-s".into(),
            batch_size: 8,
            seq_len: 256,
            warmup_steps: 3,
            steps: 10,
            bf16: true,
            reference_family: Some(Family::DiffV1),
            reference_steps: 4,
            decode_tokens: 256,
            decode_batches: vec![1, 4, 16],
            prompt_tokens: 16,
            attn_lengths: vec![4096, 16384, 65536],
            attn_families: vec![Family::Baseline, Family::DiffV1],
            attn_runner,
            seed: 0,
        }
    }

    /// A smoke run of every part on small sizes (seconds): for tests.
    pub fn quick(attn_runner: AttnRunner) -> Self {
        BenchOptions {
            families: Family::ALL.to_vec(),
            train: true,
            preset: "tiny".into(),
            batch_size: 2,
            seq_len: 64,
            warmup_steps: 1,
            steps: 2,
            bf16: true,
            reference_family: Some(Family::DiffV1),
            reference_steps: 1,
            decode_tokens: 8,
            decode_batches: vec![1, 3],
            prompt_tokens: 4,
            attn_lengths: vec![256, 512],
            attn_families: vec![Family::Baseline, Family::DiffV1],
            attn_runner,
            seed: 0,
        }
    }
}

/// Mean seconds of each phase of a training step.
#[derive(Debug, Default, Clone, Copy)]
struct Phases {
    forward: f64,
    backward: f64,
    clip: f64,
    adamw: f64,
}

/// One training step exactly as `trainer::run` does it with grad_accum 1: forward, loss,
/// backward, global norm, AdamW with the clip factor applied to the gradients inside its pass.
/// Returns the loss.
fn train_step(
    model: &Model,
    vars: &[(String, Var)],
    opt: &mut AdamW,
    xs: &Tensor,
    ys: &Tensor,
    lr: f64,
    ph: &mut Phases,
) -> Result<f64> {
    let t0 = Instant::now();
    let loss = Model::loss(&model.forward(xs, None)?, ys)?;
    let l = loss.to_scalar::<f32>()? as f64;
    let t1 = Instant::now();
    let grads = loss.backward()?;
    let t2 = Instant::now();
    let norm = grad_norm(&grads, vars)?;
    if !norm.is_finite() || !l.is_finite() {
        bail!("benchmark training diverged (loss {l}, grad norm {norm})");
    }
    let clip = 1.0;
    let factor = if norm > clip { clip / norm } else { 1.0 };
    let t3 = Instant::now();
    opt.step_scaled(&grads, lr, factor)?;
    let t4 = Instant::now();
    ph.forward += (t1 - t0).as_secs_f64();
    ph.backward += (t2 - t1).as_secs_f64();
    ph.clip += (t3 - t2).as_secs_f64();
    ph.adamw += (t4 - t3).as_secs_f64();
    Ok(l)
}

fn random_ids(rng: &mut rand::rngs::StdRng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

fn bench_config(opts: &BenchOptions, family: Family) -> Result<ModelConfig> {
    let mut cfg = ModelConfig::preset(&opts.preset, family)?;
    cfg.max_seq_len = cfg.max_seq_len.max(opts.seq_len).max(opts.prompt_tokens + opts.decode_tokens);
    Ok(cfg)
}

/// Blocks of products `host_matmul_gflops` times (its figure is their median).
const MATMUL_BLOCKS: usize = 5;

/// GFLOP/s of `[batch·seq, d_model] · [d_ff, d_model]ᵀ` in f32 through candle (the linear layers'
/// path), the median of [`MATMUL_BLOCKS`] blocks of products lasting ~50 ms each.
fn host_matmul_gflops(opts: &BenchOptions) -> Result<(f64, [usize; 3])> {
    let cfg = bench_config(opts, Family::Baseline)?;
    let (m, k, n) = (opts.batch_size * opts.seq_len, cfg.d_model, cfg.d_ff);
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.t()?;
    let flops = 2.0 * (m * k * n) as f64;
    let t0 = std::time::Instant::now();
    a.matmul(&w)?;
    let reps = ((0.05 / t0.elapsed().as_secs_f64().max(1e-6)) as usize).clamp(1, 1000);
    let mut rates: Vec<f64> = (0..MATMUL_BLOCKS)
        .map(|_| {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                a.matmul(&w)?;
            }
            Ok(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9)
        })
        .collect::<Result<_>>()?;
    rates.sort_by(f64::total_cmp);
    Ok(((rates[MATMUL_BLOCKS / 2] * 10.0).round() / 10.0, [m, k, n]))
}

fn build(cfg: &ModelConfig, seed: u64) -> Result<(Model, Vec<(String, Var)>)> {
    let weights = init_weights(cfg, seed, DType::F32, &Device::Cpu)?;
    let vars: Vec<(String, Var)> =
        weights.iter().map(|(n, t)| Ok((n.clone(), Var::from_tensor(t)?))).collect::<Result<_>>()?;
    let map: HashMap<String, Tensor> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    Ok((Model::from_weights(cfg, &map)?, vars))
}

/// One family's training run for the benchmark: model, optimizer, batch source and the timings
/// of its steps so far.
struct TrainBench {
    cfg: ModelConfig,
    model: Model,
    vars: Vec<(String, Var)>,
    opt: AdamW,
    rng: rand::rngs::StdRng,
    kernels: Kernels,
    precision: Precision,
    phases: Phases,
    step_secs: Vec<f64>,
    /// Time of the timed steps inside the attention kernels (`difftx_core::profile`), forward
    /// and backward.
    attention_secs: [f64; 2],
    last_loss: f64,
}

impl TrainBench {
    fn new(opts: &BenchOptions, family: Family, kernels: Kernels, precision: Precision) -> Result<Self> {
        let cfg = bench_config(opts, family)?;
        let (mut model, vars) = build(&cfg, opts.seed)?;
        model.opts.kernels = kernels;
        model.opts.precision = precision;
        let opt = AdamW::new(&vars, AdamWParams::default())?;
        let rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
        let phases = Phases::default();
        Ok(TrainBench {
            cfg,
            model,
            vars,
            opt,
            rng,
            kernels,
            precision,
            phases,
            step_secs: Vec::new(),
            attention_secs: [0.0; 2],
            last_loss: f64::NAN,
        })
    }

    /// One step on a fresh random batch; `timed` steps count in the report.
    fn step(&mut self, opts: &BenchOptions, timed: bool) -> Result<()> {
        let (b, t, dev) = (opts.batch_size, opts.seq_len, Device::Cpu);
        let x = random_ids(&mut self.rng, b * t, self.cfg.vocab_size);
        let y = random_ids(&mut self.rng, b * t, self.cfg.vocab_size);
        let (xs, ys) = (Tensor::from_vec(x, (b, t), &dev)?, Tensor::from_vec(y, (b, t), &dev)?);
        let mut untimed = Phases::default();
        let phases = if timed { &mut self.phases } else { &mut untimed };
        let passes = [Pass::Forward, Pass::Backward];
        let (t0, attention0) = (Instant::now(), passes.map(attention_time));
        let (model, vars, opt) = (&self.model, &self.vars, &mut self.opt);
        self.last_loss = crate::on_pool(|| train_step(model, vars, opt, &xs, &ys, 1e-3, phases))?;
        if timed {
            self.step_secs.push(t0.elapsed().as_secs_f64());
            for (i, pass) in passes.into_iter().enumerate() {
                self.attention_secs[i] += (attention_time(pass) - attention0[i]).as_secs_f64();
            }
        }
        Ok(())
    }

    fn report(&self, opts: &BenchOptions) -> Value {
        let (b, t, steps) = (opts.batch_size, opts.seq_len, self.step_secs.len());
        let total: f64 = self.step_secs.iter().sum();
        let n = steps.max(1) as f64;
        let ms = |s: f64| (s / n * 1e4).round() / 10.0;
        let ph = &self.phases;
        let flops = self.cfg.training_flops_per_token(t);
        let tokens = (b * t * steps) as f64;
        let gflop = |f: f64| (f * (b * t) as f64 / 1e7).round() / 100.0;
        let gflops = |f: f64, secs: f64| (secs > 0.0).then(|| (f * tokens / secs / 1e8).round() / 10.0);
        // The reference kernels compose attention from candle ops, which the profile does not see.
        let attention_secs: f64 = self.attention_secs.iter().sum();
        let attention = (attention_secs > 0.0).then_some(attention_secs);
        json!({
            "tokens_per_sec": (tokens / total).round(),
            "model_gflop_per_step": {"linear": gflop(flops.linear), "attention": gflop(flops.attention)},
            "model_gflops_per_sec": {
                "step": gflops(flops.total(), total),
                "attention_kernels": attention.and_then(|a| gflops(flops.attention, a)),
                "outside_attention_kernels": attention.and_then(|a| gflops(flops.linear, total - a)),
            },
            "attention_kernels_ms_mean": attention.map(|_| json!({"forward": ms(self.attention_secs[0]), "backward": ms(self.attention_secs[1])})),
            "attention_kernels_share_of_step": attention.map(|a| (a / total * 1000.0).round() / 1000.0),
            "step_ms_mean": ms(total),
            "step_ms_median": (median(&self.step_secs) * 1e4).round() / 10.0,
            "phase_ms_mean": {"forward_loss": ms(ph.forward), "backward": ms(ph.backward), "clip": ms(ph.clip), "adamw": ms(ph.adamw)},
            "steps": steps, "warmup_steps": opts.warmup_steps, "batch": b, "seq": t,
            "kernels": format!("{:?}", self.kernels).to_lowercase(), "precision": self.precision.describe(),
            "params": self.cfg.param_counts().total, "last_loss": self.last_loss,
        })
    }
}

/// Training throughput of several runs measured side by side: after each run's warmup steps,
/// their timed steps alternate (one step of each in turn), so a change in the machine's speed
/// during the measurement (other guests on a shared host swing it by up to 2× within minutes)
/// falls on every run alike and their ratios stay meaningful.
fn bench_train_interleaved(opts: &BenchOptions, runs: &mut [TrainBench], steps: usize) -> Result<Vec<Value>> {
    for run in runs.iter_mut() {
        for _ in 0..opts.warmup_steps {
            run.step(opts, false)?;
        }
    }
    let bar = indicatif::ProgressBar::new((steps * runs.len()) as u64);
    // indicatif draws only when stderr is a terminal, so piped JSON runs stay clean.
    bar.set_style(indicatif::ProgressStyle::with_template("bench: timed training steps {bar:30} {pos}/{len}")?);
    for _ in 0..steps {
        for run in runs.iter_mut() {
            run.step(opts, true)?;
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok(runs.iter().map(|r| r.report(opts)).collect())
}

/// Decode steps each decoder takes in a row before the next one's turn in [`decode_interleaved`]:
/// short enough that the host's swings fall on every family alike, long enough that reloading a
/// model's weights into the caches at the start of its turn weighs little. Three bench-s models
/// (3 × 19.6 MB in f32) do not fit the AMD EPYC's 32 MiB L3: stepping them one token each in turn
/// gave every family about a third fewer tokens/s (half with bf16 weights) than timing them one
/// after the other in the same hour.
const DECODE_BLOCK: usize = 64;

/// Timed decode runs per measurement, of which the median is reported: one run of 256 bench-s
/// tokens lasts ~0.1 s on the 2-core machines, short enough for one slow moment of a shared host
/// to halve it (the Zen 5 side-by-side of 2026-12-02 saw 1,563 and 3,619 tokens/s in one set).
const DECODE_RUNS: usize = 5;

/// One decoder's [`DECODE_RUNS`] runs.
struct DecodeRuns {
    /// The first sequence's tokens (the same every run: greedy).
    tokens: Vec<u32>,
    median_secs: f64,
    /// Every run's seconds, in run order.
    secs: Vec<f64>,
}

/// [`decode_interleaved`] [`DECODE_RUNS`] times, per decoder.
fn decode_median(
    decoders: &[Decoder],
    prompts: &[Vec<u32>],
    seqs: usize,
    new_tokens: usize,
    time_prefill: bool,
) -> Result<Vec<DecodeRuns>> {
    let mut runs: Vec<(Vec<u32>, Vec<f64>)> = Vec::new();
    for _ in 0..DECODE_RUNS {
        for (i, (out, secs)) in
            decode_interleaved(decoders, prompts, seqs, new_tokens, time_prefill)?.into_iter().enumerate()
        {
            match runs.get_mut(i) {
                Some((first, all)) if *first == out => all.push(secs),
                Some(_) => bail!("decode chose different greedy tokens in two runs of one decoder"),
                None => runs.push((out, vec![secs])),
            }
        }
    }
    Ok(runs.into_iter().map(|(tokens, secs)| DecodeRuns { tokens, median_secs: median(&secs), secs }).collect())
}

/// The middle of `values` (the upper one of an even count); `values` must not be empty.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// [`median`] of `values` with a 95% confidence interval that assumes nothing of their
/// distribution (only independent draws): the order statistics `k + 1` and `n − k` of the `n`
/// values, `k` the largest count for which a Binomial(n, ½) falls at or below `k` with
/// probability ≤ 2.5%, so the interval misses the true median with probability
/// `2·P(Bin ≤ k)` ≤ 5% (10 values: the 2nd and 9th, 97.9%). `None` for the interval under 6
/// values, where even the extremes cover less than 95%; `values` must not be empty.
fn median_with_ci95(values: &[f64]) -> (f64, Option<(f64, f64)>) {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let (mut k, mut ln_choose, mut below) = (None, 0.0f64, 0.0f64);
    for i in 0..n / 2 {
        // ln C(n, i), built up term by term: the binomial probabilities stay finite at any n.
        if i > 0 {
            ln_choose += ((n - i + 1) as f64 / i as f64).ln();
        }
        below += (ln_choose - n as f64 * std::f64::consts::LN_2).exp();
        if below > 0.025 {
            break;
        }
        k = Some(i);
    }
    (median(values), k.map(|k| (sorted[k], sorted[n - 1 - k])))
}

/// The median of the rounds' own step-time ratios of `run` over `base` (timed in the same
/// rounds by [`bench_train_interleaved`]) with its 95% interval ([`median_with_ci95`]).
fn paired_step_ratio(run: &TrainBench, base: &TrainBench) -> Value {
    let per_round: Vec<f64> = run.step_secs.iter().zip(&base.step_secs).map(|(r, b)| r / b).collect();
    if per_round.is_empty() {
        return Value::Null;
    }
    let round3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let (mid, ci) = median_with_ci95(&per_round);
    json!({
        "median": round3(mid),
        "ci95": ci.map(|(lo, hi)| [round3(lo), round3(hi)]),
        "rounds": per_round.len(),
    })
}

/// `n` tokens in `secs` seconds, as tokens/s to one decimal.
fn per_sec(n: usize, secs: f64) -> f64 {
    (n as f64 / secs * 10.0).round() / 10.0
}

/// Tokens the bf16 draft proposes per pass of speculative decoding in `difftx bench`: the fastest
/// of 2, 3, 4, 6 and 8 on bench-s (docs/design.md §7.27).
pub const SPECULATIVE_DRAFT: usize = 6;

/// Speculative decoding at batch 1, greedy, prompt included: the f32 decoder checking the drafts
/// of a bf16 copy (bf16 weights and cache), each run alternated with plain f32 decoding of the
/// same prompt (`generate_fused`; the order flips every run), after one untimed run of both.
/// Fails unless both give the same tokens. Per model: the speculative median, the alternated
/// plain median, their ratio and the share of drafts kept.
fn bench_speculative(models: &[Model], prompts: &[Vec<u32>], n: usize) -> Result<Vec<Value>> {
    let greedy = || Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
    let mut report = Vec::with_capacity(models.len());
    for (model, prompt) in models.iter().zip(prompts) {
        let (target, draft) = (Decoder::new(model)?, bf16_draft(model)?);
        let (mut plain_secs, mut spec_secs) = (Vec::new(), Vec::new());
        let mut stats = Default::default();
        for run in 0..=DECODE_RUNS {
            let plain = |secs: &mut Vec<f64>| -> Result<Vec<u32>> {
                let t0 = Instant::now();
                let out = generate_fused(&target, prompt, n, &mut greedy()?, |_| Ok(()))?;
                secs.push(t0.elapsed().as_secs_f64());
                Ok(out)
            };
            let mut speculative = |secs: &mut Vec<f64>| -> Result<Vec<u32>> {
                let t0 = Instant::now();
                let (out, s) =
                    generate_speculative(&target, &draft, prompt, n, SPECULATIVE_DRAFT, &mut greedy()?, |_| Ok(()))?;
                secs.push(t0.elapsed().as_secs_f64());
                stats = s;
                Ok(out)
            };
            let (a, b) = if run % 2 == 0 {
                let a = plain(&mut plain_secs)?;
                (a, speculative(&mut spec_secs)?)
            } else {
                let b = speculative(&mut spec_secs)?;
                (plain(&mut plain_secs)?, b)
            };
            if a != b {
                bail!("speculative decoding chose other tokens than plain greedy decoding");
            }
            if run == 0 {
                // The untimed warm-up run.
                plain_secs.clear();
                spec_secs.clear();
            }
        }
        let (plain, spec) = (median(&plain_secs), median(&spec_secs));
        report.push(json!({
            "tokens_per_sec": per_sec(n, spec),
            "tokens_per_sec_plain_alternated": per_sec(n, plain),
            "over_plain": (plain / spec * 1000.0).round() / 1000.0,
            "tokens_per_sec_runs": spec_secs.iter().map(|&s| per_sec(n, s)).collect::<Vec<_>>(),
            "draft_len": SPECULATIVE_DRAFT,
            "acceptance": (stats.acceptance() * 1000.0).round() / 1000.0,
        }));
    }
    Ok(report)
}

/// Greedy decoding with every decoder side by side, [`DECODE_BLOCK`] steps of each in turn (as
/// training is timed one step of each), so that a shared host's swings fall on all of them alike.
/// Each decoder prefills `seqs` sequences with its prompt, then steps them together until each
/// has `new_tokens` tokens. Returns, per decoder, the tokens of its first sequence and the seconds
/// of its own work (prefill included when `time_prefill`).
fn decode_interleaved(
    decoders: &[Decoder],
    prompts: &[Vec<u32>],
    seqs: usize,
    new_tokens: usize,
    time_prefill: bool,
) -> Result<Vec<(Vec<u32>, f64)>> {
    let mut sampler = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() })?;
    // per decoder: its sequences, their next tokens, the first sequence's output, seconds
    let mut state = Vec::with_capacity(decoders.len());
    for (decoder, prompt) in decoders.iter().zip(prompts) {
        let t0 = Instant::now();
        let mut caches: Vec<SequenceCache> = (0..seqs).map(|_| decoder.new_sequence()).collect();
        let mut next = Vec::with_capacity(seqs);
        for cache in caches.iter_mut() {
            next.push(sampler.sample(&decoder.prefill(cache, prompt)?));
        }
        let secs = if time_prefill { t0.elapsed().as_secs_f64() } else { 0.0 };
        let out = vec![next[0]];
        state.push((caches, next, out, secs));
    }
    let mut done = 1;
    while done < new_tokens {
        let block = DECODE_BLOCK.min(new_tokens - done);
        for (decoder, (caches, next, out, secs)) in decoders.iter().zip(state.iter_mut()) {
            let t0 = Instant::now();
            for _ in 0..block {
                let mut refs: Vec<&mut SequenceCache> = caches.iter_mut().collect();
                let logits = decoder.step(&mut refs, next)?;
                let vocab = logits.len() / seqs;
                *next = logits.chunks_exact(vocab).map(|row| sampler.sample(row)).collect();
                out.push(next[0]);
            }
            *secs += t0.elapsed().as_secs_f64();
        }
        done += block;
    }
    Ok(state.into_iter().map(|(_, _, out, secs)| (out, secs)).collect())
}

/// Decode throughput, greedy, every family side by side (see [`decode_interleaved`]): batch 1
/// through the fused decoder (prompt included), the same with bf16 / int8 weights, and several
/// sequences stepped at once; the tensor path (`Model::forward` with a KV cache) is timed per
/// family after them, and must choose the same tokens as the fused decoder.
fn bench_decode(opts: &BenchOptions) -> Result<Map<String, Value>> {
    let mut models = Vec::new();
    let mut prompts = Vec::new();
    for &family in &opts.families {
        let cfg = bench_config(opts, family)?;
        let (model, _) = build(&cfg, opts.seed)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed + 1);
        prompts.push(random_ids(&mut rng, opts.prompt_tokens.max(1), cfg.vocab_size));
        models.push(model);
    }
    let n = opts.decode_tokens;
    let timed = |precision: WeightPrecision| -> Result<Vec<DecodeRuns>> {
        let decoders = models.iter().map(|m| Decoder::with_precision(m, precision)).collect::<Result<Vec<_>, _>>()?;
        decode_interleaved(&decoders, &prompts, 1, 4.min(n), true)?; // warms the allocator and caches
        decode_median(&decoders, &prompts, 1, n, true)
    };
    let f32_runs = timed(WeightPrecision::F32)?;
    // Each model's f32 decoder alone in the process, as `generate` and `serve` run it (and as
    // the PyTorch reference times Hugging Face's `generate`): models stepped in turn share the
    // caches, and on the Xeon model 207 a model alone decoded up to ~25% faster (design.md §7.29).
    let mut alone = Vec::with_capacity(models.len());
    for (model, prompt) in models.iter().zip(&prompts) {
        let decoder = [Decoder::new(model)?];
        let prompt = std::slice::from_ref(prompt);
        decode_interleaved(&decoder, prompt, 1, 4.min(n), true)?;
        alone.extend(decode_median(&decoder, prompt, 1, n, true)?);
    }
    let mut reduced: Vec<Map<String, Value>> = vec![Map::new(); models.len()];
    // bf16 and int8 weights through the same fused decoder (tokens may differ from f32).
    for (name, precision) in [("bf16", WeightPrecision::Bf16), ("int8", WeightPrecision::Int8)] {
        for (into, runs) in reduced.iter_mut().zip(timed(precision)?) {
            into.insert(name.into(), json!(per_sec(runs.tokens.len(), runs.median_secs)));
        }
    }
    // Several sequences at once: f32; f32 weights with a bf16 KV cache; bf16 weights with a bf16
    // or an int8 KV cache (the bytes a step reads halved or more: what bounds many sequences once
    // their caches outgrow the last-level cache, design.md §7.24 and §7.44).
    // Per family, each batched figure's key and its tokens/s by batch size.
    let mut batched: Vec<Map<String, Value>> = vec![Map::new(); models.len()];
    for (key, weights, kv) in [
        ("batched_tokens_per_sec", WeightPrecision::F32, KvPrecision::F32),
        ("batched_tokens_per_sec_bf16_kv_cache", WeightPrecision::F32, KvPrecision::Bf16),
        ("batched_tokens_per_sec_bf16_weights_and_kv_cache", WeightPrecision::Bf16, KvPrecision::Bf16),
        ("batched_tokens_per_sec_bf16_weights_int8_kv_cache", WeightPrecision::Bf16, KvPrecision::Int8),
    ] {
        let mut decoders = models.iter().map(|m| Decoder::with_precision(m, weights)).collect::<Result<Vec<_>, _>>()?;
        decoders.iter_mut().for_each(|d| d.set_kv_precision(kv));
        let mut by_batch: Vec<Map<String, Value>> = vec![Map::new(); models.len()];
        for &b in &opts.decode_batches {
            for (into, runs) in by_batch.iter_mut().zip(decode_median(&decoders, &prompts, b, n, false)?) {
                into.insert(b.to_string(), json!(per_sec(b * n.saturating_sub(1), runs.median_secs)));
            }
        }
        for (into, figures) in batched.iter_mut().zip(by_batch) {
            into.insert(key.into(), Value::Object(figures));
        }
    }
    let speculative = bench_speculative(&models, &prompts, n)?;
    let mut report = Map::new();
    for (i, &family) in opts.families.iter().enumerate() {
        let DecodeRuns { tokens: out, median_secs: secs, secs: runs } = &f32_runs[i];
        let greedy = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
        generate_with_forward(&models[i], &prompts[i], 4.min(n), &mut greedy?, |_| Ok(()))?;
        let t0 = Instant::now();
        let greedy = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
        let out_forward = generate_with_forward(&models[i], &prompts[i], n, &mut greedy?, |_| Ok(()))?;
        let secs_forward = t0.elapsed().as_secs_f64();
        if out.len() != n {
            bail!("decode produced {} tokens, expected {n}", out.len());
        }
        if *out != out_forward {
            bail!("the fused decoder and the forward path chose different greedy tokens ({family})");
        }
        if alone[i].tokens != *out {
            bail!("the fused decoder chose different greedy tokens alone and beside the others ({family})");
        }
        let mut r = json!({
            "tokens_per_sec": per_sec(out.len(), *secs),
            "tokens_per_sec_runs": runs.iter().map(|&r| per_sec(out.len(), r)).collect::<Vec<_>>(),
            "tokens_per_sec_alone": per_sec(out.len(), alone[i].median_secs),
            "tokens_per_sec_forward_path": per_sec(out_forward.len(), secs_forward),
            "tokens_per_sec_by_weight_precision": reduced[i],
            "speculative": speculative[i],
            "new_tokens": out.len(), "prompt_tokens": prompts[i].len(), "secs": (secs * 1e3).round() / 1e3,
            "includes_prefill": true,
            "notes": format!("families timed side by side, {DECODE_BLOCK} decode steps of each in turn (the forward path: one family after the other); every fused-decoder figure is the median of {DECODE_RUNS} runs; tokens_per_sec: the fused decoder, f32, prompt included (tokens_per_sec_runs: each run's); tokens_per_sec_alone: the same with this family's decoder alone in the process, timed after the f32 side-by-side runs (as generate and serve run one model); tokens_per_sec_forward_path: Model::forward with a KV cache; tokens_per_sec_by_weight_precision: the fused decoder with bf16 / int8 weights; batched_tokens_per_sec: sequences stepped together by the fused decoder (total new tokens/s, prefill excluded); batched_tokens_per_sec_bf16_kv_cache: the same with f32 weights and a bf16 KV cache; batched_tokens_per_sec_bf16_weights_and_kv_cache: the same with bf16 weights and a bf16 KV cache; batched_tokens_per_sec_bf16_weights_int8_kv_cache: bf16 weights and an int8 KV cache; speculative: batch 1, the f32 decoder checking {SPECULATIVE_DRAFT} drafts per pass of a bf16 copy (bf16 weights and cache), the same greedy tokens as f32, prompt included, each run alternated with plain f32 decoding (tokens_per_sec_plain_alternated; over_plain: the ratio of the medians), acceptance: the share of drafts kept"),
        });
        if let Value::Object(fields) = &mut r {
            fields.append(&mut batched[i]);
        }
        eprintln!("bench: decode {family}: {r}");
        report.insert(family.as_str().into(), r);
    }
    Ok(report)
}

/// The CPU's model name and the instruction-set extensions the kernels care about.
pub fn cpu_info() -> Value {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string())
    };
    let flags = field("flags").unwrap_or_default();
    let have: Vec<&str> = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    json!({
        "model": field("model name"),
        "family": field("cpu family"), "model_number": field("model"),
        "logical_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "isa": have,
    })
}

/// `VmHWM` (peak resident set) and `VmRSS` of this process in MiB, from /proc/self/status.
pub fn rss_mib() -> Result<(f64, f64)> {
    let status = std::fs::read_to_string("/proc/self/status").context("cannot read /proc/self/status")?;
    let field = |name: &str| -> Result<f64> {
        let line =
            status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name} in /proc/self/status"))?;
        let kb: f64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("bad line '{line}'"))?;
        Ok(kb / 1024.0)
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// The attn-long work unit: one layer's attention forward on `[1, n, D]` at the `bench-s` width
/// (D 256, H 8), fused kernels. Meant to run alone in a fresh process (see [`AttnRunner`]).
pub fn attn_long_child(family: Family, n: usize, seed: u64) -> Result<Value> {
    let (hwm_start, _) = rss_mib()?;
    let mut cfg = ModelConfig::preset("bench-s", family)?;
    cfg.n_layers = 1;
    cfg.max_seq_len = n;
    // Plain tensors, not Vars: a forward pass without autograd keeps no intermediates alive.
    let weights: HashMap<String, Tensor> = init_weights(&cfg, seed, DType::F32, &Device::Cpu)?.into_iter().collect();
    let model = Model::from_weights(&cfg, &weights)?;
    let x = Tensor::randn(0f32, 1.0, (1, n, cfg.d_model), &Device::Cpu)?;
    let (_, rss_before) = rss_mib()?;
    let t0 = Instant::now();
    let y = model.layer_attention(0, &x)?;
    let secs = t0.elapsed().as_secs_f64();
    let checksum = y.sqr()?.mean_all()?.to_scalar::<f32>()? as f64;
    if !checksum.is_finite() {
        bail!("attn-long output is not finite");
    }
    let (hwm, _) = rss_mib()?;
    Ok(json!({
        "family": family.as_str(), "n": n, "secs": (secs * 1e3).round() / 1e3,
        "tokens_per_sec": (n as f64 / secs).round(),
        "peak_rss_mib": hwm.round(), "rss_before_forward_mib": rss_before.round(), "rss_at_start_mib": hwm_start.round(),
        "mean_square_out": checksum,
    }))
}

fn bench_attn(opts: &BenchOptions, family: Family, n: usize) -> Result<Value> {
    match &opts.attn_runner {
        AttnRunner::InProcess => {
            let mut v = attn_long_child(family, n, opts.seed)?;
            v["in_process"] = json!(true);
            Ok(v)
        }
        AttnRunner::ChildProcess { exe, args } => {
            let out = std::process::Command::new(exe)
                .args(args)
                .args(["--attn-child-family", family.as_str(), "--attn-child-n", &n.to_string()])
                .output()
                .with_context(|| format!("cannot start {}", exe.display()))?;
            if !out.status.success() {
                bail!("attn-long child (N = {n}, {family}) failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            }
            let text = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str(text.trim()).with_context(|| format!("attn-long child printed no JSON: {text}"))
        }
    }
}

fn ratio(a: &Value, b: &Value, key: &str) -> Option<f64> {
    let (x, y) = (a.get(key)?.as_f64()?, b.get(key)?.as_f64()?);
    Some((x / y * 1000.0).round() / 1000.0)
}

/// Runs every part `opts` asks for and returns the report (also what `difftx bench` prints).
pub fn run_bench(opts: &BenchOptions) -> Result<Value> {
    if opts.steps == 0 || opts.batch_size == 0 || opts.seq_len == 0 {
        bail!("benchmark steps, batch size and sequence length must be positive");
    }
    let measures_training = opts.train && !opts.families.is_empty();
    let measures_decode = opts.decode_tokens > 0 && !opts.families.is_empty();
    let measures_attn = !opts.attn_lengths.is_empty() && !opts.attn_families.is_empty();
    if !(measures_training || measures_decode || measures_attn) {
        bail!(
            "nothing to benchmark: training, decoding and attn-long are all skipped (--no-train, --no-decode and --no-attn together, or no family); leave one of them on"
        );
    }
    let mut train = Map::new();
    let mut train_bf16 = Map::new();
    let mut paired_ratios = Map::new();
    let mut decode = Map::new();
    let bf16 = opts.bf16 && Precision::bf16_faster_than_f32();
    let (matmul_before, matmul_shape) = host_matmul_gflops(opts)?;
    if measures_training {
        // Every family in f32 (and in bf16 where available), their timed steps interleaved.
        let mut runs = Vec::new();
        for &f in &opts.families {
            runs.push(TrainBench::new(opts, f, Kernels::Fused, Precision::F32)?);
            if bf16 {
                runs.push(TrainBench::new(opts, f, Kernels::Fused, Precision::Bf16)?);
            }
        }
        let labels: Vec<String> = runs.iter().map(|r| format!("{} {}", r.cfg.family, r.precision.describe())).collect();
        eprintln!("bench: training {} side by side ...", labels.join(", "));
        let reports = bench_train_interleaved(opts, &mut runs, opts.steps)?;
        for (run, r) in runs.iter().zip(reports) {
            eprintln!("bench: {r}");
            let into = if run.precision == Precision::F32 { &mut train } else { &mut train_bf16 };
            into.insert(run.cfg.family.as_str().into(), r);
        }
        for run in &runs {
            let base = runs.iter().find(|b| b.cfg.family == Family::Baseline && b.precision == run.precision);
            let Some(base) = base.filter(|_| run.cfg.family != Family::Baseline) else { continue };
            let key = match run.precision {
                Precision::F32 => format!("train_step_time_{}_over_baseline_paired", run.cfg.family),
                _ => format!("train_bf16_step_time_{}_over_baseline_paired", run.cfg.family),
            };
            let paired = paired_step_ratio(run, base);
            eprintln!("bench: {key}: {paired}");
            paired_ratios.insert(key, paired);
        }
    }
    let mut reference = Map::new();
    if let Some(f) = opts.reference_family.filter(|_| measures_training) {
        eprintln!("bench: training {f} with reference kernels ...");
        let mut run = [TrainBench::new(opts, f, Kernels::Reference, Precision::F32)?];
        let r = bench_train_interleaved(opts, &mut run, opts.reference_steps.max(1))?.remove(0);
        eprintln!("bench: {r}");
        reference.insert(f.as_str().into(), r);
    }
    if measures_decode {
        let names: Vec<&str> = opts.families.iter().map(|f| f.as_str()).collect();
        eprintln!("bench: decoding {} side by side ...", names.join(", "));
        decode = bench_decode(opts)?;
    }
    let mut ratios = paired_ratios;
    if let Some(base) = train.get("baseline") {
        let flops = |f| Ok::<_, anyhow::Error>(bench_config(opts, f)?.training_flops_per_token(opts.seq_len).total());
        for f in [Family::DiffV1, Family::DiffV2] {
            if let Some(d) = train.get(f.as_str()) {
                ratios.insert(format!("train_step_time_{f}_over_baseline"), json!(ratio(d, base, "step_ms_mean")));
                let r = flops(f)? / flops(Family::Baseline)?;
                ratios.insert(format!("train_model_flops_{f}_over_baseline"), json!((r * 1000.0).round() / 1000.0));
            }
        }
    }
    if let Some(base) = train_bf16.get("baseline") {
        for f in ["diff-v1", "diff-v2"] {
            if let Some(d) = train_bf16.get(f) {
                ratios.insert(format!("train_bf16_step_time_{f}_over_baseline"), json!(ratio(d, base, "step_ms_mean")));
            }
        }
    }
    for (f, b) in &train_bf16 {
        if let Some(r) = train.get(f) {
            ratios.insert(format!("train_speedup_bf16_over_f32_{f}"), json!(ratio(b, r, "tokens_per_sec")));
        }
    }
    if let Some(base) = decode.get("baseline") {
        for f in ["diff-v1", "diff-v2"] {
            if let Some(d) = decode.get(f) {
                ratios.insert(format!("decode_time_{f}_over_baseline"), json!(ratio(base, d, "tokens_per_sec")));
            }
        }
    }
    if let (Some(r), Some(f)) = (opts.reference_family, opts.reference_family.and_then(|f| train.get(f.as_str()))) {
        if let Some(rv) = reference.get(r.as_str()) {
            ratios.insert(format!("train_speedup_fused_over_reference_{r}"), json!(ratio(f, rv, "tokens_per_sec")));
        }
    }
    let mut attn = Map::new();
    for &f in &opts.attn_families {
        let mut rows = Vec::new();
        for &n in &opts.attn_lengths {
            eprintln!("bench: attn-long {f} N = {n} ...");
            let r = bench_attn(opts, f, n)?;
            eprintln!("bench: {r}");
            rows.push(r);
        }
        attn.insert(f.as_str().into(), Value::Array(rows));
    }
    let (matmul_after, _) = host_matmul_gflops(opts)?;
    Ok(json!({
        "engine": "difftx",
        "cpu": cpu_info(),
        "host_matmul": {"shape_m_k_n": matmul_shape, "gflops_before": matmul_before, "gflops_after": matmul_after},
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "env": {"CANDLE_NUM_THREADS": std::env::var("CANDLE_NUM_THREADS").ok(), "RAYON_NUM_THREADS": std::env::var("RAYON_NUM_THREADS").ok()},
        "preset": opts.preset, "batch": opts.batch_size, "seq": opts.seq_len, "dtype": "f32",
        "train": train,
        "train_bf16": train_bf16,
        "train_bf16_note": Precision::Bf16.resolve().1,
        "train_reference_kernels": reference,
        "decode": decode,
        "ratios": ratios,
        "attn_long": attn,
        "notes": "attn_long: one layer's attention sub-layer forward, batch 1, D 256; peak_rss_mib is the child process's VmHWM and includes its baseline (binary, allocator, model, input: rss_before_forward_mib)",
    }))
}

#[cfg(test)]
mod tests {
    use super::median_with_ci95;

    /// The interval's order statistics are the textbook ones (10 values: 2nd and 9th; 100 values:
    /// 40th and 61st), the extremes at 6 values, none below; the values' order does not matter.
    #[test]
    fn median_interval_takes_the_binomial_order_statistics() {
        let shuffled = |n: usize| -> Vec<f64> { (0..n).map(|i| ((i * 37) % n) as f64 + 1.0).collect() };
        assert_eq!(median_with_ci95(&shuffled(10)), (6.0, Some((2.0, 9.0))));
        assert_eq!(median_with_ci95(&shuffled(100)), (51.0, Some((40.0, 61.0))));
        assert_eq!(median_with_ci95(&shuffled(6)), (4.0, Some((1.0, 6.0))));
        assert_eq!(median_with_ci95(&shuffled(5)), (3.0, None));
        assert_eq!(median_with_ci95(&[1.5]), (1.5, None));
        // Far past where 2^n leaves f64.
        let (_, ci) = median_with_ci95(&shuffled(3000));
        let (lo, hi) = ci.unwrap();
        assert!(lo < 1500.0 && hi > 1501.0 && hi - lo < 120.0, "{lo} {hi}");
    }
}
