//! diff_attention and diff_v2_attention (diff-v1's and diff-v2's attention with the combination
//! inside) against the compositions of pair_values, flash_attention and diff_combine_pairs, and
//! against f64 finite differences.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::{finite_diff, flat, max_rel_vec, rand_t, rel_err};
use difftx_kernels::{PairLayout, TileProducts};

/// The composition the op replaces.
fn composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    l: &Tensor,
    layout: PairLayout,
    scale: f64,
    off: usize,
) -> Result<Tensor> {
    let v2 = difftx_kernels::pair_values(v, layout)?;
    let o = difftx_kernels::flash_attention(q, k, &v2, scale, off, TileProducts::Native)?;
    difftx_kernels::diff_combine_pairs(&o, l, layout)
}

/// An attention of `(q, k, v, λ)`, fused or composed.
type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// `fused` against `composed`: the output, and every input's gradient of `Σ w ∘ z`, within `tol`
/// (relative).
fn check_against_composition(
    fused: Attn,
    composed: Attn,
    x: [&Var; 4],
    w: &Tensor,
    tol: f64,
    what: &str,
) -> Result<()> {
    let [q, k, v, l] = x.map(|x| x.as_tensor());
    let zf = fused(q, k, v, l)?;
    let zr = composed(q, k, v, l)?;
    assert_eq!(zf.dims(), zr.dims(), "{what}");
    let e = rel_err(&zf, &zr);
    assert!(e < tol, "{what}: forward {e}");
    let gf = (&zf * w)?.sum_all()?.backward()?;
    let gr = (&zr * w)?.sum_all()?.backward()?;
    for (name, x) in ["q", "k", "v", "lambda"].into_iter().zip(x) {
        let e = rel_err(gf.get(x.as_tensor()).unwrap(), gr.get(x.as_tensor()).unwrap());
        assert!(e < tol, "{what}: d{name} {e}");
    }
    Ok(())
}

/// `op`'s gradients of `Σ w ∘ z²` (f64) against central finite differences, within 1e-6.
fn check_finite_differences(op: Attn, x0: [&Tensor; 4], w: &Tensor, what: &str) -> Result<()> {
    let [q0, k0, v0, l0] = x0;
    let loss = |q: &Tensor, k: &Tensor, v: &Tensor, l: &Tensor| -> Result<f64> {
        (op(q, k, v, l)?.sqr()? * w)?.sum_all()?.to_scalar::<f64>()
    };
    let [q, k, v, l] = [Var::from_tensor(q0)?, Var::from_tensor(k0)?, Var::from_tensor(v0)?, Var::from_tensor(l0)?];
    let z = op(q.as_tensor(), k.as_tensor(), v.as_tensor(), l.as_tensor())?;
    let g = (z.sqr()? * w)?.sum_all()?.backward()?;
    let checks = [
        ("q", flat(g.get(q.as_tensor()).unwrap()), finite_diff(q0, |x| loss(x, k0, v0, l0), 1e-6)?),
        ("k", flat(g.get(k.as_tensor()).unwrap()), finite_diff(k0, |x| loss(q0, x, v0, l0), 1e-6)?),
        ("v", flat(g.get(v.as_tensor()).unwrap()), finite_diff(v0, |x| loss(q0, k0, x, l0), 1e-6)?),
        ("lambda", flat(g.get(l.as_tensor()).unwrap()), finite_diff(l0, |x| loss(q0, k0, v0, x), 1e-6)?),
    ];
    for (name, an, nu) in checks {
        let e = max_rel_vec(&an, &nu);
        assert!(e < 1e-6, "{what}: d{name} {e}");
    }
    Ok(())
}

/// (B, Hq, Hk, T, S, dk, dv, q_offset, layout)
type Case = (usize, usize, usize, usize, usize, usize, usize, usize, PairLayout);

const CASES: [Case; 8] = [
    (2, 4, 4, 77, 77, 8, 8, 0, PairLayout::Interleaved), // T not a multiple of the tile
    (1, 8, 4, 150, 150, 16, 16, 0, PairLayout::Halves),  // GQA 2, two key tiles
    (1, 12, 4, 65, 65, 8, 12, 0, PairLayout::Halves),    // GQA 3, dv != dk
    (2, 4, 2, 37, 100, 5, 7, 63, PairLayout::Halves),    // KV offset, odd head dims
    (1, 4, 4, 1, 70, 8, 8, 69, PairLayout::Interleaved), // one row against a cache
    (1, 2, 2, 140, 290, 4, 4, 150, PairLayout::Interleaved), // offset not aligned to tiles
    (8, 4, 4, 40, 40, 8, 8, 0, PairLayout::Interleaved), // many (batch, kv pair) tasks: shared maps
    (8, 8, 4, 100, 100, 8, 8, 0, PairLayout::Halves),    // shared maps, a diagonal tile cut in two
];

