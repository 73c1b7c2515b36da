//! The linear layers' product `y = x·wᵀ` (x `[N, in]`, w `[out, in]`, y `[N, out]`) with a
//! backward that writes `dw` in w's own layout.
//!
//! candle's `x.matmul(&w.t())` gets the weight's gradient as `xᵀ·dy` (`[in, out]`) and then
//! through the transpose's backward as a strided view of it, which its gradient store copies
//! element by element into a contiguous `[out, in]` (~1.5% of a bench-s training step). Here
//! `dw = dyᵀ·x` is computed straight into `[out, in]` (gemm reads the transposed operand by
//! strides; the sum over tokens split into parts, see [`weight_grad`]) and `dx = dy·w` is
//! candle's product; the forward is the same gemm product candle runs.

use crate::cpu::{storage_slice, with_slice};
use crate::float::Float;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `x·wᵀ` for x `[.., in]` and w `[out, in]`: `[.., out]`, with backward for both. f32 and f64.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::linear: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    if w.dtype() != x.dtype() {
        bail!("difftx_kernels::linear: x is {:?} but w is {:?}", x.dtype(), w.dtype());
    }
    let (out, inp) = w.dims2()?;
    let dims = x.dims();
    match dims.last() {
        Some(&n) if dims.len() >= 2 && n == inp => {}
        _ => {
            bail!("difftx_kernels::linear: x {dims:?} does not end in the weight's input size {inp} (w [{out}, {inp}])")
        }
    }
    let rows = x.elem_count() / inp.max(1);
    let mut y_dims = dims.to_vec();
    *y_dims.last_mut().expect("rank >= 2") = out;
    x.contiguous()?.reshape((rows, inp))?.apply_op2(&w.contiguous()?, Linear)?.reshape(y_dims)
}

struct Linear;

/// `y = x·wᵀ`: x `[m, k]`, w `[n, k]`, y `[m, n]`, on the pool.
fn forward<T: Float>(x: &[T], w: &[T], m: usize, n: usize, k: usize) -> Vec<T> {
    let mut y: Vec<T> = Vec::with_capacity(m * n);
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    if m > 0 && n > 0 {
        // SAFETY: x holds m·k values (row-major), w n·k (read as wᵀ) and y's buffer m·n
        // (asserted by the caller's shapes); `product_into` writes every element of y, so the
        // length is set after it.
        unsafe {
            product_into(y.as_mut_ptr(), (m, n, k), (x.as_ptr(), k, 1), (w.as_ptr(), 1, k), parallelism);
            y.set_len(m * n);
        }
    }
    y
}

/// `dst = A·B` (`m×n`, row-major, overwritten) by gemm, A `m×k` and B `k×n` given as
/// `(pointer, row stride, column stride)`.
///
/// # Safety
/// `dst` must hold m·n values and each view lie inside its data. With `read_dst` false gemm
/// writes every element of dst (k = 0 included: zeros; vendor/README.md lists its paths).
unsafe fn product_into<T: Float>(
    dst: *mut T,
    (m, n, k): (usize, usize, usize),
    (a, a_rs, a_cs): (*const T, usize, usize),
    (b, b_rs, b_cs): (*const T, usize, usize),
    parallelism: gemm::Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        n as isize,
        false,
        a,
        a_cs as isize,
        a_rs as isize,
        b,
        b_cs as isize,
        b_rs as isize,
        T::ZERO,
        T::ONE,
        false,
        false,
        false,
        parallelism,
    )
}

/// Tokens per part of [`weight_grad`]'s sum (bench-s: 2048 tokens in 4 parts).
const WEIGHT_GRAD_PART: usize = 512;

/// Output values per task of the parts' sum.
const SUM_CHUNK: usize = 1 << 14;

/// `dw = dyᵀ·x` (`[n, k]`, row-major) for dy `[m, n]` and x `[m, k]`. The sum over the m tokens
/// is split into parts of [`WEIGHT_GRAD_PART`] tokens, each one single-threaded gemm on the pool
/// into its own buffer, and the parts are then added in order (so the bits do not depend on the
/// number of threads). gemm threading one long product splits the small `[n, k]` output and
/// walks the sum in steps with a fork-join each: 225–301 GFLOP/s at bench-s shapes against
/// 334–370 split (docs/design.md §7.17).
fn weight_grad<T: Float>(dy: &[T], x: &[T], m: usize, n: usize, k: usize) -> Vec<T> {
    assert!(dy.len() == m * n && x.len() == m * k, "weight_grad: dy {m}x{n}, x {m}x{k}");
    let len = n * k;
    if len == 0 {
        return Vec::new();
    }
    let parts = m.div_ceil(WEIGHT_GRAD_PART).max(1);
    let mut buf: Vec<T> = Vec::with_capacity(parts * len);
    buf.spare_capacity_mut()[..parts * len].par_chunks_mut(len).enumerate().for_each(|(p, out)| {
        let (t0, t1) = ((p * WEIGHT_GRAD_PART).min(m), ((p + 1) * WEIGHT_GRAD_PART).min(m));
        // SAFETY: dy rows t0..t1 (read as dyᵀ, [n, t1 - t0]) and x rows t0..t1 ([t1 - t0, k])
        // lie inside the slices (asserted lengths), and `out` holds n·k values, every one of
        // which `product_into` writes (an empty sum included: zeros).
        unsafe {
            let (dyt, xs) = ((dy[t0 * n..].as_ptr(), 1, n), (x[t0 * k..].as_ptr(), k, 1));
            product_into(out.as_mut_ptr() as *mut T, (n, k, t1 - t0), dyt, xs, gemm::Parallelism::None)
        }
    });
    // SAFETY: every part's gemm wrote all of its n·k values.
    unsafe { buf.set_len(parts * len) };
    let (sum, rest) = buf.split_at_mut(len);
    if parts > 1 {
        sum.par_chunks_mut(SUM_CHUNK).enumerate().for_each(|(i, c)| {
            for part in rest.chunks_exact(len) {
                for (y, &v) in c.iter_mut().zip(&part[i * SUM_CHUNK..]) {
                    *y += v;
                }
            }
        });
    }
    buf.truncate(len);
    buf
}

