//! SwiGLU gate: h = silu(g) · u, forward and backward, one pass each.
//!
//! Layout: `g`, `u`, `h` (and their gradients) are row-major with identical shapes.
//! With s = sigmoid(g) = 1 / (1 + exp(-g)):
//!   h  = g·s·u
//!   dg = dh·u·s·(1 + g·(1 - s)),   du = dh·g·s

use crate::cpu::{storage_slice, with_slice};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const CHUNK: usize = 8192;

/// silu(gate) · up with backward for both. f32 and f64; gate and up of one shape and dtype.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    match gate.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::swiglu: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "difftx_kernels::swiglu: gate {:?} {:?} and up {:?} {:?} differ",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        );
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid<T: Float>(x: T) -> T {
    T::ONE / (T::ONE + (T::ZERO - x).exp())
}

pub(crate) fn swiglu_fwd<T: Float>(g: &[T], u: &[T], h: &mut [T]) {
    h.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK))).for_each(|(h, (g, u))| {
        for ((o, &gv), &uv) in h.iter_mut().zip(g).zip(u) {
            *o = gv * sigmoid(gv) * uv;
        }
    });
}

pub(crate) fn swiglu_bwd<T: Float>(g: &[T], u: &[T], dh: &[T], dg: &mut [T], du: &mut [T]) {
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(dh.par_chunks(CHUNK)))
        .for_each(|((dg, du), ((g, u), dh))| {
            for ((((a, b), &gv), &uv), &d) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(dh) {
                let s = sigmoid(gv);
                *a = d * uv * s * (T::ONE + gv * (T::ONE - s));
                *b = d * gv * s;
            }
        });
}

fn fwd_typed<T: Float>(s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
    let (g, u) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?);
    let mut h = vec![T::ZERO; g.len()];
    swiglu_fwd(g, u, &mut h);
    Ok((T::to_cpu_storage_owned(h), l1.shape().clone()))
}

fn bwd_typed<T: Float>(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor)> {
    let (dg, du) = with_slice::<T, _>(g, |gs| {
        with_slice::<T, _>(u, |us| {
            with_slice::<T, _>(dh, |ds| {
                let mut dg = vec![T::ZERO; gs.len()];
                let mut du = vec![T::ZERO; gs.len()];
                swiglu_bwd(gs, us, ds, &mut dg, &mut du);
                Ok((dg, du))
            })
        })
    })?;
    Ok((Tensor::from_vec(dg, g.shape(), g.device())?, Tensor::from_vec(du, g.shape(), g.device())?))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "difftx-swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(s1, l1, s2, l2),
            DType::F64 => fwd_typed::<f64>(s1, l1, s2, l2),
            dt => bail!("difftx-swiglu: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dh = grad_res.to_dtype(g.dtype())?;
        let (dg, du) = match g.dtype() {
            DType::F32 => bwd_typed::<f32>(g, u, &dh)?,
            DType::F64 => bwd_typed::<f64>(g, u, &dh)?,
            dt => bail!("difftx-swiglu: unsupported dtype {dt:?}"),
        };
        Ok((Some(dg), Some(du)))
    }
}
