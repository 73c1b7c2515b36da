//! Speculative decoding with drafts of every weight and cache precision against plain f32
//! decoding on this machine: `speculative_drafts [FAMILY] [ROUNDS]` (diff-v1 and 8 by default).
//! bench-s with its initial weights, greedy, a 16-token prompt and 240 new tokens; each round
//! decodes plainly, then with each draft at 2, 4 and 6 drafts per pass (the first round untimed),
//! and checks that every run gives the plain run's tokens. Prints the medians, each draft's ratio to
//! plain decoding and its acceptance. Whether a draft pays depends on the machine: on a Zen 3 whose
//! last-level cache holds the f32 weights but not the weights and a draft's, none did
//! (docs/design.md §7.42). Run it with `MIMALLOC_PURGE_DELAY=-1`, as the CLI runs.
use candle_core::{DType, Device, Tensor};
use difftx_core::generate::{generate_fused, generate_speculative, Sampler, SamplingParams};
use difftx_core::model::{init_weights, Model};
use difftx_core::{Decoder, Family, KvPrecision, ModelConfig, WeightPrecision};
use std::collections::HashMap;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../../difftx-kernels/examples/common/args.rs"]
mod args;

const USAGE: &str = "speculative_drafts [FAMILY] [ROUNDS]";
const DRAFTS_PER_PASS: [usize; 3] = [2, 4, 6];
const NEW_TOKENS: usize = 240;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let arg = |n: usize| std::env::args().nth(n);
    let family: Family = arg(1).map_or(Ok(Family::DiffV1), |t| args::parse(&t, "FAMILY", USAGE))?;
    let rounds: usize = arg(2).map_or(Ok(8), |t| args::parse(&t, "ROUNDS", USAGE))?;
    anyhow::ensure!(rounds >= 2, "ROUNDS must be at least 2 (the first is untimed)\nusage: {USAGE}");
    let cfg = ModelConfig::preset("bench-s", family)?;
    let w: HashMap<String, Tensor> = init_weights(&cfg, 0, DType::F32, &Device::Cpu)?.into_iter().collect();
    let model = Model::from_weights(&cfg, &w)?;
    let target = Decoder::new(&model)?;
    let mut drafts = Vec::new();
    for (weights, cache) in [
        (WeightPrecision::Bf16, KvPrecision::Bf16),
        (WeightPrecision::Int8, KvPrecision::Bf16),
        (WeightPrecision::Int8, KvPrecision::Int8),
    ] {
        let mut draft = Decoder::with_precision(&model, weights)?;
        draft.set_kv_precision(cache);
        drafts.push((format!("{weights:?} weights, {cache:?} cache"), draft));
    }
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 37) % cfg.vocab_size as u32).collect();
    let greedy = || Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
    let mut plain = Vec::new();
    // Per draft and drafts per pass: the seconds of each timed run, and the acceptance.
    let mut runs = vec![vec![Vec::new(); DRAFTS_PER_PASS.len()]; drafts.len()];
    let mut acceptance = vec![vec![0.0; DRAFTS_PER_PASS.len()]; drafts.len()];
    for round in 0..rounds {
        let t0 = Instant::now();
        let want = generate_fused(&target, &prompt, NEW_TOKENS, &mut greedy()?, |_| Ok(()))?;
        let secs = t0.elapsed().as_secs_f64();
        if round > 0 {
            plain.push(secs);
        }
        for (d, (_, draft)) in drafts.iter().enumerate() {
            for (j, &k) in DRAFTS_PER_PASS.iter().enumerate() {
                let t0 = Instant::now();
                let (out, stats) =
                    generate_speculative(&target, draft, &prompt, NEW_TOKENS, k, &mut greedy()?, |_| Ok(()))?;
                let secs = t0.elapsed().as_secs_f64();
                anyhow::ensure!(out == want, "speculative decoding chose other tokens than plain decoding");
                if round > 0 {
                    runs[d][j].push(secs);
                }
                acceptance[d][j] = stats.acceptance();
            }
        }
    }
    let plain = median(&mut plain);
    println!("{family}, bench-s: plain f32 {:.0} tokens/s", NEW_TOKENS as f64 / plain);
    for (d, (name, _)) in drafts.iter().enumerate() {
        for (j, &k) in DRAFTS_PER_PASS.iter().enumerate() {
            let secs = median(&mut runs[d][j]);
            println!(
                "draft {name}, {k} per pass: {:.0} tokens/s, {:.2}x plain, {:.1}% kept",
                NEW_TOKENS as f64 / secs,
                plain / secs,
                100.0 * acceptance[d][j]
            );
        }
    }
    Ok(())
}