#[test]
fn matches_the_composition_forward_and_backward() -> Result<()> {
    for (i, (b, hq, hk, t, s, dk, dv, off, layout)) in CASES.into_iter().enumerate() {
        let seed = 10 * i as u64;
        let scale = 1.0 / (dk as f64).sqrt();
        for dt in [DType::F64, DType::F32] {
            let q = Var::from_tensor(&rand_t(&[b, hq, t, dk], seed, 1.0, dt)?)?;
            let k = Var::from_tensor(&rand_t(&[b, hk, s, dk], seed + 1, 1.0, dt)?)?;
            let v = Var::from_tensor(&rand_t(&[b, hk, s, dv], seed + 2, 1.0, dt)?)?;
            let l = Var::from_tensor(&Tensor::new(&[0.6f64 - 0.1 * i as f64], &Device::Cpu)?.to_dtype(dt)?)?;
            let w = rand_t(&[b, hq / 2, t, 2 * dv], seed + 3, 1.0, dt)?;
            let what = format!("{dt:?} case {i} {layout:?}");
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
            check_against_composition(
                &|q, k, v, l| difftx_kernels::diff_attention(q, k, v, l, layout, scale, off, TileProducts::Native),
                &|q, k, v, l| composed(q, k, v, l, layout, scale, off),
                [&q, &k, &v, &l],
                &w,
                tol,
                &what,
            )?;
        }
    }
    Ok(())
}

#[test]
fn backward_matches_finite_differences_f64() -> Result<()> {
    for layout in [PairLayout::Interleaved, PairLayout::Halves] {
        let (b, hq, hk, t, dk, dv, off) = (1, 4, 2, 6, 3, 2, 2);
        let (hk, s) = if layout == PairLayout::Interleaved { (hq, t + off) } else { (hk, t + off) };
        let q0 = rand_t(&[b, hq, t, dk], 31, 1.0, DType::F64)?;
        let k0 = rand_t(&[b, hk, s, dk], 32, 1.0, DType::F64)?;
        let v0 = rand_t(&[b, hk, s, dv], 33, 1.0, DType::F64)?;
        let l0 = Tensor::new(&[0.45f64], &Device::Cpu)?;
        let w = rand_t(&[b, hq / 2, t, 2 * dv], 34, 1.0, DType::F64)?;
        check_finite_differences(
            &|q, k, v, l| difftx_kernels::diff_attention(q, k, v, l, layout, 0.5, off, TileProducts::Native),
            [&q0, &k0, &v0, &l0],
            &w,
            &format!("{layout:?}"),
        )?;
    }
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let q = rand_t(&[1, 4, 3, 4], 1, 1.0, DType::F32)?;
    let k = rand_t(&[1, 2, 3, 4], 2, 1.0, DType::F32)?;
    let v = rand_t(&[1, 2, 3, 4], 3, 1.0, DType::F32)?;
    let l = Tensor::new(&[0.5f32], &Device::Cpu)?;
    // interleaved pairs with GQA: query pair (0, 1) reads kv head 0 twice
    let e = difftx_kernels::diff_attention(&q, &k, &v, &l, PairLayout::Interleaved, 0.5, 0, TileProducts::Native)
        .unwrap_err();
    assert!(e.to_string().contains("not a pair"), "{e}");
    assert!(difftx_kernels::diff_attention(&q, &k, &v, &l, PairLayout::Halves, 0.5, 0, TileProducts::Native).is_ok());
    let odd = rand_t(&[1, 3, 3, 4], 4, 1.0, DType::F32)?;
    assert!(difftx_kernels::diff_attention(
        &odd,
        &odd,
        &odd.narrow(3, 0, 2)?,
        &l,
        PairLayout::Halves,
        0.5,
        0,
        TileProducts::Native
    )
    .is_err());
    let two = Tensor::new(&[0.5f32, 0.1], &Device::Cpu)?;
    assert!(difftx_kernels::diff_attention(&q, &k, &v, &two, PairLayout::Halves, 0.5, 0, TileProducts::Native).is_err());
    let l64 = Tensor::new(&[0.5f64], &Device::Cpu)?;
    assert!(difftx_kernels::diff_attention(&q, &k, &v, &l64, PairLayout::Halves, 0.5, 0, TileProducts::Native).is_err());
    assert!(difftx_kernels::diff_attention(
        &q,
        &k.narrow(3, 0, 3)?,
        &v,
        &l,
        PairLayout::Halves,
        0.5,
        0,
        TileProducts::Native
    )
    .is_err());
    Ok(())
}

