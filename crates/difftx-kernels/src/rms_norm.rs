//! RMSNorm over the last dimension, forward and backward, with an optional gain.
//!
//! Layout: `x`, `y`, `dy`, `dx` are row-major `[rows, n]`; `gain` and `dgain` are `[n]`.
//! Statistics are accumulated in the element type (f32 or f64), over 8 independent lanes.
//! Forward:  r = 1 / sqrt(mean(x^2) + eps),  u = x * r,  y = u * gain
//! Backward: gg = dy * gain,  dx = r * (gg - u * mean(gg * u)),  dgain = sum_rows(dy * u)

use crate::cpu::{as_uninit, min_rows, par_output_uninit, rows_cols, storage_slice, with_slice, BEST_ISA};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * gain (gain optional, shape `[last_dim]`).
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

/// Forward kernel on the calling thread (the fused decoder splits its passes itself; training
/// goes through [`rms_norm_fwd_new`] on the pool). `gain` is `None` or a slice of length `n`.
pub(crate) fn rms_norm_fwd<T: Float>(x: &[T], gain: Option<&[T]>, y: &mut [T], n: usize, eps: f64) {
    if n == 0 {
        return;
    }
    let (eps, (fwd_rows, _)) = (T::from_f64(eps), simd::pick::<T>(BEST_ISA));
    // SAFETY: the row loop writes only initialised values.
    fwd_rows(&RowsIn { x, gain, eps, n }, unsafe { as_uninit(y) });
}

/// The forward into a new buffer, written on the pool (see [`par_output_uninit`]).
fn rms_norm_fwd_new<T: Float>(x: &[T], gain: Option<&[T]>, n: usize, eps: f64) -> Vec<T> {
    rms_norm_fwd_new_at(BEST_ISA, x, gain, n, eps)
}

/// [`rms_norm_fwd_new`] with the row loop for instruction-set level `isa` at most.
fn rms_norm_fwd_new_at<T: Float>(isa: u8, x: &[T], gain: Option<&[T]>, n: usize, eps: f64) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    assert!(x.len().is_multiple_of(n) && gain.is_none_or(|g| g.len() == n), "rms_norm: rows of {n} and a gain of {n}");
    let (eps, rows, (fwd_rows, _)) = (T::from_f64(eps), min_rows(n, 8192), simd::pick::<T>(isa));
    // SAFETY: every chunk is whole rows of n (x.len() is a multiple of n, and so is the chunk),
    // and the row loop writes all n values of each row when the gain has n values.
    unsafe {
        par_output_uninit(x.len(), rows * n, |i, y| {
            fwd_rows(&RowsIn { x: &x[i * rows * n..][..y.len()], gain, eps, n }, y)
        })
    }
}

/// What the row loops read besides the gradient: whole rows of `n` values of x, the gain, eps.
struct RowsIn<'a, T> {
    x: &'a [T],
    gain: Option<&'a [T]>,
    eps: T,
    n: usize,
}

/// Rows of n of the forward: each row of `y` (as many values as `x`) from its row of `x`.
#[inline(always)]
fn fwd_rows<T: Float>(r: &RowsIn<T>, y: &mut [MaybeUninit<T>]) {
    for (yr, xr) in y.chunks_mut(r.n).zip(r.x.chunks(r.n)) {
        norm_row(xr, r.gain, r.eps, yr);
    }
}

/// Rows of n of the backward: each row of `dx` (as many values as `x` and `dy`) from its rows of
/// `x` and `dy`; with a gain, each row's `dy ∘ u` is added into `dg`.
#[inline(always)]
fn bwd_rows<T: Float>(rows: &RowsIn<T>, dy: &[T], dx: &mut [MaybeUninit<T>], mut dg: Option<&mut [T]>) {
    let &RowsIn { x, gain, eps, n } = rows;
    let inv_n = T::ONE / T::from_f64(n as f64);
    for ((dxr, xr), gr) in dx.chunks_mut(n).zip(x.chunks(n)).zip(dy.chunks(n)) {
        let r = inv_rms(xr, eps);
        // c = mean(dy * gain * u), u = x * r
        let c = match gain {
            Some(g) => sum_products(xr, |k| gr[k] * g[k]),
            None => sum_products(xr, |k| gr[k]),
        } * r
            * inv_n;
        match (gain, dg.as_deref_mut()) {
            (Some(g), Some(dg)) => {
                for ((((o, &xv), &gv), &w), d) in dxr.iter_mut().zip(xr).zip(gr).zip(g).zip(dg.iter_mut()) {
                    let u = xv * r;
                    o.write(r * (gv * w - u * c));
                    *d += gv * u;
                }
            }
            _ => {
                for ((o, &xv), &gv) in dxr.iter_mut().zip(xr).zip(gr) {
                    o.write(r * (gv - xv * r * c));
                }
            }
        }
    }
}

/// `Σ_k f(k)·x[k]` over 8 lanes, like [`sum_sq`] (a serial sum did not vectorise: one dependent
/// add per value).
#[inline(always)]
fn sum_products<T: Float>(x: &[T], f: impl Fn(usize) -> T) -> T {
    let mut acc = [T::ZERO; 8];
    let whole = x.len() / 8 * 8;
    for k0 in (0..whole).step_by(8) {
        for k in 0..8 {
            acc[k] += f(k0 + k) * x[k0 + k];
        }
    }
    let mut s = T::ZERO;
    for (k, &v) in x.iter().enumerate().skip(whole) {
        s += f(k) * v;
    }
    for a in acc {
        s += a;
    }
    s
}

