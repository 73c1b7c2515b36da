//! RMSNorm over the last dimension, forward and backward, with an optional gain.
//!
//! Layout: `x`, `y`, `dy`, `dx` are row-major `[rows, n]`; `gain` and `dgain` are `[n]`.
//! Statistics are accumulated in the element type (f32 or f64), over 8 independent lanes.
//! Forward:  r = 1 / sqrt(mean(x^2) + eps),  u = x * r,  y = u * gain
//! Backward: gg = dy * gain,  dx = r * (gg - u * mean(gg * u)),  dgain = sum_rows(dy * u)

use crate::cpu::{as_uninit, min_rows, par_output_uninit, rows_cols, storage_slice, with_slice, zeros};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * gain (gain optional, shape [last_dim]).
/// Statistics computed in f32 at least (f64 for f64 input). Backward for x and gain.
pub fn rms_norm(x: &Tensor, gain: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::rms_norm: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    let (_, n) = rows_cols(x.dims())?;
    let x = x.contiguous()?;
    match gain {
        None => x.apply_op1(RmsNorm { eps }),
        Some(g) => {
            if g.dims() != [n] {
                bail!("difftx_kernels::rms_norm: gain shape {:?}, expected [{n}]", g.dims());
            }
            if g.dtype() != x.dtype() {
                bail!("difftx_kernels::rms_norm: gain dtype {:?} != x dtype {:?}", g.dtype(), x.dtype());
            }
            x.apply_op2(&g.contiguous()?, RmsNorm { eps })
        }
    }
}

struct RmsNorm {
    eps: f64,
}

/// Sum of squares over 8 lanes (vectorises; also a little more accurate than a serial sum).
#[inline(always)]
fn sum_sq<T: Float>(x: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    let mut s = T::ZERO;
    for &v in it.remainder() {
        s += v * v;
    }
    for a in acc {
        s += a;
    }
    s
}

#[inline(always)]
fn inv_rms<T: Float>(x: &[T], eps: T) -> T {
    let n = T::from_f64(x.len() as f64);
    T::ONE / (sum_sq(x) / n + eps).sqrt()
}

/// Forward kernel. `gain` is `None` or a slice of length `n`.
pub(crate) fn rms_norm_fwd<T: Float>(x: &[T], gain: Option<&[T]>, y: &mut [T], n: usize, eps: f64) {
    if n == 0 {
        return;
    }
    let eps = T::from_f64(eps);
    y.par_chunks_mut(n).zip(x.par_chunks(n)).with_min_len(min_rows(n, 8192)).for_each(|(yr, xr)| {
        // SAFETY: norm_row writes only initialised values.
        norm_row(xr, gain, eps, unsafe { as_uninit(yr) });
    });
}

/// The forward into a new buffer, written on the pool (see [`par_output_uninit`]).
fn rms_norm_fwd_new<T: Float>(x: &[T], gain: Option<&[T]>, n: usize, eps: f64) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    assert!(x.len().is_multiple_of(n) && gain.is_none_or(|g| g.len() == n), "rms_norm: rows of {n} and a gain of {n}");
    let (eps, rows) = (T::from_f64(eps), min_rows(n, 8192));
    // SAFETY: every chunk is whole rows of n (x.len() is a multiple of n, and so is the chunk),
    // and norm_row writes all n values of a row when the gain has n values.
    unsafe {
        par_output_uninit(x.len(), rows * n, |i, y| {
            for (yr, xr) in y.chunks_mut(n).zip(x[i * rows * n..].chunks(n)) {
                norm_row(xr, gain, eps, yr);
            }
        })
    }
}

/// One row `yr` = the row `xr` normalised (and scaled by `gain`): every value written when the
/// three are as long.
#[inline(always)]
fn norm_row<T: Float>(xr: &[T], gain: Option<&[T]>, eps: T, yr: &mut [MaybeUninit<T>]) {
    let r = inv_rms(xr, eps);
    match gain {
        Some(g) => {
            for ((o, &v), &gv) in yr.iter_mut().zip(xr).zip(g) {
                o.write(v * r * gv);
            }
        }
        None => {
            for (o, &v) in yr.iter_mut().zip(xr) {
                o.write(v * r);
            }
        }
    }
}

