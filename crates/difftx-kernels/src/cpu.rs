//! Glue between candle tensors/storages and the plain-slice kernels.

use crate::float::Float;
use candle_core::{bail, CpuStorage, Layout, Result, Storage, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

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

/// The position stride of a `[B, T, H, d]` layout whose positions may be spaced out: each
/// position's `H·d` values contiguous, position `b·T + t` starting `stride` values after position
/// `b·T + t − 1` (`stride ≥ H·d`; `H·d` when contiguous). Such are the heads narrowed out of a
/// joined projection `[B, T, H1 + H2 + .., d]` along dim 2. `None` for other layouts.
pub(crate) fn position_stride(l: &Layout) -> Option<usize> {
    let (b, t, h, d) = l.shape().dims4().ok()?;
    if l.is_contiguous() {
        return Some(h * d);
    }
    let st = l.stride();
    if !((d <= 1 || st[3] == 1) && (h <= 1 || st[2] == d)) {
        return None;
    }
    let stride = match (b, t) {
        (0, _) | (_, 0) | (1, 1) => h * d,
        (1, _) => st[1],
        (_, 1) => st[0],
        _ if st[0] == t * st[1] => st[1],
        _ => return None,
    };
    (stride >= h * d).then_some(stride)
}

/// `x` itself when its positions can be read where they are ([`position_stride`]), else a
/// contiguous copy: what the ops that read `[B, T, H, d]` by positions take.
pub(crate) fn positions_readable(x: &Tensor) -> Result<Tensor> {
    if position_stride(x.layout()).is_some() {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// The values of a [`position_stride`]d layout: the slice from its first value to its last
/// (`None` where [`position_stride`] is).
pub(crate) fn position_rows<'a, T: Float>(s: &'a CpuStorage, l: &Layout) -> Result<Option<(&'a [T], usize)>> {
    let Some(stride) = position_stride(l) else { return Ok(None) };
    let (b, t, h, d) = l.shape().dims4()?;
    let start = l.start_offset();
    let len = if b * t * h * d == 0 { 0 } else { (b * t - 1) * stride + h * d };
    Ok(Some((&s.as_slice::<T>()?[start..start + len], stride)))
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

/// Elements per task of [`zeros`]' parallel fill.
const ZERO_CHUNK: usize = 1 << 15;

/// `vec![T::ZERO; n]` with the zero fill split over the pool. A zeroed allocation is filled by
/// the allocator on the calling thread before the op's parallel part starts; the kernels' own
/// outputs filled that way were ~5% of a bench-s training step's samples (docs/design.md §7.15).
/// For outputs that a kernel writes whole, [`par_output`] avoids the separate pass.
pub(crate) fn zeros<T: Float>(n: usize) -> Vec<T> {
    par_output(n, ZERO_CHUNK, |_, _| {})
}

/// A kernel's output of `n` values, written on the pool chunk by chunk: `write(i, c)` gets
/// chunk `i` (`chunk` values, the last one shorter), zero-filled inside its own task just
/// before, so that the output is not filled by a separate pass over memory first (its fill
/// stays in the cache of the thread that writes it).
pub(crate) fn par_output<T: Float>(n: usize, chunk: usize, write: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    // SAFETY: `zeroed` initialises every value of each chunk before `write` sees it.
    unsafe { par_output_uninit(n, chunk, |i, c| write(i, zeroed(c))) }
}

/// [`par_output`] without the zero fill, for kernels that write every value of their chunk
/// (a fill before an overwrite was ~3% of a bf16 training step, docs/design.md §7.16).
///
/// # Safety
/// `write(i, c)` must initialise every value of `c`: the result exposes them as `T`.
pub(crate) unsafe fn par_output_uninit<T: Send>(
    n: usize,
    chunk: usize,
    write: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.spare_capacity_mut()[..n].par_chunks_mut(chunk.max(1)).enumerate().for_each(|(i, c)| write(i, c));
    // SAFETY: the caller's `write` initialised every chunk of the n values.
    unsafe { v.set_len(n) };
    v
}

/// Two outputs of `n` values each, chunked alike (a backward's two gradients); see
/// [`par_output_uninit`].
///
/// # Safety
/// `write(i, a, b)` must initialise every value of `a` and of `b`.
pub(crate) unsafe fn par_output2_uninit<T: Send>(
    n: usize,
    chunk: usize,
    write: impl Fn(usize, &mut [MaybeUninit<T>], &mut [MaybeUninit<T>]) + Sync,
) -> (Vec<T>, Vec<T>) {
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let chunk = chunk.max(1);
    let (ua, ub) = (&mut a.spare_capacity_mut()[..n], &mut b.spare_capacity_mut()[..n]);
    ua.par_chunks_mut(chunk).zip(ub.par_chunks_mut(chunk)).enumerate().for_each(|(i, (ca, cb))| write(i, ca, cb));
    // SAFETY: both buffers are cut into the same number of chunks, the zip visits every chunk of
    // each, and the caller's `write` initialised them.
    unsafe {
        a.set_len(n);
        b.set_len(n);
    }
    (a, b)
}

/// `y` as possibly uninitialised values, for the kernels written for [`par_output_uninit`]
/// when their output already exists.
///
/// # Safety
/// Only initialised values may be written through the result (it aliases `y`).
pub(crate) unsafe fn as_uninit<T>(y: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: MaybeUninit<T> has T's layout; the caller writes only initialised values.
    unsafe { &mut *(y as *mut [T] as *mut [MaybeUninit<T>]) }
}

/// Fills `c` with zeros and returns it as initialised values.
pub(crate) fn zeroed<T: Float>(c: &mut [MaybeUninit<T>]) -> &mut [T] {
    filled(c, T::ZERO)
}

/// Fills `c` with `value` and returns it as initialised values.
pub(crate) fn filled<T: Copy>(c: &mut [MaybeUninit<T>], value: T) -> &mut [T] {
    c.fill(MaybeUninit::new(value));
    // SAFETY: every element was just written; MaybeUninit<T> has T's layout.
    unsafe { &mut *(c as *mut [MaybeUninit<T>] as *mut [T]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Contiguous layouts and heads narrowed out of a wider row have a position stride (whatever
    /// the sizes of one), other views none.
    #[test]
    fn position_strides_of_narrowed_heads_and_of_other_views() -> Result<()> {
        let x = Tensor::zeros((2, 5, 7, 4), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let stride = |t: &Tensor| position_stride(t.layout());
        assert_eq!(stride(&x), Some(28));
        assert_eq!(stride(&x.narrow(2, 3, 2)?), Some(28));
        assert_eq!(stride(&x.narrow(2, 0, 7)?), Some(28));
        assert_eq!(stride(&x.narrow(2, 1, 2)?.narrow(1, 4, 1)?), Some(140), "one position per batch");
        assert_eq!(stride(&x.narrow(2, 1, 2)?.narrow(0, 1, 1)?.narrow(1, 2, 1)?), Some(8), "one position");
        assert_eq!(stride(&x.narrow(1, 1, 3)?), None, "positions of a batch not evenly spaced");
        assert_eq!(stride(&x.narrow(3, 0, 2)?), None, "heads not packed");
        assert_eq!(stride(&x.transpose(1, 2)?), None);
        let part = x.narrow(2, 3, 2)?;
        let (s, l) = part.storage_and_layout();
        let Storage::Cpu(cs) = &*s else { unreachable!("a CPU tensor") };
        let (rows, at) = position_rows::<f32>(cs, l)?.expect("narrowed heads");
        assert_eq!((rows.len(), at), (9 * 28 + 8, 28));
        Ok(())
    }

    /// Every chunk is handed out once (zero-filled by par_output), with its index and length
    /// (the last one shorter); nothing is left unwritten, at lengths around the chunk size and zero.
    #[test]
    fn par_outputs_hand_out_every_chunk_once() {
        for (n, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (1000, 7), (100_003, 1024)] {
            let v: Vec<f64> = par_output(n, chunk, |i, c| {
                assert!(c.iter().all(|&x| x == 0.0), "chunk {i} not zeroed");
                assert_eq!(c.len(), chunk.min(n - i * chunk), "chunk {i} length");
                for (j, x) in c.iter_mut().enumerate() {
                    *x = (i * chunk + j) as f64;
                }
            });
            assert_eq!(v, (0..n).map(|i| i as f64).collect::<Vec<_>>(), "n {n} chunk {chunk}");
            // SAFETY: every value of every chunk is written.
            let (a, b): (Vec<f32>, Vec<f32>) = unsafe {
                par_output2_uninit(n, chunk, |i, a, b| {
                    assert_eq!((a.len(), b.len()), (chunk.min(n - i * chunk), a.len()), "chunk {i} lengths");
                    for (j, (x, y)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
                        x.write((i * chunk + j) as f32);
                        y.write(-((i * chunk + j) as f32));
                    }
                })
            };
            // SAFETY: as above.
            let u: Vec<f32> = unsafe {
                par_output_uninit(n, chunk, |i, c| {
                    for (j, x) in c.iter_mut().enumerate() {
                        x.write(2.0 * (i * chunk + j) as f32);
                    }
                })
            };
            assert_eq!(u, (0..n).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
            assert_eq!(a, (0..n).map(|i| i as f32).collect::<Vec<_>>());
            assert_eq!(b, (0..n).map(|i| -(i as f32)).collect::<Vec<_>>());
        }
        for n in [0, 1, ZERO_CHUNK + 3] {
            assert_eq!(zeros::<f32>(n), vec![0.0; n]);
        }
    }
}