/// diff-v2's composition: flash over all query heads, then pairs (2j, 2j+1) with a λ per position.
fn composed_v2(q: &Tensor, k: &Tensor, v: &Tensor, l: &Tensor, scale: f64, off: usize) -> Result<Tensor> {
    let o = difftx_kernels::flash_attention(q, k, v, scale, off, TileProducts::Native)?;
    difftx_kernels::diff_combine_pairs(&o, l, PairLayout::Interleaved)
}

/// (B, Hq, Hk, T, S, dk, dv, q_offset): every kv head serves an even number of query heads.
type CaseV2 = (usize, usize, usize, usize, usize, usize, usize, usize);

const CASES_V2: [CaseV2; 7] = [
    (2, 4, 2, 77, 77, 8, 8, 0),     // T not a multiple of the tile, one pair per kv head
    (1, 8, 2, 150, 150, 16, 16, 0), // two pairs per kv head, two key tiles
    (1, 12, 2, 65, 65, 8, 12, 0),   // three pairs per kv head, dv != dk
    (2, 4, 1, 37, 100, 5, 7, 63),   // KV offset, odd head dims
    (1, 4, 2, 1, 70, 8, 8, 69),     // one row against a cache
    (8, 16, 4, 40, 40, 8, 8, 0),    // bench-s's head layout, many tasks: shared maps
    (8, 8, 4, 100, 100, 8, 8, 0),   // shared maps, a diagonal tile cut in two
];

#[test]
fn v2_matches_the_composition_forward_and_backward() -> Result<()> {
    for (i, (b, hq, hk, t, s, dk, dv, off)) in CASES_V2.into_iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let scale = 1.0 / (dk as f64).sqrt();
        for dt in [DType::F64, DType::F32] {
            let q = Var::from_tensor(&rand_t(&[b, hq, t, dk], seed, 1.0, dt)?)?;
            let k = Var::from_tensor(&rand_t(&[b, hk, s, dk], seed + 1, 1.0, dt)?)?;
            let v = Var::from_tensor(&rand_t(&[b, hk, s, dv], seed + 2, 1.0, dt)?)?;
            // λ in (0, 1) like a sigmoid's, one per pair and position
            let l = Var::from_tensor(&((rand_t(&[b, hq / 2, t, 1], seed + 3, 1.0, dt)? * 0.4)? + 0.5)?)?;
            let w = rand_t(&[b, hq / 2, t, dv], seed + 4, 1.0, dt)?;
            let what = format!("{dt:?} v2 case {i}");
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
            check_against_composition(
                &|q, k, v, l| difftx_kernels::diff_v2_attention(q, k, v, l, scale, off, TileProducts::Native),
                &|q, k, v, l| composed_v2(q, k, v, l, scale, off),
                [&q, &k, &v, &l],
                &w,
                tol,
                &what,
            )?;
        }
    }
    Ok(())
}

#[test]
fn v2_backward_matches_finite_differences_f64() -> Result<()> {
    // two pairs over one kv head, then one pair per kv head; keys before the queries
    for (hq, hk) in [(4, 1), (4, 2)] {
        let (b, t, dk, dv, off) = (1, 6, 3, 2, 2);
        let s = t + off;
        let q0 = rand_t(&[b, hq, t, dk], 41, 1.0, DType::F64)?;
        let k0 = rand_t(&[b, hk, s, dk], 42, 1.0, DType::F64)?;
        let v0 = rand_t(&[b, hk, s, dv], 43, 1.0, DType::F64)?;
        let l0 = ((rand_t(&[b, hq / 2, t], 44, 1.0, DType::F64)? * 0.4)? + 0.5)?;
        let w = rand_t(&[b, hq / 2, t, dv], 45, 1.0, DType::F64)?;
        check_finite_differences(
            &|q, k, v, l| difftx_kernels::diff_v2_attention(q, k, v, l, 0.5, off, TileProducts::Native),
            [&q0, &k0, &v0, &l0],
            &w,
            &format!("Hq {hq} Hk {hk}"),
        )?;
    }
    Ok(())
}