/// Backward kernel: writes `dx` and returns `dgain` (summed over rows) when `gain` is given.
pub(crate) fn rms_norm_bwd<T: Float>(
    x: &[T],
    gain: Option<&[T]>,
    dy: &[T],
    dx: &mut [T],
    n: usize,
    eps: f64,
) -> Option<Vec<T>> {
    if n == 0 {
        return gain.map(|_| Vec::new());
    }
    let eps_t = T::from_f64(eps);
    let inv_n = T::ONE / T::from_f64(n as f64);
    let partials = dx
        .par_chunks_mut(n)
        .zip(x.par_chunks(n).zip(dy.par_chunks(n)))
        .with_min_len(min_rows(n, 8192))
        .fold(
            || gain.map(|_| vec![T::ZERO; n]),
            |mut dg, (dxr, (xr, gr))| {
                let r = inv_rms(xr, eps_t);
                // c = mean(dy * gain * u), u = x * r
                let mut c = T::ZERO;
                match gain {
                    Some(g) => {
                        for ((&xv, &gv), &w) in xr.iter().zip(gr).zip(g) {
                            c += gv * w * xv;
                        }
                    }
                    None => {
                        for (&xv, &gv) in xr.iter().zip(gr) {
                            c += gv * xv;
                        }
                    }
                }
                c = c * r * inv_n;
                match (gain, dg.as_mut()) {
                    (Some(g), Some(dg)) => {
                        for ((((o, &xv), &gv), &w), d) in dxr.iter_mut().zip(xr).zip(gr).zip(g).zip(dg.iter_mut()) {
                            let u = xv * r;
                            *o = r * (gv * w - u * c);
                            *d += gv * u;
                        }
                    }
                    _ => {
                        for ((o, &xv), &gv) in dxr.iter_mut().zip(xr).zip(gr) {
                            *o = r * (gv - xv * r * c);
                        }
                    }
                }
                dg
            },
        )
        .reduce(
            || gain.map(|_| vec![T::ZERO; n]),
            |a, b| match (a, b) {
                (Some(mut a), Some(b)) => {
                    for (x, y) in a.iter_mut().zip(b) {
                        *x += y;
                    }
                    Some(a)
                }
                _ => None,
            },
        );
    partials
}

fn fwd_typed<T: Float>(
    s: &CpuStorage,
    l: &Layout,
    g: Option<(&CpuStorage, &Layout)>,
    eps: f64,
) -> Result<(CpuStorage, Shape)> {
    let x = storage_slice::<T>(s, l)?;
    let (_, n) = rows_cols(l.dims())?;
    let gain = match g {
        Some((gs, gl)) => Some(storage_slice::<T>(gs, gl)?),
        None => None,
    };
    let y = rms_norm_fwd_new(x, gain, n, eps);
    Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
}

fn bwd_typed<T: Float>(x: &Tensor, gain: Option<&Tensor>, grad: &Tensor, eps: f64) -> Result<(Tensor, Option<Tensor>)> {
    let (_, n) = rows_cols(x.dims())?;
    let run = |g: Option<&[T]>| -> Result<(Vec<T>, Option<Vec<T>>)> {
        with_slice::<T, _>(x, |xs| {
            with_slice::<T, _>(grad, |gr| {
                let mut dx = zeros::<T>(xs.len());
                let dg = rms_norm_bwd(xs, g, gr, &mut dx, n, eps);
                Ok((dx, dg))
            })
        })
    };
    let (dx, dg) = match gain {
        Some(g) => with_slice::<T, _>(g, |gs| run(Some(gs)))?,
        None => run(None)?,
    };
    let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
    let dg = match dg {
        Some(dg) => Some(Tensor::from_vec(dg, n, x.device())?),
        None => None,
    };
    Ok((dx, dg))
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "difftx-rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s.dtype() {
            DType::F32 => fwd_typed::<f32>(s, l, None, self.eps),
            DType::F64 => fwd_typed::<f64>(s, l, None, self.eps),
            dt => bail!("difftx-rms-norm: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad_res.to_dtype(arg.dtype())?;
        let (dx, _) = match arg.dtype() {
            DType::F32 => bwd_typed::<f32>(arg, None, &grad, self.eps)?,
            DType::F64 => bwd_typed::<f64>(arg, None, &grad, self.eps)?,
            dt => bail!("difftx-rms-norm: unsupported dtype {dt:?}"),
        };
        Ok(Some(dx))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "difftx-rms-norm-gain"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(s1, l1, Some((s2, l2)), self.eps),
            DType::F64 => fwd_typed::<f64>(s1, l1, Some((s2, l2)), self.eps),
            dt => bail!("difftx-rms-norm: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.to_dtype(x.dtype())?;
        let (dx, dg) = match x.dtype() {
            DType::F32 => bwd_typed::<f32>(x, Some(gain), &grad, self.eps)?,
            DType::F64 => bwd_typed::<f64>(x, Some(gain), &grad, self.eps)?,
            dt => bail!("difftx-rms-norm: unsupported dtype {dt:?}"),
        };
        Ok((Some(dx), dg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The op's forward (its own buffer, chunks of rows) gives the decoder's kernel's bits, with
    /// and without a gain, on row counts that do not fill the last chunk.
    #[test]
    fn new_buffer_forward_equals_the_kernel() {
        for (rows, n) in [(1, 5), (37, 256), (100, 7), (3, 8192)] {
            let x: Vec<f32> = (0..rows * n).map(|i| (i as f32 * 0.37).sin()).collect();
            let g: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.11).cos()).collect();
            for gain in [None, Some(&g[..])] {
                let mut want = vec![0.0; x.len()];
                rms_norm_fwd(&x, gain, &mut want, n, 1e-6);
                assert_eq!(rms_norm_fwd_new(&x, gain, n, 1e-6), want, "rows {rows} n {n}");
            }
        }
    }
}
