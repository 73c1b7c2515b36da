//! Softmax over the last dimension, forward and backward.
//!
//! Layout: `x`, `y`, `dy`, `dx` are row-major `[rows, n]` (all leading dims flattened into rows).
//! Forward:  y = exp(x - max(x)) / sum(exp(x - max(x)))
//! Backward: dx = y * (dy - sum(dy * y))

use crate::cpu::{min_rows, rows_cols, storage_slice, with_slice, zeros};
use crate::float::{max_slice, sum_slice, Float};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Softmax over the last dim, with backward. f32 and f64 (error for other dtypes).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_dtype(x.dtype())?;
    x.contiguous()?.apply_op1(SoftmaxLastDim)
}

fn check_dtype(dt: DType) -> Result<()> {
    match dt {
        DType::F32 | DType::F64 => Ok(()),
        dt => bail!("difftx_kernels::softmax_last_dim: unsupported dtype {dt:?} (f32, f64 only)"),
    }
}

struct SoftmaxLastDim;

/// Forward kernel: `y[r, :] = softmax(x[r, :])`.
pub(crate) fn softmax_fwd<T: Float>(x: &[T], y: &mut [T], n: usize) {
    if n == 0 {
        return;
    }
    y.par_chunks_mut(n).zip(x.par_chunks(n)).with_min_len(min_rows(n, 8192)).for_each(|(yr, xr)| {
        let m = max_slice(xr, T::NEG_INF);
        for (o, &v) in yr.iter_mut().zip(xr) {
            *o = v - m;
        }
        T::exp_inplace(yr);
        let s = sum_slice(yr);
        let inv = T::ONE / s;
        for o in yr.iter_mut() {
            *o *= inv;
        }
    });
}

/// Backward kernel: `dx[r, :] = y[r, :] * (dy[r, :] - <dy[r, :], y[r, :]>)`.
pub(crate) fn softmax_bwd<T: Float>(y: &[T], dy: &[T], dx: &mut [T], n: usize) {
    if n == 0 {
        return;
    }
    dx.par_chunks_mut(n).zip(y.par_chunks(n).zip(dy.par_chunks(n))).with_min_len(min_rows(n, 8192)).for_each(
        |(dxr, (yr, gr))| {
            let mut dot = T::ZERO;
            for (&a, &b) in yr.iter().zip(gr) {
                dot += a * b;
            }
            for ((o, &a), &b) in dxr.iter_mut().zip(yr).zip(gr) {
                *o = a * (b - dot);
            }
        },
    );
}

fn fwd_typed<T: Float>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let x = storage_slice::<T>(s, l)?;
    let (_, n) = rows_cols(l.dims())?;
    let mut y = zeros::<T>(x.len());
    softmax_fwd(x, &mut y, n);
    Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
}

fn bwd_typed<T: Float>(res: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let (_, n) = rows_cols(res.dims())?;
    let dx = with_slice::<T, _>(res, |y| {
        with_slice::<T, _>(grad, |g| {
            let mut dx = zeros::<T>(y.len());
            softmax_bwd(y, g, &mut dx, n);
            Ok(dx)
        })
    })?;
    Tensor::from_vec(dx, res.shape(), res.device())
}

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "difftx-softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s.dtype() {
            DType::F32 => fwd_typed::<f32>(s, l),
            DType::F64 => fwd_typed::<f64>(s, l),
            dt => bail!("difftx-softmax-last-dim: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad_res.to_dtype(res.dtype())?;
        let dx = match res.dtype() {
            DType::F32 => bwd_typed::<f32>(res, &grad)?,
            DType::F64 => bwd_typed::<f64>(res, &grad)?,
            dt => bail!("difftx-softmax-last-dim: unsupported dtype {dt:?}"),
        };
        Ok(Some(dx))
    }
}