fn fwd_typed<T: Float>(s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
    let (x, w) = (storage_slice::<T>(s1, l1)?, storage_slice::<T>(s2, l2)?);
    let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
    if k != k2 || x.len() != m * k || w.len() != n * k {
        bail!("difftx-linear: x {:?} and w {:?} do not fit", l1.dims(), l2.dims());
    }
    Ok((T::to_cpu_storage_owned(forward(x, w, m, n, k)), Shape::from_dims(&[m, n])))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "difftx-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => fwd_typed::<f32>(s1, l1, s2, l2),
            DType::F64 => fwd_typed::<f64>(s1, l1, s2, l2),
            dt => bail!("difftx-linear: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.to_dtype(x.dtype())?;
        // dx = dy·w [m, k]; dw = dyᵀ·x [n, k], gemm reading dy transposed by its strides
        let dx = dy.matmul(w)?;
        let ((m, k), n) = (x.dims2()?, w.dim(0)?);
        let dw = match x.dtype() {
            DType::F32 => weight_grad_tensor::<f32>(&dy, x, m, n, k)?,
            DType::F64 => weight_grad_tensor::<f64>(&dy, x, m, n, k)?,
            dt => bail!("difftx-linear: unsupported dtype {dt:?}"),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// [`weight_grad`] of two tensors, as a `[n, k]` tensor.
fn weight_grad_tensor<T: Float>(dy: &Tensor, x: &Tensor, m: usize, n: usize, k: usize) -> Result<Tensor> {
    let dw = with_slice::<T, _>(dy, |dy| with_slice::<T, _>(x, |x| Ok(weight_grad(dy, x, m, n, k))))?;
    Tensor::from_vec(dw, (n, k), x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Forward and both gradients equal candle's `x.matmul(&w.t())` (the same gemm products),
    /// on awkward shapes including a leading batch axis and empty sizes; bad shapes are errors.
    #[test]
    fn equals_candle_matmul_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            for (lead, inp, out) in [
                (vec![1], 1, 1),
                (vec![0], 5, 7),
                (vec![37], 5, 7),
                (vec![3, 100], 64, 33),
                (vec![2, 550], 64, 33),
                (vec![2048], 256, 704),
            ] {
                let mut xd = lead.clone();
                xd.push(inp);
                let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, xd.as_slice(), &dev)?.to_dtype(dt)?)?;
                let w = Var::from_tensor(&Tensor::randn(0f64, 1.0, (out, inp), &dev)?.to_dtype(dt)?)?;
                let ours = linear(x.as_tensor(), w.as_tensor())?;
                let theirs = x.as_tensor().broadcast_matmul(&w.as_tensor().t()?)?;
                let flat = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                assert_eq!(ours.dims(), theirs.dims());
                let close = |a: Vec<f64>, b: Vec<f64>, what: &str| {
                    let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
                    let diff = a.iter().zip(&b).fold(0f64, |m, (p, q)| m.max((p - q).abs()));
                    let tol = if dt == DType::F32 { 1e-5 } else { 1e-13 };
                    assert!(diff <= tol * scale, "{dt:?} {lead:?} {inp} {out} {what}: {diff} of {scale}");
                };
                close(flat(&ours)?, flat(&theirs)?, "forward");
                let wy = Tensor::randn(0f64, 1.0, ours.dims(), &dev)?.to_dtype(dt)?;
                let go = (&ours * &wy)?.sum_all()?.backward()?;
                let gt = (&theirs * &wy)?.sum_all()?.backward()?;
                for (name, v) in [("dx", x.as_tensor()), ("dw", w.as_tensor())] {
                    let (a, b) = (go.get(v).unwrap(), gt.get(v).unwrap());
                    assert_eq!(a.dims(), b.dims(), "{name}");
                    assert!(a.is_contiguous(), "{name} contiguous");
                    close(flat(a)?, flat(b)?, name);
                }
            }
        }
        let x = Tensor::zeros((4, 3), DType::F32, &dev)?;
        assert!(linear(&x, &Tensor::zeros((2, 5), DType::F32, &dev)?).is_err(), "input size");
        assert!(linear(&x.flatten_all()?, &Tensor::zeros((2, 3), DType::F32, &dev)?).is_err(), "rank 1");
        assert!(linear(&x, &Tensor::zeros((2, 3), DType::F64, &dev)?).is_err(), "dtype mismatch");
        Ok(())
    }
}
