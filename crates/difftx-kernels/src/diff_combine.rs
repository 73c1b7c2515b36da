//! The differential combination of diff-v1: z = o1 - λ·o2 with a scalar λ, forward and backward
//! in one pass each (instead of a broadcast multiply, a broadcast subtract and their backward).
//!
//! Layout: `o1`, `o2`, `z` are row-major of one shape (any rank); `lambda` has one element.
//! Backward: do1 = dz,  do2 = -λ·dz,  dλ = -Σ dz·o2 (summed in fixed chunks, in order).

use crate::cpu::{storage_slice, with_slice};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
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

/// Writes do2 and returns dλ; do1 is dz itself.
pub(crate) fn diff_combine_bwd<T: Float>(o2: &[T], lambda: T, dz: &[T], do2: &mut [T]) -> T {
    let parts: Vec<T> = do2
        .par_chunks_mut(CHUNK)
        .zip(o2.par_chunks(CHUNK).zip(dz.par_chunks(CHUNK)))
        .map(|(d2, (b, g))| {
            let mut acc = T::ZERO;
            for ((o, &y), &gv) in d2.iter_mut().zip(b).zip(g) {
                *o = T::ZERO - lambda * gv;
                acc += gv * y;
            }
            acc
        })
        .collect();
    let mut s = T::ZERO;
    for p in parts {
        s += p;
    }
    T::ZERO - s
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
