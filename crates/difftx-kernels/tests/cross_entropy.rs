//! Fused cross-entropy against candle-nn's composed loss (log-softmax, gather, mean), forward and
//! backward, and against f64 finite differences.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::{finite_diff, flat, max_rel_vec, rand_t, rel_err};

fn targets(rows: usize, vocab: usize, seed: u64) -> Tensor {
    let t: Vec<u32> =
        common::uniform(rows, seed).iter().map(|u| (((u + 1.0) / 2.0) * vocab as f64) as u32 % vocab as u32).collect();
    Tensor::from_vec(t, rows, &Device::Cpu).unwrap()
}

#[test]
fn forward_and_backward_match_composed_ops() {
    // Awkward shapes: one row of one class, a vocabulary not a multiple of the SIMD width, rows
    // that cross the parallel chunk size, and large logits (the max-shift must hold).
    for dt in [DType::F32, DType::F64] {
        for (i, (rows, vocab, scale)) in
            [(1usize, 1usize, 1.0), (3, 7, 4.0), (37, 257, 30.0), (700, 33, 2.0)].into_iter().enumerate()
        {
            let x = Var::from_tensor(&rand_t(&[rows, vocab], 10 + i as u64, scale, dt).unwrap()).unwrap();
            let t = targets(rows, vocab, 20 + i as u64);
            let fused = difftx_kernels::cross_entropy(x.as_tensor(), &t).unwrap();
            let reference = candle_nn::loss::cross_entropy(x.as_tensor(), &t).unwrap();
            assert_eq!(fused.dims(), reference.dims());
            let tol = if dt == DType::F64 { 1e-12 } else { 2e-6 };
            assert!(rel_err(&fused, &reference) < tol, "{dt:?} {rows}x{vocab}: loss {}", rel_err(&fused, &reference));
            // A non-unit upstream gradient, as when the loss is scaled.
            let gf = (fused * 0.7).unwrap().backward().unwrap();
            let gr = (reference * 0.7).unwrap().backward().unwrap();
            let e = rel_err(gf.get(x.as_tensor()).unwrap(), gr.get(x.as_tensor()).unwrap());
            assert!(e < tol, "{dt:?} {rows}x{vocab}: dlogits {e}");
        }
    }
}

#[test]
fn backward_matches_finite_differences_f64() {
    let (rows, vocab) = (5usize, 11usize);
    let x0 = rand_t(&[rows, vocab], 3, 3.0, DType::F64).unwrap();
    let t = targets(rows, vocab, 4);
    let x = Var::from_tensor(&x0).unwrap();
    let loss = difftx_kernels::cross_entropy(x.as_tensor(), &t).unwrap();
    let grads = loss.sqr().unwrap().backward().unwrap();
    let f = |x: &Tensor| -> Result<f64> { difftx_kernels::cross_entropy(x, &t)?.sqr()?.to_scalar::<f64>() };
    let numeric = finite_diff(&x0, f, 1e-6).unwrap();
    assert!(max_rel_vec(&flat(grads.get(x.as_tensor()).unwrap()), &numeric) < 1e-7);
}

#[test]
fn known_values_and_target_dtypes() {
    // Uniform logits over V classes: the loss is ln V whatever the targets.
    let x = Tensor::zeros((4, 8), DType::F64, &Device::Cpu).unwrap();
    for t in
        [Tensor::new(&[0u32, 3, 7, 1], &Device::Cpu).unwrap(), Tensor::new(&[0i64, 3, 7, 1], &Device::Cpu).unwrap()]
    {
        let l = difftx_kernels::cross_entropy(&x, &t).unwrap().to_scalar::<f64>().unwrap();
        assert!((l - 8f64.ln()).abs() < 1e-14, "{l}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let x = rand_t(&[2, 3], 1, 1.0, DType::F32).unwrap();
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(difftx_kernels::cross_entropy(&x, &Tensor::new(&[0u32, 3], &Device::Cpu).unwrap())).contains("outside"));
    assert!(
        err(difftx_kernels::cross_entropy(&x, &Tensor::new(&[0u32], &Device::Cpu).unwrap())).contains("must be [2]")
    );
    let h = x.to_dtype(DType::F16).unwrap();
    assert!(err(difftx_kernels::cross_entropy(&h, &Tensor::new(&[0u32, 1], &Device::Cpu).unwrap())).contains("dtype"));
    let empty = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
    assert!(err(difftx_kernels::cross_entropy(&empty, &Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap()))
        .contains("empty"));
}
