//! The sampler's own cost per token: `Sampler::sample` on fixed pseudo-random logits at three
//! vocabulary sizes (the byte vocabulary, 32,000 and 128,256 tokens), temperature 0.8 alone, with
//! top-k 40 and with top-p 0.9. Prints one JSON line per case (microseconds per token); not a
//! test. `cargo run --release -p difftx-core --example sampler_cost [-- CASE]` (docs/design.md
//! §7.32, §7.33); CASE keeps the cases whose name starts with it.

use difftx_core::generate::{Sampler, SamplingParams};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    // An optional argument keeps the cases whose name starts with it (for perf).
    let only = std::env::args().nth(1).unwrap_or_default();
    const CASES: [(&str, Option<usize>, Option<f64>); 3] =
        [("temperature", None, None), ("top_k_40", Some(40), None), ("top_p_0.9", None, Some(0.9))];
    if !CASES.iter().any(|(case, ..)| case.starts_with(&only)) {
        let names: Vec<&str> = CASES.iter().map(|(case, ..)| *case).collect();
        anyhow::bail!("no case starts with {only:?}; the cases are {}", names.join(", "));
    }
    for vocab in [256usize, 32_000, 128_256] {
        // Spread, unrepeated values, as a model's logits are.
        let logits: Vec<f32> =
            (0..vocab).map(|i| (((i as f64 * 12.9898).sin() * 43758.5453).fract() * 8.0) as f32).collect();
        let draws = if vocab > 1000 { 200 } else { 20_000 };
        for (case, top_k, top_p) in CASES {
            if !case.starts_with(&only) {
                continue;
            }
            let mut sampler = Sampler::new(SamplingParams { temperature: 0.8, top_k, top_p, seed: 1 })?;
            let t0 = Instant::now();
            let checksum: u64 = (0..draws).map(|_| sampler.sample(&logits) as u64).sum();
            let us = t0.elapsed().as_secs_f64() / draws as f64 * 1e6;
            println!("{{\"vocab\":{vocab},\"case\":\"{case}\",\"us_per_token\":{us:.1},\"checksum\":{checksum}}}");
        }
    }
    Ok(())
}
