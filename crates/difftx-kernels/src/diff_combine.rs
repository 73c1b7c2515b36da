//! The differential combination of diff-v1: z = o1 - λ·o2 with a scalar λ, forward and backward
//! in one pass each (instead of a broadcast multiply, a broadcast subtract and their backward).
//!
//! Layout: `o1`, `o2`, `z` are row-major of one shape (any rank); `lambda` has one element.
//! Backward: do1 = dz,  do2 = -λ·dz,  dλ = -Σ dz·o2 (summed in fixed chunks, in order).

use crate::cpu::{storage_slice, with_slice};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const CHUNK: usize = 8192;

/// o1 - λ·o2 for a one-element λ, with backward for all three. f32 and f64, one dtype.
pub fn diff_combine(o1: &Tensor, o2: &Tensor, lambda: &Tensor) -> Result<Tensor> {
    match o1.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::diff_combine: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    if o1.dims() != o2.dims() || o1.dtype() != o2.dtype() || lambda.dtype() != o1.dtype() {
        bail!(
            "difftx_kernels::diff_combine: o1 {:?}, o2 {:?}, lambda {:?} must share shape (o1, o2) and dtype",
            o1.dims(),
            o2.dims(),
            lambda.dtype()
        );
    }
    if lambda.elem_count() != 1 {
        bail!("difftx_kernels::diff_combine: lambda must have one element, got shape {:?}", lambda.dims());
    }
    o1.contiguous()?.apply_op3(&o2.contiguous()?, &lambda.contiguous()?, DiffCombine)
}

struct DiffCombine;

pub(crate) fn diff_combine_fwd<T: Float>(o1: &[T], o2: &[T], lambda: T, z: &mut [T]) {
    z.par_chunks_mut(CHUNK).zip(o1.par_chunks(CHUNK).zip(o2.par_chunks(CHUNK))).for_each(|(z, (a, b))| {
        for ((o, &x), &y) in z.iter_mut().zip(a).zip(b) {
            *o = x - lambda * y;
        }
    });
}

/// One piece of the backward: writes `do2 = −λ·dz` and returns `Σ dz·o2` over the piece.
fn second_map_grad<T: Float>(o2: &[T], lambda: T, dz: &[T], do2: &mut [T]) -> T {
    let mut acc = T::ZERO;
    for ((o, &y), &gv) in do2.iter_mut().zip(o2).zip(dz) {
        *o = T::ZERO - lambda * gv;
        acc += gv * y;
    }
    acc
}

/// dλ = −Σ of the pieces' partial sums, added in order (deterministic at any thread count).
fn lambda_grad<T: Float>(parts: Vec<T>) -> T {
    let mut s = T::ZERO;
    for p in parts {
        s += p;
    }
    T::ZERO - s
}

/// Writes do2 and returns dλ; do1 is dz itself.
pub(crate) fn diff_combine_bwd<T: Float>(o2: &[T], lambda: T, dz: &[T], do2: &mut [T]) -> T {
    let parts: Vec<T> = do2
        .par_chunks_mut(CHUNK)
        .zip(o2.par_chunks(CHUNK).zip(dz.par_chunks(CHUNK)))
        .map(|(d2, (b, g))| second_map_grad(b, lambda, g, d2))
        .collect();
    lambda_grad(parts)
}

fn fwd_typed<T: Float>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let (a, b, lam) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?, storage_slice::<T>(s3, l3)?);
    let mut z = vec![T::ZERO; a.len()];
    diff_combine_fwd(a, b, lam[0], &mut z);
    Ok((T::to_cpu_storage_owned(z), l1.shape().clone()))
}

fn bwd_typed<T: Float>(o2: &Tensor, lambda: &Tensor, dz: &Tensor) -> Result<(Tensor, Tensor)> {
    let lam = with_slice::<T, _>(lambda, |l| Ok(l[0]))?;
    let (do2, dl) = with_slice::<T, _>(o2, |b| {
        with_slice::<T, _>(dz, |g| {
            let mut do2 = vec![T::ZERO; b.len()];
            let dl = diff_combine_bwd(b, lam, g, &mut do2);
            Ok((do2, dl))
        })
    })?;
    Ok((Tensor::from_vec(do2, o2.shape(), o2.device())?, Tensor::from_vec(vec![dl], lambda.shape(), lambda.device())?))
}

impl CustomOp3 for DiffCombine {
    fn name(&self) -> &'static str {
        "difftx-diff-combine"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(s1, l1, s2, l2, s3, l3),
            DType::F64 => fwd_typed::<f64>(s1, l1, s2, l2, s3, l3),
            dt => bail!("difftx-diff-combine: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        _o1: &Tensor,
        o2: &Tensor,
        lambda: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dz = grad_res.to_dtype(o2.dtype())?.contiguous()?;
        let (do2, dl) = match o2.dtype() {
            DType::F32 => bwd_typed::<f32>(o2, lambda, &dz)?,
            DType::F64 => bwd_typed::<f64>(o2, lambda, &dz)?,
            dt => bail!("difftx-diff-combine: unsupported dtype {dt:?}"),
        };
        Ok((Some(dz), Some(do2), Some(dl)))
    }
}

