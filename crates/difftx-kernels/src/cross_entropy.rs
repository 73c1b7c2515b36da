//! Mean next-token cross-entropy fused over the vocabulary: one pass per row for the loss, one for
//! its gradient, instead of log-softmax, a gather, a mean and their three backward passes (each
//! a full [rows, vocab] tensor).
//!
//! Layout: `logits` is row-major `[rows, vocab]`, `targets` `[rows]` (u32 or i64 class indices).
//! Forward:  loss = (1/rows) Σ_r (lse(x_r) − x_r[t_r]),   lse(x) = m + ln Σ_j exp(x_j − m), m = max x
//! Backward: dx_r = g/rows · (softmax(x_r) − onehot(t_r))          (g = the loss's upstream gradient)
//! The per-row terms are summed in row order after the parallel pass, so the loss does not depend
//! on the thread count. The backward recomputes each row's softmax (one exp per element) rather
//! than keeping a [rows, vocab] probability tensor alive between the passes.

use crate::cpu::{min_rows, storage_slice, with_slice, zeros};
use crate::float::{max_slice, sum_slice, Float};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Mean cross-entropy (nats) of `logits` `[rows, vocab]` (f32 or f64) against `targets` `[rows]`
/// (u32 or i64), as a scalar of the logits' dtype, with backward to the logits.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    match logits.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::cross_entropy: unsupported logits dtype {dt:?} (f32, f64 only)"),
    }
    if rows == 0 || vocab == 0 {
        bail!("difftx_kernels::cross_entropy: empty logits {:?}", logits.dims());
    }
    if targets.dims() != [rows] {
        bail!(
            "difftx_kernels::cross_entropy: targets {:?} must be [{rows}] for logits {:?}",
            targets.dims(),
            logits.dims()
        );
    }
    let targets = match targets.dtype() {
        DType::U32 => targets.contiguous()?,
        DType::I64 | DType::U8 => targets.to_dtype(DType::U32)?,
        dt => bail!("difftx_kernels::cross_entropy: unsupported targets dtype {dt:?} (u32, i64, u8)"),
    };
    logits.contiguous()?.apply_op2(&targets, CrossEntropy)?.reshape(())
}

struct CrossEntropy;

/// lse(x) − x[t] of one row.
fn row_loss<T: Float>(x: &[T], t: usize, scratch: &mut Vec<T>) -> f64 {
    let m = max_slice(x, T::NEG_INF);
    scratch.clear();
    scratch.extend(x.iter().map(|&v| v - m));
    T::exp_inplace(scratch);
    let lse = m.to_f64() + sum_slice(scratch).to_f64().ln();
    lse - x[t].to_f64()
}

/// Forward kernel: the mean over rows of `lse(x_r) − x_r[t_r]`.
pub(crate) fn cross_entropy_fwd<T: Float>(x: &[T], targets: &[u32], vocab: usize) -> f64 {
    let losses: Vec<f64> = x
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .with_min_len(min_rows(vocab, 8192))
        .map_init(Vec::new, |scratch, (xr, &t)| row_loss(xr, t as usize, scratch))
        .collect();
    losses.iter().sum::<f64>() / targets.len() as f64
}

/// Backward kernel: `dx_r = scale · (softmax(x_r) − onehot(t_r))`.
pub(crate) fn cross_entropy_bwd<T: Float>(x: &[T], targets: &[u32], vocab: usize, scale: T, dx: &mut [T]) {
    dx.par_chunks_mut(vocab)
        .zip(x.par_chunks(vocab).zip(targets.par_iter()))
        .with_min_len(min_rows(vocab, 8192))
        .for_each(|(dr, (xr, &t))| {
            let m = max_slice(xr, T::NEG_INF);
            for (o, &v) in dr.iter_mut().zip(xr) {
                *o = v - m;
            }
            T::exp_inplace(dr);
            let k = scale / sum_slice(dr);
            for o in dr.iter_mut() {
                *o *= k;
            }
            dr[t as usize] -= scale;
        });
}

fn fwd_typed<T: Float>(s1: &CpuStorage, l1: &Layout, targets: &[u32]) -> Result<(CpuStorage, Shape)> {
    let x = storage_slice::<T>(s1, l1)?;
    let vocab = l1.dims()[1];
    let loss = T::from_f64(cross_entropy_fwd(x, targets, vocab));
    Ok((T::to_cpu_storage_owned(vec![loss]), Shape::from_dims(&[1])))
}

fn bwd_typed<T: Float>(logits: &Tensor, targets: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let g = with_slice::<T, _>(grad, |g| Ok(g[0]))?;
    let scale = g / T::from_f64(rows as f64);
    let targets = targets.to_vec1::<u32>()?;
    let dx = with_slice::<T, _>(logits, |x| {
        let mut dx = zeros::<T>(x.len());
        cross_entropy_bwd(x, &targets, vocab, scale, &mut dx);
        Ok(dx)
    })?;
    Tensor::from_vec(dx, logits.shape(), logits.device())
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "difftx-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let targets = match l2.contiguous_offsets() {
            Some((a, b)) => &s2.as_slice::<u32>()?[a..b],
            None => bail!("difftx-cross-entropy: expected contiguous targets, got {l2:?}"),
        };
        let vocab = l1.dims()[1];
        if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("difftx_kernels::cross_entropy: target {t} is outside the vocabulary of {vocab}");
        }
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(s1, l1, targets),
            DType::F64 => fwd_typed::<f64>(s1, l1, targets),
            dt => bail!("difftx-cross-entropy: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.to_dtype(logits.dtype())?.flatten_all()?;
        let dx = match logits.dtype() {
            DType::F32 => bwd_typed::<f32>(logits, targets, &grad)?,
            DType::F64 => bwd_typed::<f64>(logits, targets, &grad)?,
            dt => bail!("difftx-cross-entropy: unsupported dtype {dt:?}"),
        };
        Ok((Some(dx), None))
    }
}
