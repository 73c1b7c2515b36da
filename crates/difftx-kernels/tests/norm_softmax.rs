mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use common::*;
use difftx_kernels::{rms_norm, softmax_last_dim};

const SHAPES: &[&[usize]] = &[&[3, 5, 7], &[2, 1, 33], &[4, 1], &[1], &[2, 3, 1], &[5, 64], &[2, 300]];

/// Plain-loop f64 softmax over the last dim.
fn softmax_ref(x: &[f64], n: usize) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (yr, xr) in y.chunks_mut(n).zip(x.chunks(n)) {
        let m = xr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = xr.iter().map(|v| (v - m).exp()).sum();
        for (o, v) in yr.iter_mut().zip(xr) {
            *o = (v - m).exp() / s;
        }
    }
    y
}

/// Plain-loop f64 RMSNorm over the last dim.
fn rms_ref(x: &[f64], g: Option<&[f64]>, n: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (yr, xr) in y.chunks_mut(n).zip(x.chunks(n)) {
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / n as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for (i, (o, v)) in yr.iter_mut().zip(xr).enumerate() {
            *o = v * r * g.map_or(1.0, |g| g[i]);
        }
    }
    y
}

/// candle composed softmax (no custom op): the autograd reference.
fn softmax_composed(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// candle composed RMSNorm (no custom op): the autograd reference.
fn rms_composed(x: &Tensor, g: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let y = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    match g {
        Some(g) => y.broadcast_mul(g),
        None => Ok(y),
    }
}

#[test]
fn softmax_forward_matches_plain_loops() -> Result<()> {
    for (i, dims) in SHAPES.iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            let x = rand_t(dims, 10 + i as u64, 6.0, dt)?;
            let y = softmax_last_dim(&x)?;
            assert_eq!(y.dims(), *dims);
            assert_eq!(y.dtype(), dt);
            let want = softmax_ref(&flat(&x), dims[dims.len() - 1]);
            let tol = if dt == DType::F32 { 1e-6 } else { 1e-14 };
            let err = max_rel_vec(&flat(&y), &want);
            assert!(err < tol, "{dims:?} {dt:?}: err {err}");
        }
    }
    Ok(())
}

#[test]
fn softmax_handles_neg_inf_and_large_values() -> Result<()> {
    let x = Tensor::new(&[[0.0f32, f32::NEG_INFINITY, 1.0, 1000.0], [-1e4, -1e4 + 1.0, -1e4, -1e4]], &Device::Cpu)?;
    let y = softmax_last_dim(&x)?;
    let want = softmax_ref(&flat(&x), 4);
    assert!(max_rel_vec(&flat(&y), &want) < 1e-6);
    assert_eq!(flat(&y)[1], 0.0);
    Ok(())
}

#[test]
fn softmax_non_contiguous_input() -> Result<()> {
    let base = rand_t(&[4, 6, 5], 3, 3.0, DType::F32)?;
    let x = base.transpose(1, 2)?; // [4, 5, 6], strided
    assert!(!x.is_contiguous());
    let y = softmax_last_dim(&x)?;
    let want = softmax_ref(&flat(&x.contiguous()?), 6);
    assert!(max_rel_vec(&flat(&y), &want) < 1e-6);
    // and a narrowed (offset) view
    let x = base.narrow(0, 1, 2)?;
    let y = softmax_last_dim(&x)?;
    assert!(max_rel_vec(&flat(&y), &softmax_ref(&flat(&x), 5)) < 1e-6);
    Ok(())
}

#[test]
fn unsupported_dtypes_error() -> Result<()> {
    let x = rand_t(&[2, 3], 1, 1.0, DType::F16)?;
    assert!(softmax_last_dim(&x).is_err());
    assert!(rms_norm(&x, None, 1e-5).is_err());
    let x = rand_t(&[2, 3], 1, 1.0, DType::F32)?;
    let g = rand_t(&[4], 1, 1.0, DType::F32)?;
    assert!(rms_norm(&x, Some(&g), 1e-5).is_err(), "wrong gain shape must error");
    Ok(())
}

