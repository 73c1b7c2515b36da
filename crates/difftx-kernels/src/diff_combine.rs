//! The differential combination of diff-v1: z = o1 - λ·o2 with a scalar λ, forward and backward
//! in one pass each (instead of a broadcast multiply, a broadcast subtract and their backward).
//!
//! Layout: `o1`, `o2`, `z` are row-major of one shape (any rank); `lambda` has one element.
//! Backward: do1 = dz,  do2 = -λ·dz,  dλ = -Σ dz·o2 (summed in fixed chunks, in order).

use crate::cpu::{par_output_uninit, storage_slice, with_slice, zeros};
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
    let mut z = zeros::<T>(a.len());
    diff_combine_fwd(a, b, lam[0], &mut z);
    Ok((T::to_cpu_storage_owned(z), l1.shape().clone()))
}

fn bwd_typed<T: Float>(o2: &Tensor, lambda: &Tensor, dz: &Tensor) -> Result<(Tensor, Tensor)> {
    let lam = with_slice::<T, _>(lambda, |l| Ok(l[0]))?;
    let (do2, dl) = with_slice::<T, _>(o2, |b| {
        with_slice::<T, _>(dz, |g| {
            let mut do2 = zeros::<T>(b.len());
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
/// pair: `x` `[B, 2P, T, w]` -> `z[b, j, t] = x[b, a(j), t] − λ·x[b, b(j), t]`, `[B, P, T, w]`,
/// with the pairs `(a(j), b(j))` of `layout`. `lambda` is one element (diff-v1's scalar λ) or one
/// per pair and position, `B·P·T` elements in `[B, P, T]` order (diff-v2's per-token λ). No head
/// is split or copied: viewed as `[outer, 2, inner]` (outer = B·P and inner = T·w for interleaved
/// pairs, outer = B and inner = P·T·w for halves), row `o` of z is `x[o, 0] − λ·x[o, 1]`, and in
/// both layouts the per-position λ of vector `r` (w elements) of row `o` is `λ[o·inner/w + r]`.
/// Backward: `dx[o, 0] = dz[o]`, `dx[o, 1] = −λ·dz[o]`; `dλ = −Σ dz·x[·, 1]` over everything λ
/// multiplied (for a scalar λ: per-row partial sums added in row order).
pub fn diff_combine_pairs(x: &Tensor, lambda: &Tensor, layout: PairLayout) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::diff_combine_pairs: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    let (b, heads, t, w) = x.dims4()?;
    if heads % 2 != 0 {
        bail!("difftx_kernels::diff_combine_pairs: {heads} heads cannot form pairs");
    }
    let p = heads / 2;
    let per_position = lambda.elem_count() == b * p * t && lambda.elem_count() != 1;
    if !(lambda.elem_count() == 1 || per_position) || lambda.dtype() != x.dtype() {
        bail!(
            "difftx_kernels::diff_combine_pairs: lambda must be one element or B·P·T = {} elements of the input's dtype, got {:?} {:?}",
            b * p * t,
            lambda.dims(),
            lambda.dtype()
        );
    }
    let (outer, inner) = match layout {
        PairLayout::Interleaved => (b * p, t * w),
        PairLayout::Halves => (b, p * t * w),
    };
    let op = DiffCombinePairs { outer, inner, width: if per_position { w } else { 0 } };
    x.contiguous()?.apply_op2(&lambda.contiguous()?, op)?.reshape((b, p, t, w))
}

pub(crate) struct DiffCombinePairs {
    pub(crate) outer: usize,
    pub(crate) inner: usize,
    /// w for a λ per position (vector of w elements), 0 for one scalar λ.
    pub(crate) width: usize,
}

impl DiffCombinePairs {
    /// λ of element `i` of row `o`.
    fn lambda_at<T: Float>(&self, lam: &[T], o: usize, i: usize) -> T {
        match i.checked_div(self.width) {
            None => lam[0],
            Some(v) => lam[o * (self.inner / self.width) + v],
        }
    }

    /// The combination `[outer, inner]` of `x` `[outer, 2, inner]`, written once on the pool (no
    /// zero fill first).
    pub(crate) fn fwd<T: Float>(&self, x: &[T], lam: &[T]) -> Vec<T> {
        let (outer, inner) = (self.outer, self.inner);
        assert_eq!(x.len(), 2 * outer * inner, "diff_combine_pairs: x holds outer·2·inner values");
        if inner == 0 {
            return Vec::new(); // no positions (T = 0) or zero-width heads: nothing to combine
        }
        let step = if self.width == 0 { inner } else { self.width };
        // SAFETY: the output is `outer` chunks of `inner` values (asserted length of x), and the
        // loop writes every value of each chunk from its row of x.
        unsafe {
            par_output_uninit(outer * inner, inner, |o, zr| {
                let (a, b) = x[2 * o * inner..2 * (o + 1) * inner].split_at(inner);
                for (c, ((zc, ac), bc)) in zr.chunks_mut(step).zip(a.chunks(step)).zip(b.chunks(step)).enumerate() {
                    let l = self.lambda_at(lam, o, c * step);
                    for ((out, &u), &v) in zc.iter_mut().zip(ac).zip(bc) {
                        out.write(u - l * v);
                    }
                }
            })
        }
    }

    /// Writes dx and dλ (one element, or one per position).
    pub(crate) fn bwd<T: Float>(&self, x: &[T], lam: &[T], dz: &[T], dx: &mut [T], dl: &mut [T]) {
        if self.inner == 0 {
            return; // dx and dλ stay zero
        }
        let step = if self.width == 0 { self.inner } else { self.width };
        // Per row: the partial sums Σ dz·x[o, 1] of each λ vector of the row.
        let parts: Vec<Vec<T>> = dx
            .par_chunks_mut(2 * self.inner)
            .zip(x.par_chunks(2 * self.inner).zip(dz.par_chunks(self.inner)))
            .enumerate()
            .map(|(o, (dr, (xr, g)))| {
                let (da, db) = dr.split_at_mut(self.inner);
                da.copy_from_slice(g);
                let b = &xr[self.inner..];
                db.chunks_mut(step)
                    .zip(b.chunks(step).zip(g.chunks(step)))
                    .enumerate()
                    .map(|(c, (dbc, (bc, gc)))| second_map_grad(bc, self.lambda_at(lam, o, c * step), gc, dbc))
                    .collect()
            })
            .collect();
        if self.width == 0 {
            dl[0] = lambda_grad(parts.into_iter().flatten().collect());
        } else {
            for (d, part) in dl.iter_mut().zip(parts.into_iter().flatten()) {
                *d = T::ZERO - part;
            }
        }
    }
}

impl DiffCombinePairs {
    /// What an attention backward needs from `bwd` without `dx` itself: dλ as `bwd` writes it
    /// (the same bits), and per vector of `w` elements the row sums `Σ dx ∘ x` ("delta", flash's
    /// `rowsum(dO ∘ O)`), viewed like `x` as `[outer, 2, inner/w]`: `Σ dz ∘ x_a` for the first
    /// map, `−λ·Σ dz ∘ x_b` for the second. `w` must divide `inner` (the per-position λ's width
    /// when there is one).
    pub(crate) fn bwd_row_sums<T: Float>(&self, x: &[T], lam: &[T], dz: &[T], w: usize, delta: &mut [T], dl: &mut [T]) {
        if self.inner == 0 || w == 0 {
            return;
        }
        let n = self.inner / w;
        // per-position dλ: each row's n elements; a scalar λ's is summed from the rows' parts below
        let dl_rows: Vec<Option<&mut [T]>> = if self.width != 0 {
            dl.chunks_mut(n).map(Some).collect()
        } else {
            (0..self.outer).map(|_| None).collect()
        };
        let parts: Vec<T> = delta
            .par_chunks_mut(2 * n)
            .zip(x.par_chunks(2 * self.inner).zip(dz.par_chunks(self.inner)))
            .zip(dl_rows)
            .enumerate()
            .map(|(o, ((dr, (xr, g)), mut dlr))| {
                let (da, db) = dr.split_at_mut(n);
                let (a, b) = xr.split_at(self.inner);
                // the whole row's Σ dz ∘ x_b in `bwd`'s order, for a scalar λ
                let mut row = T::ZERO;
                for (r, ((ga, xa), xb)) in g.chunks(w).zip(a.chunks(w)).zip(b.chunks(w)).enumerate() {
                    let (mut sa, mut sb) = (T::ZERO, T::ZERO);
                    for ((&gv, &u), &v) in ga.iter().zip(xa).zip(xb) {
                        sa += gv * u;
                        sb += gv * v;
                        row += gv * v;
                    }
                    da[r] = sa;
                    db[r] = T::ZERO - self.lambda_at(lam, o, r * w) * sb;
                    if let Some(dlr) = dlr.as_deref_mut() {
                        dlr[r] = T::ZERO - sb;
                    }
                }
                row
            })
            .collect();
        if self.width == 0 {
            dl[0] = lambda_grad(parts);
        }
    }
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
            let z = op.fwd(x, lam);
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
        fn typed<T: Float>(
            op: &DiffCombinePairs,
            x: &Tensor,
            lambda: &Tensor,
            dz: &Tensor,
        ) -> Result<(Tensor, Tensor)> {
            let (dx, dl) = with_slice::<T, _>(lambda, |lam| {
                with_slice::<T, _>(x, |xs| {
                    with_slice::<T, _>(dz, |g| {
                        let mut dx = zeros::<T>(xs.len());
                        let mut dl = zeros::<T>(lam.len());
                        op.bwd(xs, lam, g, &mut dx, &mut dl);
                        Ok((dx, dl))
                    })
                })
            })?;
            Ok((Tensor::from_vec(dx, x.shape(), x.device())?, Tensor::from_vec(dl, lambda.shape(), lambda.device())?))
        }
        let dz = grad_res.to_dtype(x.dtype())?.contiguous()?;
        let (dx, dl) = match x.dtype() {
            DType::F32 => typed::<f32>(self, x, lambda, &dz)?,
            DType::F64 => typed::<f64>(self, x, lambda, &dz)?,
            dt => bail!("difftx-diff-combine-pairs: unsupported dtype {dt:?}"),
        };
        Ok((Some(dx), Some(dl)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bwd_row_sums` gives `bwd`'s dλ bit for bit and the row sums of `bwd`'s dx against x, for
    /// a scalar and a per-position λ in both pair layouts' row shapes.
    #[test]
    fn row_sums_match_the_backward() {
        let gen = |n: usize, p: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + p).sin()).collect() };
        // (outer, inner, w, per-position λ)
        for (outer, inner, w, per_position) in [(6, 5 * 4, 4, false), (6, 5 * 4, 4, true), (2, 3 * 7 * 3, 3, false)] {
            let op = DiffCombinePairs { outer, inner, width: if per_position { w } else { 0 } };
            let n = inner / w;
            let lam = if per_position { gen(outer * n, 0.9) } else { vec![0.6] };
            let (x, dz) = (gen(outer * 2 * inner, 0.1), gen(outer * inner, 0.5));
            let (mut dx, mut dl) = (vec![0.0; x.len()], vec![0.0; lam.len()]);
            op.bwd(&x, &lam, &dz, &mut dx, &mut dl);
            let (mut delta, mut dl2) = (vec![0.0; outer * 2 * n], vec![0.0; lam.len()]);
            op.bwd_row_sums(&x, &lam, &dz, w, &mut delta, &mut dl2);
            assert_eq!(dl, dl2, "dλ, outer {outer} inner {inner} w {w}");
            for (k, &got) in delta.iter().enumerate() {
                let want: f64 = dx[k * w..(k + 1) * w].iter().zip(&x[k * w..(k + 1) * w]).map(|(a, b)| a * b).sum();
                assert!((got - want).abs() < 1e-12, "delta {k}: {got} vs {want}");
            }
        }
    }
}
