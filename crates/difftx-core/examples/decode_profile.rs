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

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let family: Family = std::env::args().nth(1).unwrap_or("diff-v1".into()).parse().map_err(anyhow::Error::msg)?;
    let batch: usize = std::env::args().nth(2).map_or(Ok(1), |s| s.parse())?;
    let precision: WeightPrecision =
        std::env::args().nth(3).map_or(Ok(WeightPrecision::F32), |s| s.parse()).map_err(anyhow::Error::msg)?;
    let kv: KvPrecision =
        std::env::args().nth(4).map_or(Ok(KvPrecision::F32), |s| s.parse()).map_err(anyhow::Error::msg)?;
    let prompt: usize = std::env::args().nth(5).map_or(Ok(16), |s| s.parse())?;
    let preset = std::env::args().nth(6).unwrap_or("bench-s".into());
    let rounds: usize = std::env::args().nth(7).map_or(Ok(4), |s| s.parse())?;
    anyhow::ensure!(rounds > 0, "ROUNDS must be at least 1");
    let cfg = ModelConfig::preset(&preset, family)?;
    anyhow::ensure!((1..cfg.max_seq_len).contains(&prompt), "the prompt must leave room for a step");
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
