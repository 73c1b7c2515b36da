//! What the caches of this machine hold, for batched decode (docs/design.md §7.24): read
//! bandwidth of a buffer read over and over on every thread, by buffer size (where the last-level
//! cache's share of this process ends), then one decode row's attention (`softmax_scores` and
//! `weighted_values`, bf16 keys and values of bench-s heads) over many sequences' caches, one
//! thread, by their total size. Prints one JSON document. The reading loop is plain code (the
//! crate is built for baseline x86-64), so its cache rates are a floor; where they fall, and the
//! memory's rate, are what it is for.
//!
//! Usage: `cargo run --release -p difftx-kernels --example cache_probe [-- POSITIONS]`
//! (cached positions per sequence, default 136: bench-s's mean over a 16-token prompt and 240
//! generated tokens).

use difftx_kernels::decode::{softmax_scores, weighted_values, Bf16, HeadCache, KV_CHUNK};
use std::hint::black_box;
use std::time::Instant;

#[path = "common/args.rs"]
mod args;

const USAGE: &str = "cache_probe [POSITIONS]";

/// GB/s of reading `mib` MiB of f32, split over `threads` threads, about 2 GiB in all.
fn read_bandwidth(mib: usize, threads: usize) -> f64 {
    let data = vec![1f32; mib << 18];
    let passes = (2048 / mib).max(2);
    let part = data.len() / threads;
    // 64 sums side by side, so that the adds' latency does not bound the reads. One untimed
    // pass brings the buffer into whatever cache holds it.
    let sum = |s: &[f32]| {
        s.chunks_exact(64).fold([0f32; 64], |mut acc, c| {
            acc.iter_mut().zip(c).for_each(|(a, v)| *a += v);
            acc
        })
    };
    black_box(sum(&data));
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            let slice = &data[t * part..(t + 1) * part];
            scope.spawn(move || {
                for _ in 0..passes {
                    black_box(sum(black_box(slice)));
                }
            });
        }
    });
    (mib * passes) as f64 * 1.048_576e6 / start.elapsed().as_secs_f64() / 1e9
}

fn main() -> candle_core::Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let len: usize = match argv.first() {
        Some(s) => args::parse(s, "POSITIONS", USAGE)?,
        None => 136,
    };
    if len == 0 {
        return Err(candle_core::Error::Msg(format!("POSITIONS must be at least 1\nusage: {USAGE}")));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sizes = [2usize, 4, 8, 12, 16, 20, 24, 32, 64, 256];
    let bandwidth: Vec<String> = sizes
        .iter()
        .map(|&mib| format!("{{\"mib\": {mib}, \"gb_per_s\": {:.1}}}", read_bandwidth(mib, threads)))
        .collect();

    // bench-s: 8 kv heads of 32 features; a layer's cache of one sequence holds every head.
    let (d, heads) = (32, 8);
    let stride = heads * d * KV_CHUNK;
    let chunks = len.div_ceil(KV_CHUNK);
    let q: Vec<f32> = (0..d).map(|i| i as f32 * 0.1).collect();
    let mut attention = Vec::new();
    // Caches of (sequences × layers): 1 sequence's 6 layers up to 32 sequences'.
    for caches in [6usize, 24, 48, 72, 96, 144, 192] {
        let layer = |seed: usize| -> Vec<Bf16> {
            (0..chunks * stride).map(|i| Bf16::from_f32(((i + seed) % 97) as f32 * 0.01 - 0.4)).collect()
        };
        let kv: Vec<(Vec<Bf16>, Vec<Bf16>)> = (0..caches).map(|c| (layer(c), layer(3 * c + 1))).collect();
        let mb = (caches * 2 * chunks * stride * 2) as f64 / 1e6;
        let (mut p, mut out) = (vec![0f32; len], vec![0f32; d]);
        let visits = (2_000_000 / (caches * heads * len)).max(3);
        let mut run = || {
            for (keys, values) in &kv {
                for h in 0..heads {
                    let at = h * d * KV_CHUNK;
                    softmax_scores(&q, HeadCache::unscaled(&keys[at..], stride), 0.18, &mut p);
                    weighted_values(&p, HeadCache::unscaled(&values[at..], stride), &mut out);
                }
            }
        };
        run();
        let start = Instant::now();
        for _ in 0..visits {
            run();
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / (visits * caches * heads) as f64;
        black_box(&out);
        let read = (2 * len * d * 2) as f64; // bytes of one head's keys and values
        attention.push(format!("{{\"caches_mb\": {mb:.1}, \"ns_per_head\": {ns:.0}, \"gb_per_s\": {:.1}}}", read / ns));
    }
    println!(
        "{{\"threads\": {threads}, \"read_bandwidth\": [{}],\n \"attention_one_thread\": {{\"positions\": {len}, \"head_dim\": {d}, \"by_size\": [{}]}}}}",
        bandwidth.join(", "),
        attention.join(", ")
    );
    Ok(())
}
