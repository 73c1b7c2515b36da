//! Swapping the two middle dimensions of a 4-D tensor (`[B, T, H, d]` ↔ `[B, H, T, d]`, the
//! projections' and the attention kernels' layouts) as one parallel copy, backward the same swap
//! of the gradient. candle's `transpose(1, 2)?.contiguous()` copies on the calling thread, one
//! `d`-element `memcpy` at a time.

use crate::cpu::{min_rows, par_output_uninit, position_rows, positions_readable, with_slice};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// `x.transpose(1, 2)?.contiguous()` for x `[B, N1, N2, d]`: `[B, N2, N1, d]`, with backward.
/// f32 and f64. x may be heads narrowed out of a wider `[B, N1, N2', d]` (read in place).
pub fn swap_dims12(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::swap_dims12: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    x.dims4()?;
    positions_readable(x)?.apply_op1(SwapDims12)
}

/// The input row (of `d` values) that row `r` of the swapped output `[B, n2, n1]` comes from,
/// the input being `[B, n1, n2]`; with it, the index along `n1` and along `n2`.
#[inline(always)]
pub(crate) fn swapped_row(r: usize, n1: usize, n2: usize) -> (usize, usize, usize) {
    // r = (b·n2 + j)·n1 + i
    let (i, bj) = (r % n1, r / n1);
    let (j, b) = (bj % n2, bj / n2);
    ((b * n1 + i) * n2 + j, i, j)
}

/// `x` `[B, n1, n2, d]`, its `(b, n1)` rows of `n2·d` values `stride` apart (`n2·d` when
/// contiguous), into a new `[B, n2, n1, d]` buffer, written on the pool (see
/// [`par_output_uninit`]).
fn swap<T: Float>(x: &[T], (b, n1, n2, d): (usize, usize, usize, usize), stride: usize) -> Vec<T> {
    let len = b * n1 * n2 * d;
    if len == 0 {
        return Vec::new();
    }
    assert!(stride >= n2 * d && x.len() >= (b * n1 - 1) * stride + n2 * d, "swap_dims12: {} values", x.len());
    let rows = min_rows(d, 8192);
    // SAFETY: every chunk is whole rows of d (len and the chunk are multiples of d), and each
    // row is written whole from its source row.
    unsafe {
        par_output_uninit(len, rows * d, |c, y| {
            for (k, yr) in y.chunks_mut(d).enumerate() {
                // input row (b·n1 + i, j): `stride` per (b, i), d per j
                let (src, _, j) = swapped_row(c * rows + k, n1, n2);
                let at = (src / n2) * stride + j * d;
                yr.write_copy_of_slice(&x[at..at + d]);
            }
        })
    }
}

struct SwapDims12;

fn fwd_typed<T: Float>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let Some((x, stride)) = position_rows::<T>(s, l)? else {
        bail!("difftx-swap-dims12: x must be contiguous or heads narrowed out of a wider row, got {l:?}")
    };
    let (b, n1, n2, d) = l.shape().dims4()?;
    Ok((T::to_cpu_storage_owned(swap(x, (b, n1, n2, d), stride)), Shape::from_dims(&[b, n2, n1, d])))
}

impl CustomOp1 for SwapDims12 {
    fn name(&self) -> &'static str {
        "difftx-swap-dims12"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s.dtype() {
            DType::F32 => fwd_typed::<f32>(s, l),
            DType::F64 => fwd_typed::<f64>(s, l),
            dt => bail!("difftx-swap-dims12: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (b, n1, n2, d) = arg.dims4()?;
        let g = grad_res.to_dtype(arg.dtype())?;
        let dx = match arg.dtype() {
            DType::F32 => with_slice::<f32, _>(&g, |gs| {
                Tensor::from_vec(swap(gs, (b, n2, n1, d), n1 * d), (b, n1, n2, d), arg.device())
            })?,
            DType::F64 => with_slice::<f64, _>(&g, |gs| {
                Tensor::from_vec(swap(gs, (b, n2, n1, d), n1 * d), (b, n1, n2, d), arg.device())
            })?,
            dt => bail!("difftx-swap-dims12: unsupported dtype {dt:?}"),
        };
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The values of candle's `transpose(1, 2)?.contiguous()`, forward and backward, on shapes
    /// whose rows do not fill the last chunk; other ranks and dtypes are errors.
    #[test]
    fn equals_candle_transpose_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            for (b, n1, n2, d) in [(1, 1, 1, 1), (2, 3, 5, 7), (3, 300, 4, 32), (2, 8, 257, 16), (1, 0, 3, 2)] {
                let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, (b, n1, n2, d), &dev)?.to_dtype(dt)?)?;
                let w = Tensor::randn(0f64, 1.0, (b, n2, n1, d), &dev)?.to_dtype(dt)?;
                let ours = swap_dims12(x.as_tensor())?;
                let theirs = x.as_tensor().transpose(1, 2)?.contiguous()?;
                let flat = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                assert_eq!(ours.dims(), theirs.dims());
                assert_eq!(flat(&ours)?, flat(&theirs)?, "{dt:?} {:?}", (b, n1, n2, d));
                let go = (&ours * &w)?.sum_all()?.backward()?;
                let gt = (&theirs * &w)?.sum_all()?.backward()?;
                let (go, gt) = (go.get(x.as_tensor()).unwrap(), gt.get(x.as_tensor()).unwrap());
                assert_eq!(flat(go)?, flat(gt)?, "{dt:?} {:?} backward", (b, n1, n2, d));
            }
        }
        assert!(swap_dims12(&Tensor::zeros((2, 3, 4), DType::F32, &dev)?).is_err(), "rank 3");
        assert!(swap_dims12(&Tensor::zeros((1, 2, 3, 4), DType::U32, &dev)?).is_err(), "dtype");
        Ok(())
    }
}