#[test]
fn softmax_grad_finite_differences_f64() -> Result<()> {
    for (i, dims) in [&[3usize, 5, 7][..], &[2, 1, 33], &[4, 1]].iter().enumerate() {
        let x = rand_t(dims, 20 + i as u64, 2.0, DType::F64)?;
        let w = rand_t(dims, 30 + i as u64, 1.0, DType::F64)?;
        let loss = |x: &Tensor| -> Result<f64> { (softmax_last_dim(x)? * &w)?.sum_all()?.to_scalar() };
        let xv = Var::from_tensor(&x)?;
        let grads = (softmax_last_dim(xv.as_tensor())? * &w)?.sum_all()?.backward()?;
        let g = flat(grads.get(xv.as_tensor()).expect("no grad for x"));
        let fd = finite_diff(&x, loss, 1e-5)?;
        let err = max_rel_vec(&g, &fd);
        assert!(err < 1e-7, "{dims:?}: err {err}");
    }
    Ok(())
}

#[test]
fn softmax_grad_matches_composed_f32() -> Result<()> {
    for (i, dims) in SHAPES.iter().enumerate() {
        let x = rand_t(dims, 40 + i as u64, 4.0, DType::F32)?;
        let w = rand_t(dims, 50 + i as u64, 1.0, DType::F32)?;
        let xv = Var::from_tensor(&x)?;
        let g1 = (softmax_last_dim(xv.as_tensor())? * &w)?.sum_all()?.backward()?;
        let g2 = (softmax_composed(xv.as_tensor())? * &w)?.sum_all()?.backward()?;
        let a = g1.get(xv.as_tensor()).unwrap();
        let b = g2.get(xv.as_tensor()).unwrap();
        let err = rel_err(a, b);
        assert!(err < 1e-5, "{dims:?}: err {err}");
    }
    Ok(())
}