#[test]
fn v2_bad_inputs_are_errors() -> Result<()> {
    let q = rand_t(&[1, 4, 3, 4], 1, 1.0, DType::F32)?;
    let k = rand_t(&[1, 2, 3, 4], 2, 1.0, DType::F32)?;
    let v = rand_t(&[1, 2, 3, 4], 3, 1.0, DType::F32)?;
    let l = rand_t(&[1, 2, 3], 4, 1.0, DType::F32)?;
    assert!(difftx_kernels::diff_v2_attention(&q, &k, &v, &l, 0.5, 0, TileProducts::Native).is_ok());
    // one query head per kv head: pair (0, 1) reads kv heads 0 and 1
    let k4 = rand_t(&[1, 4, 3, 4], 5, 1.0, DType::F32)?;
    let e = difftx_kernels::diff_v2_attention(&q, &k4, &k4, &l, 0.5, 0, TileProducts::Native).unwrap_err();
    assert!(e.to_string().contains("two kv heads"), "{e}");
    // λ not one per pair and position, or of another dtype
    let one = Tensor::new(&[0.5f32], &Device::Cpu)?;
    let e = difftx_kernels::diff_v2_attention(&q, &k, &v, &one, 0.5, 0, TileProducts::Native).unwrap_err();
    assert!(e.to_string().contains("6 elements"), "{e}");
    assert!(
        difftx_kernels::diff_v2_attention(&q, &k, &v, &l.to_dtype(DType::F64)?, 0.5, 0, TileProducts::Native).is_err()
    );
    // odd query heads, mismatched head dims
    let odd = rand_t(&[1, 3, 3, 4], 6, 1.0, DType::F32)?;
    assert!(difftx_kernels::diff_v2_attention(&odd, &k, &v, &l, 0.5, 0, TileProducts::Native).is_err());
    assert!(difftx_kernels::diff_v2_attention(&q, &k.narrow(3, 0, 3)?, &v, &l, 0.5, 0, TileProducts::Native).is_err());
    Ok(())
}

#[test]
fn empty_inputs_give_empty_outputs() -> Result<()> {
    let l = Tensor::new(&[0.5f32], &Device::Cpu)?;
    // (B, Hq, Hk, T, S, d): no batch, no query rows, zero-width heads
    for (b, hq, hk, t, s, d) in [(0, 4, 4, 3, 3, 4), (1, 4, 4, 0, 3, 4), (1, 4, 2, 3, 3, 0)] {
        let q = Var::from_tensor(&rand_t(&[b, hq, t, d], 1, 1.0, DType::F32)?)?;
        let k = Var::from_tensor(&rand_t(&[b, hk, s, d], 2, 1.0, DType::F32)?)?;
        let v = Var::from_tensor(&rand_t(&[b, hk, s, d], 3, 1.0, DType::F32)?)?;
        let z = difftx_kernels::diff_attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            &l,
            PairLayout::Halves,
            0.5,
            0,
            TileProducts::Native,
        )?;
        assert_eq!(z.dims(), &[b, hq / 2, t, 2 * d]);
        let g = z.sum_all()?.backward()?;
        assert_eq!(g.get(v.as_tensor()).unwrap().dims(), v.dims());
        let pv = difftx_kernels::pair_values(v.as_tensor(), PairLayout::Interleaved)?;
        assert_eq!(pv.dims(), &[b, hk, s, 2 * d]);
        // diff-v2: a pair per kv head
        let l2 = Tensor::zeros((b, hq / 2, t), DType::F32, &Device::Cpu)?;
        let (k2, v2) = (k.as_tensor().narrow(1, 0, hq / 2)?, v.as_tensor().narrow(1, 0, hq / 2)?);
        let z2 = difftx_kernels::diff_v2_attention(q.as_tensor(), &k2, &v2, &l2, 0.5, 0, TileProducts::Native)?;
        assert_eq!(z2.dims(), &[b, hq / 2, t, d]);
        let g = z2.sum_all()?.backward()?;
        assert_eq!(g.get(q.as_tensor()).unwrap().dims(), q.dims());
    }
    Ok(())
}

/// An attention op of q, k, v and λ with its tile products.
type Op = Box<dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, TileProducts) -> Result<Tensor>>;

/// The three ops with their inputs and the weights of a weighted sum, as f64 values, at bench-s's
/// head layouts and head dim (32), T cut into partial tiles.
struct BenchHeads {
    name: &'static str,
    op: Op,
    x64: [Tensor; 4],
    /// Whether λ is an input (baseline: no).
    lambda: bool,
    seed: u64,
}

