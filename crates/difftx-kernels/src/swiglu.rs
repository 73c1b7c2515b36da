//! SwiGLU gate: h = silu(g) · u, forward and backward, one pass each.
//!
//! Layout: `g`, `u`, `h` (and their gradients) are row-major with identical shapes.
//! With s = sigmoid(g) = 1 / (1 + exp(-g)):
//!   h  = g·s·u
//!   dg = dh·u·s·(1 + g·(1 - s)),   du = dh·g·s

use crate::cpu::{par_output2_uninit, par_output_uninit, storage_slice, with_slice, BEST_ISA};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::mem::MaybeUninit;

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

/// `h = silu(g)·u` over one chunk (every value of `h` written; g, u and h of one length).
#[inline(always)]
fn fwd_chunk<T: Float>(g: &[T], u: &[T], h: &mut [MaybeUninit<T>]) {
    for ((o, &gv), &uv) in h.iter_mut().zip(g).zip(u) {
        o.write(gv * sigmoid(gv) * uv);
    }
}

/// `dg`, `du` over one chunk (every value written; all slices of one length).
#[inline(always)]
fn bwd_chunk<T: Float>(g: &[T], u: &[T], dh: &[T], dg: &mut [MaybeUninit<T>], du: &mut [MaybeUninit<T>]) {
    for ((((a, b), &gv), &uv), &d) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(dh) {
        let s = sigmoid(gv);
        a.write(d * uv * s * (T::ONE + gv * (T::ONE - s)));
        b.write(d * gv * s);
    }
}

/// The chunk loops compiled for AVX2 and AVX-512 as well as for the baseline x86-64 (SSE2):
/// plain code is built for the latter, where the sigmoid's exp runs four lanes at a time. The
/// same operations in the same order at every level (no fused multiply-adds), so the same bits.
mod simd {
    use super::*;

    pub(super) type FwdFn<T> = fn(&[T], &[T], &mut [MaybeUninit<T>]);
    pub(super) type BwdFn<T> = fn(&[T], &[T], &[T], &mut [MaybeUninit<T>], &mut [MaybeUninit<T>]);

    macro_rules! variants {
        ($feat:literal, $fwd:ident, $bwd:ident) => {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $fwd<T: Float>(g: &[T], u: &[T], h: &mut [MaybeUninit<T>]) {
                fwd_chunk(g, u, h)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feat)]
            unsafe fn $bwd<T: Float>(g: &[T], u: &[T], dh: &[T], dg: &mut [MaybeUninit<T>], du: &mut [MaybeUninit<T>]) {
                bwd_chunk(g, u, dh, dg, du)
            }
        };
    }
    variants!("avx2,fma", fwd_avx2, bwd_avx2);
    variants!("avx512f,avx2,fma", fwd_avx512, bwd_avx512);

    /// The chunk loops for the best instruction set this CPU has, capped at `max`.
    pub(super) fn pick<T: Float>(max: u8) -> (FwdFn<T>, BwdFn<T>) {
        match crate::cpu::isa_level(max) {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            #[cfg(target_arch = "x86_64")]
            2 => (|g, u, h| unsafe { fwd_avx512(g, u, h) }, |g, u, dh, dg, du| unsafe { bwd_avx512(g, u, dh, dg, du) }),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            1 => (|g, u, h| unsafe { fwd_avx2(g, u, h) }, |g, u, dh, dg, du| unsafe { bwd_avx2(g, u, dh, dg, du) }),
            _ => (fwd_chunk, bwd_chunk),
        }
    }
}

/// `h = silu(g) ∘ u`, written on the pool in chunks of `CHUNK`.
pub(crate) fn swiglu_fwd<T: Float>(g: &[T], u: &[T]) -> Vec<T> {
    swiglu_fwd_at(BEST_ISA, g, u)
}

fn swiglu_fwd_at<T: Float>(isa: u8, g: &[T], u: &[T]) -> Vec<T> {
    assert_eq!(g.len(), u.len(), "swiglu: gate and up lengths");
    let (chunk, _) = simd::pick::<T>(isa);
    // SAFETY: g and u are as long as the output, so the chunk loop writes every value of h.
    unsafe {
        par_output_uninit(g.len(), CHUNK, |i, h| {
            let r = i * CHUNK..i * CHUNK + h.len();
            chunk(&g[r.clone()], &u[r], h)
        })
    }
}

/// `(dg, du)` from `dh`, written on the pool in chunks of `CHUNK`.
pub(crate) fn swiglu_bwd<T: Float>(g: &[T], u: &[T], dh: &[T]) -> (Vec<T>, Vec<T>) {
    swiglu_bwd_at(BEST_ISA, g, u, dh)
}

fn swiglu_bwd_at<T: Float>(isa: u8, g: &[T], u: &[T], dh: &[T]) -> (Vec<T>, Vec<T>) {
    assert!(u.len() == g.len() && dh.len() == g.len(), "swiglu: gate, up and gradient lengths");
    let (_, chunk) = simd::pick::<T>(isa);
    // SAFETY: g, u and dh are as long as the outputs, so the chunk loop writes every value.
    unsafe {
        par_output2_uninit(g.len(), CHUNK, |i, dg, du| {
            let r = i * CHUNK..i * CHUNK + dg.len();
            chunk(&g[r.clone()], &u[r.clone()], &dh[r], dg, du)
        })
    }
}

fn fwd_typed<T: Float>(s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
    let (g, u) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?);
    let h = swiglu_fwd(g, u);
    Ok((T::to_cpu_storage_owned(h), l1.shape().clone()))
}

fn bwd_typed<T: Float>(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor)> {
    let (dg, du) = with_slice::<T, _>(g, |gs| {
        with_slice::<T, _>(u, |us| with_slice::<T, _>(dh, |ds| Ok(swiglu_bwd(gs, us, ds))))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction-set level gives the baseline level's bits (the same operations in the
    /// same order), forward and backward, on a length that is not a multiple of the lanes or
    /// of the chunk, in f32 and f64.
    #[test]
    fn every_isa_level_gives_the_same_bits() {
        fn check<T: Float + std::fmt::Debug>(from: impl Fn(f64) -> T) {
            let n = CHUNK + 37;
            let gen = |p: f64| -> Vec<T> { (0..n).map(|i| from((i as f64 * 0.37 + p).sin() * 9.0)).collect() };
            let (g, u, dh) = (gen(0.1), gen(0.2), gen(0.3));
            let run = |isa: u8| {
                let h = swiglu_fwd_at(isa, &g, &u);
                let (dg, du) = swiglu_bwd_at(isa, &g, &u, &dh);
                [h, dg, du]
            };
            let base = run(0);
            for isa in 1..=BEST_ISA {
                assert_eq!(run(isa), base, "isa {isa}");
            }
        }
        check(|x| x as f32);
        check(|x| x);
    }
}
