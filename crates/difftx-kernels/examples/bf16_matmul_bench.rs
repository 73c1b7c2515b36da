//! bf16 matrix-product benchmark: candle's f32 matmul (gemm) against the bf16 kernels of
//! `difftx_kernels::bf16_matmul` (packing included), on the products of one linear layer's
//! training step: forward y = x·wᵀ, dx = dy·w and dw = dyᵀ·x, measured side by side in one
//! process and interleaved over repetitions so that machine noise hits every path.
//!
//! Usage: `cargo run --release -p difftx-kernels --example bf16_matmul_bench [-- TOKENS:IN:OUT ...]`
//! (default: bench-s's projections at 2048 tokens: 256→256, 256→704, 704→256). Prints one JSON
//! document: median milliseconds and GFLOP/s per path; backends this CPU lacks are left out.
//!
//! Runs on a thread of rayon's pool, as training's steps do (`difftx_train::on_pool`; from
//! outside it every product would wait for a sleeping worker to wake, docs/design.md §7.47).

use candle_core::{Device, Result, Tensor};
use difftx_kernels::bf16_matmul::{bf16_backend_available, matmul_into, Bf16Backend, MatRef};
use std::time::Instant;

#[path = "common/args.rs"]
mod args;

const USAGE: &str = "bf16_matmul_bench [TOKENS:IN:OUT ...]";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The f32 view of a 2-d tensor (any strides).
fn view(t: &Tensor) -> (Vec<f32>, usize, usize, usize, usize) {
    let (r, c) = t.dims2().unwrap();
    let st = t.stride();
    let (rs, cs) = (st[0], st[1]);
    // Keep the strides: copy the underlying storage of the base tensor in its own layout.
    let base = if rs >= cs { t.contiguous().unwrap() } else { t.t().unwrap().contiguous().unwrap() };
    let data = base.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    if rs >= cs {
        (data, r, c, c, 1)
    } else {
        (data, r, c, 1, r)
    }
}

fn main() -> Result<()> {
    rayon::scope(|_| bench())
}

fn bench() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shapes: Vec<(usize, usize, usize)> = if args.is_empty() {
        vec![(2048, 256, 256), (2048, 256, 704), (2048, 704, 256)]
    } else {
        args.iter()
            .map(|a| args::numbers(a, 3, "TOKENS:IN:OUT", USAGE).map(|v| (v[0], v[1], v[2])))
            .collect::<Result<_>>()?
    };
    let backends: Vec<Bf16Backend> =
        [Bf16Backend::Amx, Bf16Backend::Avx512Bf16].into_iter().filter(|&b| bf16_backend_available(b)).collect();
    let dev = Device::Cpu;
    let mut out = Vec::new();
    for (tokens, din, dout) in shapes {
        let x = Tensor::randn(0f32, 1.0, (tokens, din), &dev)?;
        let w = Tensor::randn(0f32, 0.05, (dout, din), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (tokens, dout), &dev)?;
        // (name, A, B) of the three products of a linear layer's step.
        let products = [("forward", x.clone(), w.t()?), ("dx", dy.clone(), w.clone()), ("dw", dy.t()?, x.clone())];
        for (name, a, b) in products {
            let (m, k) = a.dims2()?;
            let n = b.dims2()?.1;
            let flop = 2.0 * (m * k * n) as f64;
            let (ad, _, _, ars, acs) = view(&a);
            let (bd, _, _, brs, bcs) = view(&b);
            let av = MatRef { data: &ad, rows: m, cols: k, rs: ars, cs: acs };
            let bv = MatRef { data: &bd, rows: k, cols: n, rs: brs, cs: bcs };
            let mut c = vec![0f32; m * n];
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); 1 + backends.len()];
            for rep in 0..31 {
                let t0 = Instant::now();
                std::hint::black_box(a.matmul(&b)?);
                let f32_ms = t0.elapsed().as_secs_f64() * 1e3;
                let mut bf = Vec::new();
                for &be in &backends {
                    let t0 = Instant::now();
                    matmul_into(be, av, bv, &mut c).map_err(candle_core::Error::Msg)?;
                    bf.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                if rep > 0 {
                    times[0].push(f32_ms);
                    for (i, t) in bf.into_iter().enumerate() {
                        times[1 + i].push(t);
                    }
                }
            }
            let mut fields = vec![format!("\"product\": \"{name}\", \"m\": {m}, \"k\": {k}, \"n\": {n}")];
            let labels: Vec<String> = std::iter::once("f32_candle".to_string())
                .chain(backends.iter().map(|b| format!("bf16_{b:?}")))
                .collect();
            let f32_ms = median(times[0].clone());
            for (label, t) in labels.iter().zip(times) {
                let ms = median(t);
                fields.push(format!(
                    "\"{label}\": {{\"ms\": {ms:.3}, \"gflops\": {:.1}, \"speedup_vs_f32\": {:.2}}}",
                    flop / ms / 1e6,
                    f32_ms / ms
                ));
            }
            out.push(format!("{{{}}}", fields.join(", ")));
        }
    }
    println!("{{\"threads\": {}, \"products\": [\n  {}\n]}}", rayon::current_num_threads(), out.join(",\n  "));
    Ok(())
}
