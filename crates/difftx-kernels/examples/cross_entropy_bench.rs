//! Cross-entropy benchmark: the fused `cross_entropy` against candle-nn's composed loss
//! (log-softmax, gather, mean), forward + backward, measured side by side in one process.
//!
//! Usage: `cargo run --release -p difftx-kernels --example cross_entropy_bench [-- ROWS:VOCAB ...]`
//! (default: 2048:256, bench-s's batch of 8 × 256 over the byte vocabulary, and 2048:32000, a
//! BPE vocabulary). Prints one JSON document: median milliseconds per forward + backward of
//! each path and their ratio, interleaved over repetitions so that machine noise hits both.
//!
//! Runs on a thread of rayon's pool, as training's steps do (`difftx_train::on_pool`; from
//! outside it every call would wait for a sleeping worker to wake, docs/design.md §7.47).

use candle_core::{Device, Result, Tensor, Var};
use std::time::Instant;

#[path = "common/args.rs"]
mod args;

const USAGE: &str = "cross_entropy_bench [ROWS:VOCAB ...]";

fn step(fused: bool, x: &Var, t: &Tensor) -> Result<f64> {
    let t0 = Instant::now();
    let loss = if fused {
        difftx_kernels::cross_entropy(x.as_tensor(), t)?
    } else {
        candle_nn::loss::cross_entropy(x.as_tensor(), t)?
    };
    let grads = loss.backward()?;
    std::hint::black_box(grads.get(x.as_tensor()).map(|g| g.dims().to_vec()));
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    rayon::scope(|_| bench())
}

fn bench() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shapes: Vec<(usize, usize)> = if args.is_empty() {
        vec![(2048, 256), (2048, 32000)]
    } else {
        args.iter().map(|a| args::numbers(a, 2, "ROWS:VOCAB", USAGE).map(|v| (v[0], v[1]))).collect::<Result<_>>()?
    };
    let mut rows_out = Vec::new();
    for (rows, vocab) in shapes {
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (rows, vocab), &Device::Cpu)?)?;
        let t: Vec<u32> = (0..rows).map(|i| (i * 7 % vocab) as u32).collect();
        let t = Tensor::from_vec(t, rows, &Device::Cpu)?;
        let reps = if vocab > 10_000 { 10 } else { 40 };
        let (mut fused, mut composed) = (Vec::new(), Vec::new());
        step(true, &x, &t)?;
        step(false, &x, &t)?;
        for _ in 0..reps {
            fused.push(step(true, &x, &t)?);
            composed.push(step(false, &x, &t)?);
        }
        let (f, c) = (median(fused), median(composed));
        rows_out.push(format!(
            "{{\"rows\": {rows}, \"vocab\": {vocab}, \"fused_ms\": {f:.3}, \"candle_nn_ms\": {c:.3}, \"speedup\": {:.2}}}",
            c / f
        ));
    }
    println!(
        "{{\"bench\": \"cross_entropy forward+backward, f32\", \"threads\": {}, \"shapes\": [{}]}}",
        rayon::current_num_threads(),
        rows_out.join(", ")
    );
    Ok(())
}