fn bench_heads() -> Result<Vec<BenchHeads>> {
    let (b, t, d) = (8, 150, 32);
    let scale = 1.0 / (d as f64).sqrt();
    let cases: [(&str, usize, usize, usize, Op); 3] = [
        ("baseline", 8, 8, 0, Box::new(move |q, k, v, _, p| difftx_kernels::flash_attention(q, k, v, scale, 0, p))),
        (
            "diff-v1",
            8,
            8,
            1,
            Box::new(move |q, k, v, l, p| difftx_kernels::diff_attention(q, k, v, l, PairLayout::Halves, scale, 0, p)),
        ),
        (
            "diff-v2",
            16,
            4,
            b * 8 * t,
            Box::new(move |q, k, v, l, p| difftx_kernels::diff_v2_attention(q, k, v, l, scale, 0, p)),
        ),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (name, hq, hk, n_lambda, op))| {
            let seed = 500 + 10 * i as u64;
            let x64 =
                [
                    rand_t(&[b, hq, t, d], seed, 1.0, DType::F64)?,
                    rand_t(&[b, hk, t, d], seed + 1, 1.0, DType::F64)?,
                    rand_t(&[b, hk, t, d], seed + 2, 1.0, DType::F64)?,
                    ((rand_t(&[n_lambda.max(1)], seed + 3, 1.0, DType::F64)? * 0.4)? + 0.5)?
                        .reshape(if n_lambda > 1 { vec![b, hq / 2, t, 1] } else { vec![1] })?,
                ];
            Ok(BenchHeads { name, op, x64, lambda: n_lambda > 0, seed })
        })
        .collect()
}

impl BenchHeads {
    /// The output and the gradients of the weighted sum (q, k, v, and λ where it is an input),
    /// in `dt` with `products`, as f64.
    fn run(&self, dt: DType, products: TileProducts) -> Result<(Tensor, Vec<Tensor>)> {
        let x: Vec<Var> = self.x64.iter().map(|x| Var::from_tensor(&x.to_dtype(dt)?)).collect::<Result<_>>()?;
        let z = (self.op)(x[0].as_tensor(), x[1].as_tensor(), x[2].as_tensor(), x[3].as_tensor(), products)?;
        let w = rand_t(z.dims(), self.seed + 4, 1.0, dt)?;
        let g = (&z * &w)?.sum_all()?.backward()?;
        let n = if self.lambda { 4 } else { 3 };
        let gs = x[..n].iter().map(|x| g.get(x.as_tensor()).unwrap().to_dtype(DType::F64)).collect::<Result<_>>()?;
        Ok((z.to_dtype(DType::F64)?, gs))
    }
}

/// The f32 ops against the same ops in f64 on bench-s's head layouts: the shared-map backward
/// tasks and flash's one-pass backward, whose f32 tile products run through the AVX-512 tile
/// kernel on CPUs that have it (the f64 ones through gemm), forward and every gradient within
/// f32 rounding.
#[test]
fn f32_matches_f64_at_bench_head_layouts() -> Result<()> {
    for case in bench_heads()? {
        let (z32, g32) = case.run(DType::F32, TileProducts::Native)?;
        let (z64, g64) = case.run(DType::F64, TileProducts::Native)?;
        let e = rel_err(&z32, &z64);
        assert!(e < 1e-5, "{}: forward {e}", case.name);
        for ((what, a), b) in ["q", "k", "v", "lambda"].iter().zip(&g32).zip(&g64) {
            let e = rel_err(a, b);
            assert!(e < 1e-5, "{}: d{what} {e}", case.name);
        }
    }
    Ok(())
}

/// bf16 tile products (`--precision bf16`): the f32 ops within bf16 error of the f64 ones,
/// forward and every gradient (measured 0.3-0.5% of the largest value; λ's gradient, a sum over
/// every score, 1e-4), and off by more than f32's 1e-6 (the products are rounded: on CPUs
/// without AVX512_BF16 by rounded copies); f64 tensors ignore the setting.
#[test]
fn bf16_products_within_bf16_error_at_bench_head_layouts() -> Result<()> {
    for case in bench_heads()? {
        let (z16, g16) = case.run(DType::F32, TileProducts::Bf16)?;
        let (z64, g64) = case.run(DType::F64, TileProducts::Native)?;
        let e = rel_err(&z16, &z64);
        assert!((2e-5..1e-2).contains(&e), "{}: forward {e}", case.name);
        for ((what, a), b) in ["q", "k", "v", "lambda"].iter().zip(&g16).zip(&g64) {
            let e = rel_err(a, b);
            assert!((2e-5..1e-2).contains(&e), "{}: d{what} {e}", case.name);
        }
        let (z64b, g64b) = case.run(DType::F64, TileProducts::Bf16)?;
        assert_eq!(rel_err(&z64b, &z64), 0.0, "{}: f64 forward", case.name);
        for (a, b) in g64b.iter().zip(&g64) {
            assert_eq!(rel_err(a, b), 0.0, "{}: f64 gradients", case.name);
        }
    }
    Ok(())
}
