//! diff-v1's value of every head, built in one pass: each head's pair of value heads side by side.
//!
//! Layout: `v` `[B, H, S, d]` (H even), out `[B, H, S, 2d]`. With the pairs `(a(j), b(j))` of a
//! [`PairLayout`], head `i` belongs to pair `j(i)` and `out[b, i, s] = [v[b, a(j(i)), s], v[b, b(j(i)), s]]`.
//! Both members of a pair are themselves the two heads that read it, so the backward is, for head
//! `h` of pair `j` at half `k` (0 when `h = a(j)`, 1 when `h = b(j)`):
//! `dv[b, h, s] = dout[b, a(j), s, k·d..(k+1)·d] + dout[b, b(j), s, k·d..(k+1)·d]`.
//! One parallel copy forward and one parallel sum backward, where the composition of head splits,
//! a concatenation and a broadcast (and the zero padding, concatenation and reduction of their
//! backward) ran as several single-threaded strided passes in candle (docs/design.md §5, §7.11).

use crate::cpu::{par_output_uninit, storage_slice, with_slice, zeros};
use crate::float::Float;
use crate::PairLayout;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `[B, H, S, d]` -> `[B, H, S, 2d]`: every head gets its pair's two value heads side by side
/// (pairs as `layout` says). f32 and f64, with backward.
pub fn pair_values(v: &Tensor, layout: PairLayout) -> Result<Tensor> {
    match v.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::pair_values: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    let (b, h, s, d) = v.dims4()?;
    if h % 2 != 0 {
        bail!("difftx_kernels::pair_values: {h} heads cannot form pairs");
    }
    v.contiguous()?.apply_op1(PairValues { b, h, s, d, layout })
}

pub(crate) struct PairValues {
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) s: usize,
    pub(crate) d: usize,
    pub(crate) layout: PairLayout,
}

impl PairValues {
    /// The pair `(a, b)` head `i` belongs to.
    pub(crate) fn pair_of(&self, i: usize) -> (usize, usize) {
        let half = self.h / 2;
        match self.layout {
            PairLayout::Interleaved => (i & !1, i | 1),
            PairLayout::Halves => (i % half, i % half + half),
        }
    }

    /// The `[B, H, S, 2d]` output for `v`, written once on the pool (no zero fill first: 4 MiB
    /// per bench-s layer).
    pub(crate) fn fwd<T: Float>(&self, v: &[T]) -> Vec<T> {
        let (s, d) = (self.s, self.d);
        assert_eq!(v.len(), self.b * self.h * s * d, "pair_values: v holds B·H·S·d values");
        if s * d == 0 {
            return Vec::new(); // empty heads: nothing to copy
        }
        // SAFETY: the output is B·H chunks of one head's S rows of 2d (asserted length), and
        // every row is written whole from its pair's two value rows.
        unsafe {
            par_output_uninit(2 * v.len(), s * 2 * d, |bi, o| {
                let (b, i) = (bi / self.h, bi % self.h);
                let (a, c) = self.pair_of(i);
                let va = &v[(b * self.h + a) * s * d..][..s * d];
                let vc = &v[(b * self.h + c) * s * d..][..s * d];
                for ((row, ra), rc) in o.chunks_mut(2 * d).zip(va.chunks(d)).zip(vc.chunks(d)) {
                    row[..d].write_copy_of_slice(ra);
                    row[d..].write_copy_of_slice(rc);
                }
            })
        }
    }

    pub(crate) fn bwd<T: Float>(&self, dout: &[T], dv: &mut [T]) {
        if self.s * self.d == 0 {
            return; // empty heads: nothing to copy
        }
        let (s, d) = (self.s, self.d);
        dv.par_chunks_mut(s * d).enumerate().for_each(|(bh, g)| {
            let (b, h) = (bh / self.h, bh % self.h);
            let (a, c) = self.pair_of(h);
            let k = if h == a { 0 } else { d };
            let da = &dout[(b * self.h + a) * s * 2 * d..][..s * 2 * d];
            let dc = &dout[(b * self.h + c) * s * 2 * d..][..s * 2 * d];
            for ((row, ra), rc) in g.chunks_mut(d).zip(da.chunks(2 * d)).zip(dc.chunks(2 * d)) {
                for ((o, &x), &y) in row.iter_mut().zip(&ra[k..k + d]).zip(&rc[k..k + d]) {
                    *o = x + y;
                }
            }
        });
    }
}

impl CustomOp1 for PairValues {
    fn name(&self) -> &'static str {
        "difftx-pair-values"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        fn typed<T: Float>(op: &PairValues, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
            let v = storage_slice::<T>(s1, l1)?;
            let out = op.fwd(v);
            Ok((T::to_cpu_storage_owned(out), Shape::from_dims(&[op.b, op.h, op.s, 2 * op.d])))
        }
        match s1.dtype() {
            DType::F32 => typed::<f32>(self, s1, l1),
            DType::F64 => typed::<f64>(self, s1, l1),
            dt => bail!("difftx-pair-values: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, v: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        fn typed<T: Float>(op: &PairValues, v: &Tensor, dout: &Tensor) -> Result<Tensor> {
            let dv = with_slice::<T, _>(dout, |g| {
                let mut dv = zeros::<T>(g.len() / 2);
                op.bwd(g, &mut dv);
                Ok(dv)
            })?;
            Tensor::from_vec(dv, v.shape(), v.device())
        }
        let dout = grad_res.to_dtype(v.dtype())?;
        let dv = match v.dtype() {
            DType::F32 => typed::<f32>(self, v, &dout)?,
            DType::F64 => typed::<f64>(self, v, &dout)?,
            dt => bail!("difftx-pair-values: unsupported dtype {dt:?}"),
        };
        Ok(Some(dv))
    }
}