/// Where the two maps of each pair sit among the heads of a `[B, 2P, T, w]` tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairLayout {
    /// Pair j = heads (2j, 2j + 1).
    Interleaved,
    /// Pair j = heads (j, j + P).
    Halves,
}

/// The same combination read straight from one attention output holding both maps of every
/// pair: `x` `[B, 2P, T, w]` -> `z[b, j] = x[b, a(j)] − λ·x[b, b(j)]`, `[B, P, T, w]`, with the pairs
/// `(a(j), b(j))` of `layout`. No head is split or copied: viewed as `[outer, 2, inner]` (outer
/// = B·P and inner = T·w for interleaved pairs, outer = B and inner = P·T·w for halves), row `o`
/// of z is `x[o, 0] − λ·x[o, 1]`. Backward: dx[o, 0] = dz[o], dx[o, 1] = −λ·dz[o],
/// dλ = −Σ dz·x[·, 1] (per-row partial sums added in row order).
pub fn diff_combine_pairs(x: &Tensor, lambda: &Tensor, layout: PairLayout) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::diff_combine_pairs: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    let (b, heads, t, w) = x.dims4()?;
    if heads % 2 != 0 {
        bail!("difftx_kernels::diff_combine_pairs: {heads} heads cannot form pairs");
    }
    if lambda.elem_count() != 1 || lambda.dtype() != x.dtype() {
        bail!(
            "difftx_kernels::diff_combine_pairs: lambda must be one element of the input's dtype, got {:?} {:?}",
            lambda.dims(),
            lambda.dtype()
        );
    }
    let p = heads / 2;
    let (outer, inner) = match layout {
        PairLayout::Interleaved => (b * p, t * w),
        PairLayout::Halves => (b, p * t * w),
    };
    x.contiguous()?.apply_op2(&lambda.contiguous()?, DiffCombinePairs { outer, inner })?.reshape((b, p, t, w))
}

struct DiffCombinePairs {
    outer: usize,
    inner: usize,
}

fn pairs_fwd<T: Float>(x: &[T], lambda: T, inner: usize, z: &mut [T]) {
    z.par_chunks_mut(inner).zip(x.par_chunks(2 * inner)).for_each(|(zr, xr)| {
        let (a, b) = xr.split_at(inner);
        for ((o, &u), &v) in zr.iter_mut().zip(a).zip(b) {
            *o = u - lambda * v;
        }
    });
}

/// Writes dx and returns dλ.
fn pairs_bwd<T: Float>(x: &[T], lambda: T, inner: usize, dz: &[T], dx: &mut [T]) -> T {
    let parts: Vec<T> = dx
        .par_chunks_mut(2 * inner)
        .zip(x.par_chunks(2 * inner).zip(dz.par_chunks(inner)))
        .map(|(dr, (xr, g))| {
            let (da, db) = dr.split_at_mut(inner);
            da.copy_from_slice(g);
            second_map_grad(&xr[inner..], lambda, g, db)
        })
        .collect();
    lambda_grad(parts)
}

impl CustomOp2 for DiffCombinePairs {
    fn name(&self) -> &'static str {
        "difftx-diff-combine-pairs"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        fn typed<T: Float>(
            op: &DiffCombinePairs,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let (x, lam) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?);
            let mut z = vec![T::ZERO; op.outer * op.inner];
            pairs_fwd(x, lam[0], op.inner, &mut z);
            Ok((T::to_cpu_storage_owned(z), Shape::from_dims(&[op.outer * op.inner])))
        }
        match s1.dtype() {
            DType::F32 => typed::<f32>(self, s1, l1, s2, l2),
            DType::F64 => typed::<f64>(self, s1, l1, s2, l2),
            dt => bail!("difftx-diff-combine-pairs: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        lambda: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        fn typed<T: Float>(inner: usize, x: &Tensor, lambda: &Tensor, dz: &Tensor) -> Result<(Tensor, Tensor)> {
            let lam = with_slice::<T, _>(lambda, |l| Ok(l[0]))?;
            let (dx, dl) = with_slice::<T, _>(x, |xs| {
                with_slice::<T, _>(dz, |g| {
                    let mut dx = vec![T::ZERO; xs.len()];
                    let dl = pairs_bwd(xs, lam, inner, g, &mut dx);
                    Ok((dx, dl))
                })
            })?;
            Ok((
                Tensor::from_vec(dx, x.shape(), x.device())?,
                Tensor::from_vec(vec![dl], lambda.shape(), lambda.device())?,
            ))
        }
        let dz = grad_res.to_dtype(x.dtype())?.contiguous()?;
        let (dx, dl) = match x.dtype() {
            DType::F32 => typed::<f32>(self.inner, x, lambda, &dz)?,
            DType::F64 => typed::<f64>(self.inner, x, lambda, &dz)?,
            dt => bail!("difftx-diff-combine-pairs: unsupported dtype {dt:?}"),
        };
        Ok((Some(dx), Some(dl)))
    }
}
