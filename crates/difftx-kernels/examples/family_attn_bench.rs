//! The three families' attention kernels at bench-s training shapes (B 8, T 256, d 32), forward
//! and backward, timed in alternation: `family_attn_bench [ROUNDS [FAMILY [PRODUCTS]]]` (FAMILY:
//! only that one, `all` for the three; PRODUCTS `f32` or `bf16`: only those tiles; for a profiler).
//! baseline: `flash_attention`, 8 query heads over 8 kv heads; diff-v1: `diff_attention`, 8
//! query heads over 8 kv heads (4 pairs, values 2d wide); diff-v2: `diff_v2_attention`, 16 query
//! heads over 4 kv heads. Times are the kernels' own (`profile::attention_time`: inside the ops,
//! not candle's autograd around them). Prints one JSON line per family with the median
//! milliseconds of one layer's forward and backward over the rounds and the model GFLOP/s
//! (causal score and value products; the backward counted as 2× the forward's arithmetic) for
//! comparing kernels; not a test. Every family runs with both tile products, f32 and bf16
//! (`TileProducts`; bf16 emulated by rounded copies where the CPU lacks AVX512_BF16), one line
//! each.
//!
//! The rounds run on a thread of rayon's pool, as training's steps do (`difftx_train::on_pool`):
//! called from outside it, each kernel handed its tasks to workers that had often gone to sleep
//! since the last call, and on a 2-core virtual machine the forward then ran on one of them for
//! whole calls (alternately ~5 and ~10 ms for diff-v2's f32 forward on the Zen 4 of
//! docs/design.md §7.47).

use candle_core::{Device, Result, Tensor, Var};
use difftx_kernels::profile::{attention_time, Pass};
use difftx_kernels::{diff_attention, diff_v2_attention, flash_attention, PairLayout, TileProducts};

#[path = "common/args.rs"]
mod args;

const USAGE: &str = "family_attn_bench [ROUNDS [baseline|diff-v1|diff-v2|all [f32|bf16]]]";

// The CLI's allocator: with the system one, every round's fresh gradient buffers are new pages
// whose first touch is counted inside the kernels (docs/design.md §7.2).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const B: usize = 8;
const T: usize = 256;
const D: usize = 32;

struct Case {
    name: &'static str,
    hq: usize,
    hk: usize,
}

/// One forward and backward: the milliseconds inside the forward and the backward kernels.
fn run(case: &Case, products: TileProducts) -> Result<(f64, f64)> {
    let dev = Device::Cpu;
    let scale = 1.0 / (D as f64).sqrt();
    let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (B, case.hq, T, D), &dev)?)?;
    let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (B, case.hk, T, D), &dev)?)?;
    let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (B, case.hk, T, D), &dev)?)?;
    let lambda_v1 = Var::from_tensor(&Tensor::new(&[0.3f32], &dev)?)?;
    let lambda_v2 = Var::from_tensor(&(Tensor::rand(0f32, 1.0, (B, case.hq / 2, T), &dev)?))?;
    let (f0, b0) = (attention_time(Pass::Forward), attention_time(Pass::Backward));
    let o = match case.name {
        "baseline" => flash_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, 0, products)?,
        "diff-v1" => diff_attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            lambda_v1.as_tensor(),
            PairLayout::Halves,
            scale,
            0,
            products,
        )?,
        _ => diff_v2_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), lambda_v2.as_tensor(), scale, 0, products)?,
    };
    std::hint::black_box(o.sum_all()?.backward()?);
    let ms = |pass, before| (attention_time(pass) - before).as_secs_f64() * 1e3;
    Ok((ms(Pass::Forward, f0), ms(Pass::Backward, b0)))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    rayon::scope(|_| bench())
}

fn bench() -> Result<()> {
    let rounds: usize = std::env::args().nth(1).map_or(Ok(20), |r| args::parse(&r, "ROUNDS", USAGE))?;
    let only = std::env::args().nth(2).filter(|f| f != "all");
    let products: Vec<TileProducts> = match std::env::args().nth(3).as_deref() {
        None => vec![TileProducts::Native, TileProducts::Bf16],
        Some("f32") => vec![TileProducts::Native],
        Some("bf16") => vec![TileProducts::Bf16],
        Some(other) => {
            return Err(candle_core::Error::Msg(format!("unknown PRODUCTS {other:?}\nusage: {USAGE}")));
        }
    };
    let cases: Vec<Case> = [
        Case { name: "baseline", hq: 8, hk: 8 },
        Case { name: "diff-v1", hq: 8, hk: 8 },
        Case { name: "diff-v2", hq: 16, hk: 4 },
    ]
    .into_iter()
    .filter(|c| only.as_deref().is_none_or(|f| f == c.name))
    .collect();
    if cases.is_empty() {
        // only a family name that matches no case leaves none
        return Err(candle_core::Error::Msg(format!("unknown family {:?}\nusage: {USAGE}", only.unwrap_or_default())));
    }
    let runs: Vec<(&Case, TileProducts)> = cases.iter().flat_map(|c| products.iter().map(move |&p| (c, p))).collect();
    let mut fwd = vec![Vec::new(); runs.len()];
    let mut bwd = vec![Vec::new(); runs.len()];
    for round in 0..rounds + 2 {
        for (i, &(case, products)) in runs.iter().enumerate() {
            let (f, b) = run(case, products)?;
            if round >= 2 {
                fwd[i].push(f);
                bwd[i].push(b);
            }
        }
    }
    for (i, &(case, products)) in runs.iter().enumerate() {
        // Scores and values, causal (half the T² pairs), per query head; diff-v1's value is 2d.
        let value_width = if case.name == "diff-v1" { 2 } else { 1 };
        let gflop = (B * case.hq * T * T / 2 * D * 2 * (1 + value_width)) as f64 / 1e9;
        let (f, b) = (median(fwd[i].clone()), median(bwd[i].clone()));
        println!(
            "{{\"family\":\"{}\",\"products\":\"{}\",\"forward_ms\":{f:.3},\"backward_ms\":{b:.3},\"forward_gflops\":{:.1},\"backward_gflops\":{:.1}}}",
            case.name,
            if products == TileProducts::Bf16 { "bf16" } else { "f32" },
            gflop / f * 1e3,
            2.0 * gflop / b * 1e3,
        );
    }
    Ok(())
}