#[test]
fn rms_norm_forward_matches_plain_loops() -> Result<()> {
    for (i, dims) in SHAPES.iter().enumerate() {
        let n = dims[dims.len() - 1];
        for dt in [DType::F32, DType::F64] {
            let x = rand_t(dims, 60 + i as u64, 3.0, dt)?;
            let g = rand_t(&[n], 70 + i as u64, 2.0, dt)?;
            for eps in [1e-5, 0.5] {
                let y = rms_norm(&x, None, eps)?;
                let want = rms_ref(&flat(&x), None, n, eps);
                let tol = if dt == DType::F32 { 2e-6 } else { 1e-13 };
                let err = max_rel_vec(&flat(&y), &want);
                assert!(err < tol, "{dims:?} {dt:?} eps {eps}: err {err}");
                let y = rms_norm(&x, Some(&g), eps)?;
                assert_eq!(y.dtype(), dt);
                let want = rms_ref(&flat(&x), Some(&flat(&g)), n, eps);
                let err = max_rel_vec(&flat(&y), &want);
                assert!(err < tol, "{dims:?} {dt:?} eps {eps} gain: err {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn rms_norm_non_contiguous_and_large_values() -> Result<()> {
    let base = rand_t(&[3, 8, 5], 5, 1e3, DType::F32)?;
    let x = base.transpose(1, 2)?;
    let g = rand_t(&[16], 6, 1.0, DType::F32)?.narrow(0, 4, 8)?;
    let y = rms_norm(&x, Some(&g), 1e-5)?;
    let want = rms_ref(&flat(&x.contiguous()?), Some(&flat(&g)), 8, 1e-5);
    let err = max_rel_vec(&flat(&y), &want);
    assert!(err < 2e-6, "err {err}");
    Ok(())
}

#[test]
fn rms_norm_grad_finite_differences_f64() -> Result<()> {
    for (i, dims) in [&[3usize, 5, 7][..], &[2, 1, 33], &[4, 1]].iter().enumerate() {
        let n = dims[dims.len() - 1];
        let x = rand_t(dims, 80 + i as u64, 2.0, DType::F64)?;
        let g = rand_t(&[n], 90 + i as u64, 1.5, DType::F64)?;
        let w = rand_t(dims, 100 + i as u64, 1.0, DType::F64)?;
        let eps = 1e-3;
        // gradient wrt x, with and without gain
        for gain in [None, Some(&g)] {
            let xv = Var::from_tensor(&x)?;
            let gv = Var::from_tensor(&g)?;
            let gain_t = gain.map(|_| gv.as_tensor());
            let grads = (rms_norm(xv.as_tensor(), gain_t, eps)? * &w)?.sum_all()?.backward()?;
            let gx = flat(grads.get(xv.as_tensor()).expect("no grad for x"));
            let fd = finite_diff(&x, |x| (rms_norm(x, gain, eps)? * &w)?.sum_all()?.to_scalar(), 1e-5)?;
            let err = max_rel_vec(&gx, &fd);
            assert!(err < 1e-7, "{dims:?} gain {}: dx err {err}", gain.is_some());
            if gain.is_some() {
                let gg = flat(grads.get(gv.as_tensor()).expect("no grad for gain"));
                let fd = finite_diff(&g, |g| (rms_norm(&x, Some(g), eps)? * &w)?.sum_all()?.to_scalar(), 1e-5)?;
                let err = max_rel_vec(&gg, &fd);
                assert!(err < 1e-7, "{dims:?}: dgain err {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn rms_norm_grad_matches_composed() -> Result<()> {
    // f32 kernel vs candle's composed ops run in f64 (so the reference carries no f32 rounding).
    // With n = 1 the true dx is ~eps/|x|^3 and cancels catastrophically, so use a large eps there.
    for (i, dims) in SHAPES.iter().enumerate() {
        let n = dims[dims.len() - 1];
        let eps = if n == 1 { 1.0 } else { 1e-5 };
        let x = rand_t(dims, 110 + i as u64, 3.0, DType::F32)?;
        let g = rand_t(&[n], 120 + i as u64, 1.0, DType::F32)?;
        let w = rand_t(dims, 130 + i as u64, 1.0, DType::F32)?;
        let xv = Var::from_tensor(&x)?;
        let gv = Var::from_tensor(&g)?;
        let xv64 = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
        let gv64 = Var::from_tensor(&g.to_dtype(DType::F64)?)?;
        let w64 = w.to_dtype(DType::F64)?;
        let g1 = (rms_norm(xv.as_tensor(), Some(gv.as_tensor()), eps)? * &w)?.sum_all()?.backward()?;
        let g2 = (rms_composed(xv64.as_tensor(), Some(gv64.as_tensor()), eps)? * &w64)?.sum_all()?.backward()?;
        let ex = rel_err(g1.get(xv.as_tensor()).unwrap(), g2.get(xv64.as_tensor()).unwrap());
        let eg = rel_err(g1.get(gv.as_tensor()).unwrap(), g2.get(gv64.as_tensor()).unwrap());
        assert!(ex < 1e-5 && eg < 1e-5, "{dims:?}: dx err {ex}, dgain err {eg}");
        let g1 = (rms_norm(xv.as_tensor(), None, eps)? * &w)?.sum_all()?.backward()?;
        let g2 = (rms_composed(xv64.as_tensor(), None, eps)? * &w64)?.sum_all()?.backward()?;
        let ex = rel_err(g1.get(xv.as_tensor()).unwrap(), g2.get(xv64.as_tensor()).unwrap());
        assert!(ex < 1e-5, "{dims:?} no gain: dx err {ex}");
        // and the f32 composed graph agrees too (same maths through candle's own backward)
        let g3 = (rms_composed(xv.as_tensor(), None, eps)? * &w)?.sum_all()?.backward()?;
        let ex = rel_err(g3.get(xv.as_tensor()).unwrap(), g2.get(xv64.as_tensor()).unwrap());
        assert!(ex < 1e-4, "{dims:?} composed f32 sanity: {ex}");
    }
    Ok(())
}

#[test]
fn grads_flow_through_strided_upstream() -> Result<()> {
    // y.t() makes the gradient arriving at the op non-contiguous.
    let x = rand_t(&[6, 9], 140, 2.0, DType::F64)?;
    let w = rand_t(&[9, 6], 141, 1.0, DType::F64)?;
    let xv = Var::from_tensor(&x)?;
    let a = (softmax_last_dim(xv.as_tensor())?.t()? * &w)?.sum_all()?.backward()?;
    let b = (softmax_composed(xv.as_tensor())?.t()? * &w)?.sum_all()?.backward()?;
    assert!(rel_err(a.get(xv.as_tensor()).unwrap(), b.get(xv.as_tensor()).unwrap()) < 1e-12);
    let a = (rms_norm(xv.as_tensor(), None, 1e-5)?.t()? * &w)?.sum_all()?.backward()?;
    let b = (rms_composed(xv.as_tensor(), None, 1e-5)?.t()? * &w)?.sum_all()?.backward()?;
    assert!(rel_err(a.get(xv.as_tensor()).unwrap(), b.get(xv.as_tensor()).unwrap()) < 1e-12);
    Ok(())
}