/// The row loops compiled for each instruction set (the crate is built for baseline x86-64).
mod simd {
    use super::*;

    pub(super) type FwdFn<T> = fn(&RowsIn<T>, &mut [MaybeUninit<T>]);
    pub(super) type BwdFn<T> = fn(&RowsIn<T>, &[T], &mut [MaybeUninit<T>], Option<&mut [T]>);

    macro_rules! variants {
        ($feat:literal, $fwd:ident, $bwd:ident) => {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $fwd<T: Float>(rows: &RowsIn<T>, y: &mut [MaybeUninit<T>]) {
                fwd_rows(rows, y)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $bwd<T: Float>(rows: &RowsIn<T>, dy: &[T], dx: &mut [MaybeUninit<T>], dg: Option<&mut [T]>) {
                bwd_rows(rows, dy, dx, dg)
            }
        };
    }
    variants!("avx2,fma", fwd_avx2, bwd_avx2);
    variants!("avx512f,avx2,fma", fwd_avx512, bwd_avx512);

    /// The row loops for the best instruction set this CPU has, capped at `max`.
    pub(super) fn pick<T: Float>(max: u8) -> (FwdFn<T>, BwdFn<T>) {
        match crate::cpu::isa_level(max) {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            #[cfg(target_arch = "x86_64")]
            2 => (|r, y| unsafe { fwd_avx512(r, y) }, |r, dy, dx, dg| unsafe { bwd_avx512(r, dy, dx, dg) }),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            1 => (|r, y| unsafe { fwd_avx2(r, y) }, |r, dy, dx, dg| unsafe { bwd_avx2(r, dy, dx, dg) }),
            _ => (fwd_rows, bwd_rows),
        }
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

/// Backward kernel: `dx` (a new buffer, written on the pool) and, when `gain` is given,
/// `dgain` (summed over rows: each chunk of rows' part, then the parts in order).
/// The row loop is the one for instruction-set level `isa` at most.
fn rms_norm_bwd<T: Float>(
    isa: u8,
    x: &[T],
    gain: Option<&[T]>,
    dy: &[T],
    n: usize,
    eps: f64,
) -> (Vec<T>, Option<Vec<T>>) {
    if n == 0 {
        return (Vec::new(), gain.map(|_| Vec::new()));
    }
    assert!(
        x.len().is_multiple_of(n) && dy.len() == x.len() && gain.is_none_or(|g| g.len() == n),
        "rms_norm: rows of {n}, a gradient as long as x and a gain of {n}"
    );
    let (eps, rows, (_, bwd_rows)) = (T::from_f64(eps), min_rows(n, 8192), simd::pick::<T>(isa));
    let mut dx = Vec::with_capacity(x.len());
    let parts: Vec<Option<Vec<T>>> = dx.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(rows * n)
        .zip(x.par_chunks(rows * n).zip(dy.par_chunks(rows * n)))
        .map(|(dxc, (xc, gc))| {
            let mut dg = gain.map(|_| vec![T::ZERO; n]);
            bwd_rows(&RowsIn { x: xc, gain, eps, n }, gc, dxc, dg.as_deref_mut());
            dg
        })
        .collect();
    // SAFETY: the chunks cover dx's x.len() values in whole rows of n (asserted lengths), and
    // the row loop writes every value of each row.
    unsafe { dx.set_len(x.len()) };
    let dg = gain.map(|_| {
        let mut dg = vec![T::ZERO; n];
        for part in parts.iter().flatten() {
            for (d, &p) in dg.iter_mut().zip(part) {
                *d += p;
            }
        }
        dg
    });
    (dx, dg)
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
        with_slice::<T, _>(x, |xs| with_slice::<T, _>(grad, |gr| Ok(rms_norm_bwd(BEST_ISA, xs, g, gr, n, eps))))
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

    /// The row loops compiled for each instruction set give the same bits (no FMA contraction:
    /// the same operations in the same order), forward and backward, with and without a gain,
    /// on row counts that do not fill the last chunk and rows that do not fill the 8 lanes.
    #[test]
    fn every_isa_level_gives_the_same_bits() {
        fn check<T: Float + std::fmt::Debug>(from: impl Fn(f64) -> T) {
            for (rows, n) in [(1, 5), (37, 256), (100, 7), (3, 8192)] {
                let x: Vec<T> = (0..rows * n).map(|i| from((i as f64 * 0.37).sin())).collect();
                let dy: Vec<T> = (0..rows * n).map(|i| from((i as f64 * 0.23).cos())).collect();
                let g: Vec<T> = (0..n).map(|i| from(1.0 + (i as f64 * 0.11).cos())).collect();
                for gain in [None, Some(&g[..])] {
                    let run =
                        |isa| (rms_norm_fwd_new_at(isa, &x, gain, n, 1e-6), rms_norm_bwd(isa, &x, gain, &dy, n, 1e-6));
                    let base = run(0);
                    for isa in 1..=BEST_ISA {
                        assert!(run(isa) == base, "isa {isa}, rows {rows} n {n}, gain {}", gain.is_some());
                    }
                }
            }
        }
        check(|v| v as f32);
        check(|v| v);
    }

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
