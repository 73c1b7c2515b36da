//! diff-v1's o1 - λ·o2 against composed candle ops and f64 finite differences.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::{finite_diff, flat, max_rel_vec, rand_t, rel_err};

#[test]
fn forward_and_backward_match_composed_ops() {
    for dt in [DType::F32, DType::F64] {
        for (i, dims) in [vec![1usize], vec![2, 3, 5, 6], vec![3, 9001]].into_iter().enumerate() {
            let o1 = Var::from_tensor(&rand_t(&dims, 1 + i as u64, 1.0, dt).unwrap()).unwrap();
            let o2 = Var::from_tensor(&rand_t(&dims, 11 + i as u64, 1.0, dt).unwrap()).unwrap();
            let lam =
                Var::from_tensor(&Tensor::new(&[0.37f64 - i as f64], &Device::Cpu).unwrap().to_dtype(dt).unwrap())
                    .unwrap();
            let w = rand_t(&dims, 21 + i as u64, 1.0, dt).unwrap();
            let zf = difftx_kernels::diff_combine(o1.as_tensor(), o2.as_tensor(), lam.as_tensor()).unwrap();
            let zr = o1.as_tensor().broadcast_sub(&o2.as_tensor().broadcast_mul(lam.as_tensor()).unwrap()).unwrap();
            let tol = if dt == DType::F64 { 1e-13 } else { 1e-5 };
            assert!(rel_err(&zf, &zr) < tol, "{dt:?} {dims:?}: forward");
            let gf = (&zf * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = (&zr * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("o1", &o1), ("o2", &o2), ("lambda", &lam)] {
                let e = rel_err(gf.get(v.as_tensor()).unwrap(), gr.get(v.as_tensor()).unwrap());
                assert!(e < tol, "{dt:?} {dims:?}: d{name} {e}");
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences_f64() {
    let dims = [3usize, 4, 5];
    let (a0, b0) = (rand_t(&dims, 4, 1.0, DType::F64).unwrap(), rand_t(&dims, 5, 1.0, DType::F64).unwrap());
    let l0 = Tensor::new(&[0.6f64], &Device::Cpu).unwrap();
    let w = rand_t(&dims, 6, 1.0, DType::F64).unwrap();
    let loss = |a: &Tensor, b: &Tensor, l: &Tensor| -> Result<f64> {
        (difftx_kernels::diff_combine(a, b, l)?.sqr()? * &w)?.sum_all()?.to_scalar::<f64>()
    };
    let (a, b, l) = (Var::from_tensor(&a0).unwrap(), Var::from_tensor(&b0).unwrap(), Var::from_tensor(&l0).unwrap());
    let z = difftx_kernels::diff_combine(a.as_tensor(), b.as_tensor(), l.as_tensor()).unwrap();
    let g = (z.sqr().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let checks = [
        (flat(g.get(a.as_tensor()).unwrap()), finite_diff(&a0, |x| loss(x, &b0, &l0), 1e-6).unwrap()),
        (flat(g.get(b.as_tensor()).unwrap()), finite_diff(&b0, |x| loss(&a0, x, &l0), 1e-6).unwrap()),
        (flat(g.get(l.as_tensor()).unwrap()), finite_diff(&l0, |x| loss(&a0, &b0, x), 1e-6).unwrap()),
    ];
    for (i, (an, nu)) in checks.iter().enumerate() {
        assert!(max_rel_vec(an, nu) < 1e-7, "input {i}: {}", max_rel_vec(an, nu));
    }
}

#[test]
fn bad_inputs_are_errors() {
    let a = rand_t(&[2, 3], 1, 1.0, DType::F32).unwrap();
    let two = rand_t(&[2], 1, 1.0, DType::F32).unwrap();
    let one = rand_t(&[1], 1, 1.0, DType::F32).unwrap();
    assert!(difftx_kernels::diff_combine(&a, &a, &two).is_err());
    assert!(difftx_kernels::diff_combine(&a, &a.t().unwrap(), &one).is_err());
    assert!(difftx_kernels::diff_combine(&a, &a, &one.to_dtype(DType::F64).unwrap()).is_err());
}

/// The two maps of pair j as separate tensors, by the layout's definition.
fn split(x: &Tensor, layout: difftx_kernels::PairLayout) -> (Tensor, Tensor) {
    let (b, h, t, w) = x.dims4().unwrap();
    let p = h / 2;
    match layout {
        difftx_kernels::PairLayout::Interleaved => {
            let x = x.reshape((b, p, 2, t, w)).unwrap();
            (x.narrow(2, 0, 1).unwrap().squeeze(2).unwrap(), x.narrow(2, 1, 1).unwrap().squeeze(2).unwrap())
        }
        difftx_kernels::PairLayout::Halves => (x.narrow(1, 0, p).unwrap(), x.narrow(1, p, p).unwrap()),
    }
}

/// diff_combine_pairs against split heads and broadcast ops, forward and backward, for one input
/// `x` `[B, 2P, T, w]` and one λ (a scalar or `[B, P, T, 1]`).
fn check_pairs_against_split(x: &Tensor, lambda: &Tensor, layout: difftx_kernels::PairLayout, seed: u64) {
    let dt = x.dtype();
    let (x, lam) = (Var::from_tensor(x).unwrap(), Var::from_tensor(lambda).unwrap());
    let zf = difftx_kernels::diff_combine_pairs(x.as_tensor(), lam.as_tensor(), layout).unwrap();
    let (a, b) = split(x.as_tensor(), layout);
    let zr = a.broadcast_sub(&b.broadcast_mul(lam.as_tensor()).unwrap()).unwrap();
    let tol = if dt == DType::F64 { 1e-13 } else { 1e-5 };
    let what = format!("{dt:?} {layout:?} x {:?} lambda {:?}", x.dims(), lam.dims());
    assert_eq!(zf.dims(), zr.dims());
    assert!(rel_err(&zf, &zr) < tol, "{what}: forward");
    let w = rand_t(zr.dims(), seed, 1.0, dt).unwrap();
    let gf = (&zf * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gr = (&zr * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in [("x", &x), ("lambda", &lam)] {
        let e = rel_err(gf.get(v.as_tensor()).unwrap(), gr.get(v.as_tensor()).unwrap());
        assert!(e < tol, "{what}: d{name} {e}");
    }
}

/// Gradients of diff_combine_pairs against f64 central differences, for x and λ.
fn check_pairs_finite_differences(x0: &Tensor, l0: &Tensor, layout: difftx_kernels::PairLayout, seed: u64) {
    let (b, h, t, wd) = x0.dims4().unwrap();
    let w = rand_t(&[b, h / 2, t, wd], seed, 1.0, DType::F64).unwrap();
    let loss = |x: &Tensor, l: &Tensor| -> Result<f64> {
        (difftx_kernels::diff_combine_pairs(x, l, layout)?.sqr()? * &w)?.sum_all()?.to_scalar::<f64>()
    };
    let (x, l) = (Var::from_tensor(x0).unwrap(), Var::from_tensor(l0).unwrap());
    let z = difftx_kernels::diff_combine_pairs(x.as_tensor(), l.as_tensor(), layout).unwrap();
    let grads = (z.sqr().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let nx = finite_diff(x0, |x| loss(x, l0), 1e-6).unwrap();
    let nl = finite_diff(l0, |l| loss(x0, l), 1e-6).unwrap();
    assert!(max_rel_vec(&flat(grads.get(x.as_tensor()).unwrap()), &nx) < 1e-7, "{layout:?}: dx");
    assert!(max_rel_vec(&flat(grads.get(l.as_tensor()).unwrap()), &nl) < 1e-7, "{layout:?}: dlambda");
}

const LAYOUTS: [difftx_kernels::PairLayout; 2] =
    [difftx_kernels::PairLayout::Interleaved, difftx_kernels::PairLayout::Halves];

/// (B, P, T, w): one pair of one row; odd sizes; rows that cross rayon's chunking.
const PAIR_SHAPES: [(usize, usize, usize, usize); 3] = [(1, 1, 1, 1), (2, 3, 5, 7), (3, 2, 33, 64)];

#[test]
fn pairs_match_split_heads_forward_and_backward() {
    for dt in [DType::F32, DType::F64] {
        for layout in LAYOUTS {
            for (i, (b, p, t, w)) in PAIR_SHAPES.into_iter().enumerate() {
                let x = rand_t(&[b, 2 * p, t, w], 40 + i as u64, 1.0, dt).unwrap();
                // diff-v1: one scalar λ
                let scalar = Tensor::new(&[0.8f64 - 0.3 * i as f64], &Device::Cpu).unwrap().to_dtype(dt).unwrap();
                check_pairs_against_split(&x, &scalar, layout, 50 + i as u64);
                // diff-v2: one λ in (0, 1) per pair and position, [B, P, T, 1]
                let per_position = (rand_t(&[b, p, t, 1], 70 + i as u64, 0.5, dt).unwrap() + 0.5).unwrap();
                check_pairs_against_split(&x, &per_position, layout, 80 + i as u64);
            }
        }
    }
}

#[test]
fn pairs_backward_matches_finite_differences_f64() {
    for layout in LAYOUTS {
        let x0 = rand_t(&[2, 4, 3, 5], 7, 1.0, DType::F64).unwrap();
        check_pairs_finite_differences(&x0, &Tensor::new(&[0.45f64], &Device::Cpu).unwrap(), layout, 8);
        check_pairs_finite_differences(&x0, &rand_t(&[2, 2, 3, 1], 10, 0.5, DType::F64).unwrap(), layout, 11);
    }
}

#[test]
fn pairs_reject_odd_heads_and_bad_lambda() {
    let x = rand_t(&[1, 3, 2, 2], 1, 1.0, DType::F32).unwrap();
    let l = Tensor::new(&[0.5f32], &Device::Cpu).unwrap();
    let e = difftx_kernels::diff_combine_pairs(&x, &l, difftx_kernels::PairLayout::Halves).unwrap_err();
    assert!(e.to_string().contains("pairs"), "{e}");
    // one λ per pair and position is B·P·T = 2 here; 3 is neither that nor a scalar
    let x = rand_t(&[1, 2, 2, 2], 1, 1.0, DType::F32).unwrap();
    let l3 = Tensor::new(&[0.5f32, 0.1, 0.2], &Device::Cpu).unwrap();
    assert!(difftx_kernels::diff_combine_pairs(&x, &l3, difftx_kernels::PairLayout::Halves).is_err());
    let l64 = Tensor::new(&[0.5f64], &Device::Cpu).unwrap();
    assert!(difftx_kernels::diff_combine_pairs(&x, &l64, difftx_kernels::PairLayout::Halves).is_err());
}

/// pair_values composed from candle ops: the pair's two value heads side by side, one per head
/// of the pair (`[B, H, S, d]` -> `[B, H, S, 2d]`).
fn pair_values_composed(v: &Tensor, layout: difftx_kernels::PairLayout) -> Tensor {
    let (a, b) = split(v, layout);
    let pv = Tensor::cat(&[a, b], 3).unwrap(); // [B, P, S, 2d]
    let (bs, p, s, w) = pv.dims4().unwrap();
    // head i's pair: i / 2 (interleaved) or i % P (halves)
    let per_head: Vec<Tensor> = (0..2 * p)
        .map(|i| {
            let j = match layout {
                difftx_kernels::PairLayout::Interleaved => i / 2,
                difftx_kernels::PairLayout::Halves => i % p,
            };
            pv.narrow(1, j, 1).unwrap()
        })
        .collect();
    let out = Tensor::cat(&per_head, 1).unwrap();
    assert_eq!(out.dims(), &[bs, 2 * p, s, w]);
    out
}

/// (B, H, S, d): one pair of one row; odd sizes; a head larger than rayon's smallest split.
const VALUE_SHAPES: [(usize, usize, usize, usize); 4] = [(1, 2, 1, 1), (2, 6, 5, 3), (3, 4, 33, 32), (1, 8, 300, 7)];

#[test]
fn pair_values_match_composed_ops_forward_and_backward() {
    for dt in [DType::F32, DType::F64] {
        for layout in LAYOUTS {
            for (i, (b, h, s, d)) in VALUE_SHAPES.into_iter().enumerate() {
                let v = Var::from_tensor(&rand_t(&[b, h, s, d], 90 + i as u64, 1.0, dt).unwrap()).unwrap();
                let of = difftx_kernels::pair_values(v.as_tensor(), layout).unwrap();
                let or = pair_values_composed(v.as_tensor(), layout);
                let what = format!("{dt:?} {layout:?} {:?}", v.dims());
                assert_eq!(of.dims(), or.dims(), "{what}");
                // a copy: exactly equal
                assert_eq!(rel_err(&of, &or), 0.0, "{what}: forward");
                let w = rand_t(or.dims(), 95 + i as u64, 1.0, dt).unwrap();
                let gf = (&of * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let gr = (&or * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let tol = if dt == DType::F64 { 1e-14 } else { 1e-6 };
                let e = rel_err(gf.get(v.as_tensor()).unwrap(), gr.get(v.as_tensor()).unwrap());
                assert!(e < tol, "{what}: dv {e}");
            }
        }
    }
}

#[test]
fn pair_values_backward_matches_finite_differences_f64() {
    for layout in LAYOUTS {
        let v0 = rand_t(&[2, 4, 3, 5], 17, 1.0, DType::F64).unwrap();
        let w = rand_t(&[2, 4, 3, 10], 18, 1.0, DType::F64).unwrap();
        let loss = |v: &Tensor| -> Result<f64> {
            (difftx_kernels::pair_values(v, layout)?.sqr()? * &w)?.sum_all()?.to_scalar::<f64>()
        };
        let v = Var::from_tensor(&v0).unwrap();
        let o = difftx_kernels::pair_values(v.as_tensor(), layout).unwrap();
        let grads = (o.sqr().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let nv = finite_diff(&v0, loss, 1e-6).unwrap();
        assert!(max_rel_vec(&flat(grads.get(v.as_tensor()).unwrap()), &nv) < 1e-7, "{layout:?}: dv");
    }
}

#[test]
fn pair_values_reject_odd_heads_and_other_dtypes() {
    let v = rand_t(&[1, 3, 2, 2], 1, 1.0, DType::F32).unwrap();
    let e = difftx_kernels::pair_values(&v, difftx_kernels::PairLayout::Halves).unwrap_err();
    assert!(e.to_string().contains("pairs"), "{e}");
    let v = rand_t(&[1, 2, 2, 2], 1, 1.0, DType::F32).unwrap().to_dtype(DType::BF16).unwrap();
    assert!(difftx_kernels::pair_values(&v, difftx_kernels::PairLayout::Interleaved).is_err());
}
