//! Glue between candle tensors/storages and the plain-slice kernels.

use crate::float::Float;
use candle_core::{bail, CpuStorage, Layout, Result, Storage, Tensor};

/// The highest level [`isa_level`] knows (AVX-512F): the kernels ask for it, tests for lower ones.
pub(crate) const BEST_ISA: u8 = 2;

/// The instruction-set level of the hand-written kernels' variants that this CPU runs, capped at
/// `max` (tests pick lower levels): 0 plain code, 1 AVX2 + FMA, 2 AVX-512F (with AVX2 and FMA).
pub(crate) fn isa_level(max: u8) -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if max >= 2 && avx2 && std::is_x86_feature_detected!("avx512f") {
            return 2;
        }
        if max >= 1 && avx2 {
            return 1;
        }
    }
    let _ = max;
    0
}

/// Rows per rayon task so that each task touches at least ~`elems` elements.
pub(crate) fn min_rows(row_len: usize, elems: usize) -> usize {
    (elems / row_len.max(1)).max(1)
}

/// The contiguous slice of `s` described by `l` (errors on strided layouts).
pub(crate) fn storage_slice<'a, T: Float>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => bail!("difftx-kernels: expected a contiguous layout, got {:?}", l),
    }
}

/// Runs `f` on the contiguous CPU data of `t` (made contiguous first if needed; no copy otherwise).
pub(crate) fn with_slice<T: Float, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (st, l) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(cs) => f(storage_slice::<T>(cs, l)?),
        _ => bail!("difftx-kernels: only the CPU device is supported"),
    }
}

/// The last dimension and the number of rows (product of the other dims) of `shape`.
pub(crate) fn rows_cols(dims: &[usize]) -> Result<(usize, usize)> {
    match dims.split_last() {
        Some((&n, rest)) => Ok((rest.iter().product(), n)),
        None => bail!("difftx-kernels: expected a tensor of rank >= 1, got a scalar"),
    }
}
