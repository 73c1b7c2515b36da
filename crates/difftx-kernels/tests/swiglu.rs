//! SwiGLU gate against composed candle ops (forward, backward) and f64 finite differences.

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::{finite_diff, flat, max_rel_vec, rand_t, rel_err};

fn reference(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    candle_nn_free_silu(g)? * u
}

/// silu(x) = x · sigmoid(x), composed from primitives.
fn candle_nn_free_silu(x: &Tensor) -> Result<Tensor> {
    x * ((x.neg()?.exp()? + 1.0)?.recip()?)
}

#[test]
fn forward_and_backward_match_composed_ops() {
    // Awkward sizes: a single element, a row not a multiple of the SIMD width, and one that
    // crosses the parallel chunk size.
    for dt in [DType::F32, DType::F64] {
        for (i, dims) in [vec![1usize], vec![3, 7], vec![5, 3001]].into_iter().enumerate() {
            let g = Var::from_tensor(&rand_t(&dims, 10 + i as u64, 6.0, dt).unwrap()).unwrap();
            let u = Var::from_tensor(&rand_t(&dims, 20 + i as u64, 2.0, dt).unwrap()).unwrap();
            let w = rand_t(&dims, 30 + i as u64, 1.0, dt).unwrap();
            let hf = difftx_kernels::swiglu(g.as_tensor(), u.as_tensor()).unwrap();
            let hr = reference(g.as_tensor(), u.as_tensor()).unwrap();
            let tol = if dt == DType::F64 { 1e-13 } else { 2e-6 };
            assert!(rel_err(&hf, &hr) < tol, "{dt:?} {dims:?}: forward {}", rel_err(&hf, &hr));
            let gf = (&hf * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = (&hr * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("gate", &g), ("up", &u)] {
                let e = rel_err(gf.get(v.as_tensor()).unwrap(), gr.get(v.as_tensor()).unwrap());
                assert!(e < tol, "{dt:?} {dims:?}: d{name} {e}");
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences_f64() {
    let dims = [4usize, 9];
    let g0 = rand_t(&dims, 1, 4.0, DType::F64).unwrap();
    let u0 = rand_t(&dims, 2, 2.0, DType::F64).unwrap();
    let w = rand_t(&dims, 3, 1.0, DType::F64).unwrap();
    let (g, u) = (Var::from_tensor(&g0).unwrap(), Var::from_tensor(&u0).unwrap());
    let h = difftx_kernels::swiglu(g.as_tensor(), u.as_tensor()).unwrap();
    let grads = (h.sqr().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let loss = |g: &Tensor, u: &Tensor| -> Result<f64> {
        (difftx_kernels::swiglu(g, u)?.sqr()? * &w)?.sum_all()?.to_scalar::<f64>()
    };
    let ng = finite_diff(&g0, |g| loss(g, &u0), 1e-6).unwrap();
    let nu = finite_diff(&u0, |u| loss(&g0, u), 1e-6).unwrap();
    assert!(max_rel_vec(&flat(grads.get(g.as_tensor()).unwrap()), &ng) < 1e-7);
    assert!(max_rel_vec(&flat(grads.get(u.as_tensor()).unwrap()), &nu) < 1e-7);
}

#[test]
fn mismatched_inputs_are_errors() {
    let a = rand_t(&[2, 3], 1, 1.0, DType::F32).unwrap();
    let b = rand_t(&[3, 2], 1, 1.0, DType::F32).unwrap();
    assert!(difftx_kernels::swiglu(&a, &b).is_err());
    assert!(difftx_kernels::swiglu(&a, &a.to_dtype(DType::F64).unwrap()).is_err());
}
