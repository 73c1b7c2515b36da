//! Times the fused decoder's steps: `decode_profile FAMILY BATCH [f32|bf16|int8]
//! [f32|bf16|int8] [PROMPT] [PRESET] [ROUNDS]` (the weights' precision, the KV cache's, the
//! prompt's length, 16 by default, the model preset, bench-s by default, and how many times the
//! sequences are prefilled and decoded to the model's context, 4 by default: more for perf). Allocates through mimalloc, as the `difftx` binary does (under glibc's
//! malloc, allocation was ~8% of the caller's perf samples at batch 1); run it with
//! `MIMALLOC_PURGE_DELAY=-1` to match the CLI's setting (docs/design.md §7.2).
use candle_core::{DType, Device, Tensor};
use difftx_core::model::{init_weights, Model};
use difftx_core::{Decoder, Family, KvPrecision, ModelConfig, WeightPrecision};
use std::collections::HashMap;
use std::fmt::Display;
use std::str::FromStr;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../../difftx-kernels/examples/common/args.rs"]
mod args;

const USAGE: &str = "decode_profile FAMILY BATCH [f32|bf16|int8] [f32|bf16|int8] [PROMPT] [PRESET] [ROUNDS]";

/// Command-line argument `n` parsed as a `T` ([`args::parse`]), `default` when absent.
fn arg<T: FromStr>(n: usize, name: &str, default: T) -> candle_core::Result<T>
where
    T::Err: Display,
{
    std::env::args().nth(n).map_or(Ok(default), |text| args::parse(&text, name, USAGE))
}

fn main() -> anyhow::Result<()> {
    let family: Family = arg(1, "FAMILY", Family::DiffV1)?;
    let batch: usize = arg(2, "BATCH", 1)?;
    let precision: WeightPrecision = arg(3, "weight precision", WeightPrecision::F32)?;
    let kv: KvPrecision = arg(4, "KV cache precision", KvPrecision::F32)?;
    let prompt: usize = arg(5, "PROMPT", 16)?;
    let preset: String = arg(6, "PRESET", "bench-s".into())?;
    let rounds: usize = arg(7, "ROUNDS", 4)?;
    anyhow::ensure!(batch > 0 && rounds > 0, "BATCH and ROUNDS must be at least 1\nusage: {USAGE}");
    let cfg = ModelConfig::preset(&preset, family)?;
    anyhow::ensure!(
        (1..cfg.max_seq_len).contains(&prompt),
        "PROMPT must be 1 to {} on {preset}: at least one token, and room for a step",
        cfg.max_seq_len - 1
    );
    let w: HashMap<String, Tensor> = init_weights(&cfg, 0, DType::F32, &Device::Cpu)?.into_iter().collect();
    let m = Model::from_weights(&cfg, &w)?;
    let mut dec = Decoder::with_precision(&m, precision)?;
    dec.set_kv_precision(kv);
    let mut seqs: Vec<_> = (0..batch).map(|_| dec.new_sequence()).collect();
    let steps = cfg.max_seq_len - prompt;
    let mut secs = 0.0;
    for _ in 0..rounds {
        for s in seqs.iter_mut() {
            dec.prefill(s, &(0..prompt as u32).collect::<Vec<u32>>())?;
        }
        let mut toks = vec![5u32; batch];
        let t0 = std::time::Instant::now();
        for _ in 0..steps {
            let mut refs: Vec<_> = seqs.iter_mut().collect();
            let logits = dec.step(&mut refs, &toks)?;
            toks = logits
                .chunks(cfg.vocab_size)
                .map(|r| (0..r.len()).fold(0, |best, i| if r[i] > r[best] { i } else { best }) as u32)
                .collect();
        }
        secs += t0.elapsed().as_secs_f64();
    }
    let n = (rounds * steps) as f64;
    println!(
        "{family} {precision:?} weights, {kv:?} cache, batch {batch}: {:.1} tok/s, {:.3} ms/step",
        n * batch as f64 / secs,
        secs / n * 1e3
    );
    Ok(())
}
