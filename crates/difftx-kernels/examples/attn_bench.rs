//! Attention benchmark: fused `flash_attention` vs naive composed candle ops.
//!
//! Usage: `cargo run --profile test -p difftx-kernels --example attn_bench [-- CONFIGS]`
//! Without arguments it runs a default set of configurations, each in its own child process so
//! that the peak RSS (VmHWM) of one does not leak into the next, and prints one JSON document.
//! A child is `attn_bench one MODE N [REPS [B]]` with MODE in `flash`, `flash_bwd`, `naive`,
//! `naive_bwd`, `decode` (T = 1 against a cache of N); a config argument is `MODE:N[:REPS[:B]]`.
//! Shapes: B = 1 unless given, Hq = Hk = 8, d = 32 (D = 256), f32, scale d^-0.5.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use difftx_kernels::{flash_attention, TileProducts};
use std::time::Instant;

#[path = "common/args.rs"]
mod args;

const USAGE: &str = "attn_bench [MODE:N[:REPS[:B]] ...] | attn_bench one MODE N [REPS [B]]";

const H: usize = 8;
const DH: usize = 32;

fn rss_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, _, t, _) = q.dims4()?;
    let s = k.dim(2)?;
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let mask: Vec<f32> =
        (0..t).flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(mask, (t, s), q.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let m = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(v)
}

fn one(mode: &str, n: usize, reps: usize, b: usize) -> Result<String> {
    let dev = Device::Cpu;
    let scale = 1.0 / (DH as f64).sqrt();
    let t = if mode == "decode" { 1 } else { n };
    let q = Tensor::randn(0f32, 1.0, (b, H, t, DH), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (b, H, n, DH), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (b, H, n, DH), &dev)?;
    let rss_inputs = rss_kib("VmRSS:");
    let mut times = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        match mode {
            "flash" => {
                let o = flash_attention(&q, &k, &v, scale, 0, TileProducts::Native)?;
                std::hint::black_box(o);
            }
            "decode" => {
                let o = flash_attention(&q, &k, &v, scale, n - 1, TileProducts::Native)?;
                std::hint::black_box(o);
            }
            "naive" => {
                let o = naive(&q, &k, &v, scale)?;
                std::hint::black_box(o);
            }
            "flash_bwd" => {
                let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                let o =
                    flash_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, 0, TileProducts::Native)?;
                let g = o.sum_all()?.backward()?;
                std::hint::black_box(g);
            }
            "naive_bwd" => {
                let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                let o = naive(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale)?;
                let g = o.sum_all()?.backward()?;
                std::hint::black_box(g);
            }
            m => candle_core::bail!("unknown mode {m}"),
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    let best = times.iter().cloned().fold(f64::INFINITY, f64::min);
    let _ = DType::F32;
    Ok(format!(
        "{{\"mode\":\"{mode}\",\"n\":{n},\"t\":{t},\"b\":{b},\"heads\":{H},\"d_head\":{DH},\"reps\":{reps},\"best_s\":{best:.6},\"times_s\":{times:?},\"tokens_per_s\":{:.1},\"rss_inputs_mib\":{:.1},\"peak_rss_mib\":{:.1}}}",
        (b * t) as f64 / best,
        rss_inputs as f64 / 1024.0,
        rss_kib("VmHWM:") as f64 / 1024.0
    ))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() >= 4 && args[1] == "one" {
        let n: usize = args::parse(&args[3], "N", USAGE)?;
        if n == 0 {
            return Err(candle_core::Error::Msg(format!("N must be at least 1\nusage: {USAGE}")));
        }
        let reps: usize = args.get(4).map_or(Ok(3), |r| args::parse(r, "REPS", USAGE))?;
        let b: usize = args.get(5).map_or(Ok(1), |r| args::parse(r, "B", USAGE))?;
        println!("{}", one(&args[2], n, reps, b)?);
        return Ok(());
    }
    let configs: Vec<(String, usize, usize, usize)> = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|c| {
                let p: Vec<&str> = c.split(':').collect();
                if !(2..=4).contains(&p.len()) {
                    return Err(candle_core::Error::Msg(format!(
                        "expected MODE:N[:REPS[:B]], got {c:?}\nusage: {USAGE}"
                    )));
                }
                Ok((
                    p[0].to_string(),
                    args::parse(p[1], "N", USAGE)?,
                    p.get(2).map_or(Ok(3), |r| args::parse(r, "REPS", USAGE))?,
                    p.get(3).map_or(Ok(1), |r| args::parse(r, "B", USAGE))?,
                ))
            })
            .collect::<Result<_>>()?
    } else {
        vec![
            ("naive".into(), 4096, 3, 1),
            ("flash".into(), 4096, 3, 1),
            ("flash".into(), 16384, 1, 1),
            ("naive_bwd".into(), 4096, 1, 1),
            ("flash_bwd".into(), 4096, 1, 1),
            ("decode".into(), 4096, 20, 1),
            ("decode".into(), 16384, 10, 1),
            // bench-s training shape (docs/design.md §4.3): B 8, T 256
            ("naive_bwd".into(), 256, 5, 8),
            ("flash_bwd".into(), 256, 5, 8),
        ]
    };
    let exe = std::env::current_exe().map_err(|e| candle_core::Error::Msg(format!("this example's path: {e}")))?;
    let mut results = Vec::new();
    for (mode, n, reps, b) in configs {
        let out = std::process::Command::new(&exe)
            .args(["one", &mode, &n.to_string(), &reps.to_string(), &b.to_string()])
            .output()
            .map_err(|e| candle_core::Error::Msg(format!("starting the child for {mode}:{n}: {e}")))?;
        let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !line.is_empty() {
            eprintln!("{line}");
            results.push(line);
        } else {
            let err = String::from_utf8_lossy(&out.stderr).replace('"', "'");
            results.push(format!("{{\"mode\":\"{mode}\",\"n\":{n},\"error\":\"{}\"}}", err.trim().replace('\n', " ")));
        }
    }
    println!(
        "{{\"bench\":\"attn\",\"threads\":{},\"results\":[\n  {}\n]}}",
        rayon::current_num_threads(),
        results.join(",\n  ")
    );
    Ok(())
}
