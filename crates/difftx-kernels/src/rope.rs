//! Rotary position embedding (RoPE), forward and backward, in one pass each.
//!
//! Layout: `x`, `y` are row-major `[B, T, H, d]` (d even, half = d/2); `cos`, `sin` are the
//! tables `[L, half]` for absolute positions 0..L, and row t of `x` sits at position t + offset.
//! Pairs are (2i, 2i+1) (`interleaved`, GPT-J) or (i, i + half) (rotate-half, GPT-NeoX):
//!   y_a = x_a·cos θ - x_b·sin θ,   y_b = x_a·sin θ + x_b·cos θ     (θ = θ[t + offset, i])
//! The backward is the rotation by -θ (the same kernel with sin negated): the map is orthogonal.

use crate::cpu::{
    as_uninit, min_rows, par_output_uninit, position_rows, positions_readable, storage_slice, with_slice,
};
use crate::float::Float;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// RoPE of x: [B, T, H, d] at positions offset..offset+T from tables cos, sin: [L, d/2], with
/// backward for x (the tables get no gradient). f32 and f64; tables in x's dtype. x may be heads
/// narrowed out of a wider `[B, T, H', d]` (read in place, no copy first).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize, interleaved: bool) -> Result<Tensor> {
    rope_op(x, cos, sin, offset, interleaved, Order::Same)
}

/// [`rope`] with its output in the attention kernels' layout, `[B, H, T, d]`: the values of
/// `rope(x, ..).transpose(1, 2).contiguous()`, written there directly instead of by a copy
/// after the op (and the gradient read from there, instead of copied back before it).
pub fn rope_to_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize, interleaved: bool) -> Result<Tensor> {
    rope_op(x, cos, sin, offset, interleaved, Order::ToHeads)
}

fn rope_op(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize, interleaved: bool, order: Order) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        dt => bail!("difftx_kernels::rope: unsupported dtype {dt:?} (f32, f64 only)"),
    }
    let (_, t, _, d) = x.dims4()?;
    if d % 2 != 0 {
        bail!("difftx_kernels::rope: head dim {d} is odd");
    }
    let (l, half) = cos.dims2()?;
    if half != d / 2 || sin.dims() != cos.dims() {
        bail!("difftx_kernels::rope: tables {:?} / {:?} do not match head dim {d}", cos.dims(), sin.dims());
    }
    if offset + t > l {
        bail!("difftx_kernels::rope: positions up to {} exceed the table length {l}", offset + t);
    }
    if cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        bail!("difftx_kernels::rope: table dtype differs from x dtype {:?}", x.dtype());
    }
    let op = Rope {
        cos: cos.narrow(0, offset, t)?.contiguous()?,
        sin: sin.narrow(0, offset, t)?.contiguous()?,
        interleaved,
        inverse: false,
        order,
    };
    // Heads narrowed out of a joined projection are read where they are.
    positions_readable(x)?.apply_op1(op)
}

/// Where an op's output rows go: the input's order `[B, T, H, d]` (`Same`), or swapped between
/// that and `[B, H, T, d]` (`ToHeads` takes `[B, T, H, d]`, `FromHeads` takes `[B, H, T, d]`).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Order {
    Same,
    ToHeads,
    FromHeads,
}

impl Order {
    /// The order of the backward's rows (the gradient goes the other way).
    fn reversed(self) -> Self {
        match self {
            Order::Same => Order::Same,
            Order::ToHeads => Order::FromHeads,
            Order::FromHeads => Order::ToHeads,
        }
    }

    /// `(b, t, h, d)` of an input of this order with dims `dims`.
    fn b_t_h_d(self, dims: (usize, usize, usize, usize)) -> (usize, usize, usize, usize) {
        let (b, x1, x2, d) = dims;
        match self {
            Order::Same | Order::ToHeads => (b, x1, x2, d),
            Order::FromHeads => (b, x2, x1, d),
        }
    }

    /// The input row and the position (row of the tables) of output row `r` (one head's `d`
    /// values), for sizes `(t, h)`: the reference [`RowWalk`] is tested against.
    #[cfg(test)]
    fn source(self, r: usize, t: usize, h: usize) -> (usize, usize) {
        match self {
            Order::Same => (r, (r / h) % t),
            // input [B, T, H]: the index along T is the first
            Order::ToHeads => {
                let (src, tt, _) = crate::heads::swapped_row(r, t, h);
                (src, tt)
            }
            // input [B, H, T]: the index along T is the second
            Order::FromHeads => {
                let (src, _, tt) = crate::heads::swapped_row(r, h, t);
                (src, tt)
            }
        }
    }
}

struct Rope {
    /// [T, half], already narrowed to the positions of x.
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    /// Rotate by -θ (the backward).
    inverse: bool,
    order: Order,
}

/// The kernel: x, y [B, T, H, d]; cos, sin [T, half].
pub(crate) fn rope_kernel<T: Float>(
    x: &[T],
    y: &mut [T],
    cos: &[T],
    sin: &[T],
    dims: (usize, usize, usize, usize),
    interleaved: bool,
    inverse: bool,
) {
    let (_, t, h, d) = dims;
    if d == 0 || t == 0 || h == 0 {
        return;
    }
    let row = h * d; // one (b, t) position
    y.par_chunks_mut(row)
        .zip(x.par_chunks(row))
        .enumerate()
        .with_min_len(min_rows(row, 8192))
        .for_each(|(bt, (yr, xr))| rotate_position(xr, yr, (cos, sin), bt % t, d, interleaved, inverse));
}

/// `rope_kernel` into a new buffer, written on the pool (see [`par_output_uninit`]), its rows in
/// `order`; `dims` are `(b, t, h, d)`. An input `[B, T, H, d]` (orders `Same`, `ToHeads`) has
/// its positions `stride` values apart (`h·d` when contiguous, see
/// [`crate::cpu::position_stride`]); an input `[B, H, T, d]` (`FromHeads`) is contiguous, `stride`
/// `h·d`.
fn rope_new<T: Float>(
    x: &[T],
    tables: (&[T], &[T]),
    dims: (usize, usize, usize, usize),
    interleaved: bool,
    inverse: bool,
    (order, stride): (Order, usize),
) -> Vec<T> {
    rope_new_at(crate::cpu::BEST_ISA, x, tables, dims, interleaved, inverse, (order, stride))
}

/// [`rope_new`] with the instruction-set level capped at `isa` (tests compare the levels).
fn rope_new_at<T: Float>(
    isa: u8,
    x: &[T],
    tables: (&[T], &[T]),
    dims: (usize, usize, usize, usize),
    interleaved: bool,
    inverse: bool,
    (order, stride): (Order, usize),
) -> Vec<T> {
    let (b, t, h, d) = dims;
    let len = b * t * h * d;
    if len == 0 {
        return Vec::new();
    }
    assert!(d.is_multiple_of(2) && stride >= h * d, "rope: heads of an even {d} values, positions {stride} apart");
    assert!(x.len() >= (b * t - 1) * stride + h * d, "rope: {} values for {dims:?} at stride {stride}", x.len());
    let rows = min_rows(d, 8192);
    let chunk = simd::pick::<T>(isa);
    let job = Job { x, tables, t, h, d, stride, interleaved, inverse, order };
    // SAFETY: every chunk is whole heads of d (len and the chunk are multiples of d), and
    // rotate_head writes all d values of a head when d is even.
    unsafe { par_output_uninit(len, rows * d, |i, y| chunk(&job, i * rows, y)) }
}

/// What [`rope_new`]'s chunks share.
struct Job<'a, T> {
    x: &'a [T],
    tables: (&'a [T], &'a [T]),
    t: usize,
    h: usize,
    d: usize,
    /// Values from one position of the input to the next (orders `Same`, `ToHeads`).
    stride: usize,
    interleaved: bool,
    inverse: bool,
    order: Order,
}

/// Output rows `r0 ..` (one head each) of a [`Job`] into `y`, walking the indices instead of
/// dividing per head ([`Order::source`]'s two divisions per 32 values were most of the op's
/// time, docs/design.md §7.20).
#[inline(always)]
fn rope_chunk<T: Float>(job: &Job<T>, r0: usize, y: &mut [MaybeUninit<T>]) {
    let Job { x, tables, t, h, d, stride, interleaved, inverse, order } = *job;
    let mut walk = RowWalk::new(order, r0, t, h);
    for yh in y.chunks_mut(d) {
        let (at, tt) = walk.source(d, stride);
        rotate_head(&x[at..at + d], yh, tables, tt, interleaved, inverse);
        walk.advance();
    }
}

/// The output rows of an [`Order`] in turn: batch `b`, position `tt` and head `hh` of the
/// current row, advanced without divisions; [`RowWalk::source`] gives what
/// [`Order::source`] gives for the same row.
struct RowWalk {
    order: Order,
    t: usize,
    h: usize,
    b: usize,
    tt: usize,
    hh: usize,
}

impl RowWalk {
    fn new(order: Order, r: usize, t: usize, h: usize) -> Self {
        let (b, tt, hh) = match order {
            // output [B, T, H]
            Order::Same | Order::FromHeads => (r / (t * h), (r / h) % t, r % h),
            // output [B, H, T]
            Order::ToHeads => (r / (t * h), r % t, (r / t) % h),
        };
        RowWalk { order, t, h, b, tt, hh }
    }

    /// The input offset of the current row's `d` values (an input `[B, T, H, d]` with its
    /// positions `stride` values apart, an input `[B, H, T, d]` contiguous) and its position.
    #[inline(always)]
    fn source(&self, d: usize, stride: usize) -> (usize, usize) {
        let RowWalk { order, t, h, b, tt, hh } = *self;
        match order {
            // input [B, T, H]
            Order::Same | Order::ToHeads => ((b * t + tt) * stride + hh * d, tt),
            // input [B, H, T]
            Order::FromHeads => (((b * h + hh) * t + tt) * d, tt),
        }
    }

    #[inline(always)]
    fn advance(&mut self) {
        let (fast, fast_n, slow, slow_n) = match self.order {
            Order::Same | Order::FromHeads => (&mut self.hh, self.h, &mut self.tt, self.t),
            Order::ToHeads => (&mut self.tt, self.t, &mut self.hh, self.h),
        };
        *fast += 1;
        if *fast == fast_n {
            *fast = 0;
            *slow += 1;
            if *slow == slow_n {
                *slow = 0;
                self.b += 1;
            }
        }
    }
}

mod simd {
    use super::*;

    pub(super) type ChunkFn<T> = fn(&Job<T>, usize, &mut [MaybeUninit<T>]);

    // The chunk loop compiled per instruction set: the crate builds for the baseline x86-64
    // (SSE2), where a head's 16 pairs took four iterations of 4 lanes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk_avx2<T: Float>(job: &Job<T>, r0: usize, y: &mut [MaybeUninit<T>]) {
        rope_chunk(job, r0, y)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn chunk_avx512<T: Float>(job: &Job<T>, r0: usize, y: &mut [MaybeUninit<T>]) {
        rope_chunk(job, r0, y)
    }

    /// The chunk loop for the best instruction set this CPU has, capped at `max`.
    pub(super) fn pick<T: Float>(max: u8) -> ChunkFn<T> {
        match crate::cpu::isa_level(max) {
            // SAFETY: the CPU supports the enabled features (`isa_level` checked them).
            #[cfg(target_arch = "x86_64")]
            2 => |job, r0, y| unsafe { chunk_avx512(job, r0, y) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            1 => |job, r0, y| unsafe { chunk_avx2(job, r0, y) },
            _ => |job, r0, y| rope_chunk(job, r0, y),
        }
    }
}

/// One (b, t) position's heads `xr` rotated into `yr` by the angles of table row `tt`.
#[inline(always)]
fn rotate_position<T: Float>(
    xr: &[T],
    yr: &mut [T],
    tables: (&[T], &[T]),
    tt: usize,
    d: usize,
    interleaved: bool,
    inverse: bool,
) {
    for (yh, xh) in yr.chunks_exact_mut(d).zip(xr.chunks_exact(d)) {
        // SAFETY: rotate_head writes only initialised values.
        rotate_head(xh, unsafe { as_uninit(yh) }, tables, tt, interleaved, inverse);
    }
}

/// One head's `d` values `xh` rotated into `yh` by the angles of table row `tt`.
#[inline(always)]
fn rotate_head<T: Float>(
    xh: &[T],
    yh: &mut [MaybeUninit<T>],
    tables: (&[T], &[T]),
    tt: usize,
    interleaved: bool,
    inverse: bool,
) {
    let half = xh.len() / 2;
    let c = &tables.0[tt * half..(tt + 1) * half];
    let s = &tables.1[tt * half..(tt + 1) * half];
    if interleaved {
        // Iterators, not indices, and the sign chosen outside the loop: with an index per value
        // and the branch inside, this loop stayed scalar (4.5% of a bf16 diff-v1 step's samples;
        // 2.4-3x faster so on the Zen 4, docs/design.md 7.21).
        let pairs = yh.chunks_exact_mut(2).zip(xh.chunks_exact(2)).zip(c.iter().zip(s));
        if inverse {
            for ((y, x), (&c, &s)) in pairs {
                let sn = T::ZERO - s;
                y[0].write(x[0] * c - x[1] * sn);
                y[1].write(x[0] * sn + x[1] * c);
            }
        } else {
            for ((y, x), (&c, &sn)) in pairs {
                y[0].write(x[0] * c - x[1] * sn);
                y[1].write(x[0] * sn + x[1] * c);
            }
        }
    } else {
        let (ya, yb) = yh.split_at_mut(half);
        let (xa, xb) = xh.split_at(half);
        let pairs = ya.iter_mut().zip(yb).zip(xa.iter().zip(xb)).zip(c.iter().zip(s));
        if inverse {
            for (((ya, yb), (&a, &b)), (&c, &s)) in pairs {
                let sn = T::ZERO - s;
                ya.write(a * c - b * sn);
                yb.write(a * sn + b * c);
            }
        } else {
            for (((ya, yb), (&a, &b)), (&c, &sn)) in pairs {
                ya.write(a * c - b * sn);
                yb.write(a * sn + b * c);
            }
        }
    }
}

fn fwd_typed<T: Float>(op: &Rope, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let dims = op.order.b_t_h_d(l.shape().dims4()?);
    let (x, stride) = match op.order {
        Order::FromHeads => (storage_slice::<T>(s, l)?, dims.2 * dims.3),
        Order::Same | Order::ToHeads => match position_rows::<T>(s, l)? {
            Some(rows) => rows,
            None => bail!("difftx-rope: x must be contiguous or heads narrowed out of a wider row, got {l:?}"),
        },
    };
    let y = with_slice::<T, _>(&op.cos, |c| {
        with_slice::<T, _>(&op.sin, |sn| Ok(rope_new(x, (c, sn), dims, op.interleaved, op.inverse, (op.order, stride))))
    })?;
    let (b, t, h, d) = dims;
    let shape = match op.order {
        Order::Same | Order::FromHeads => Shape::from_dims(&[b, t, h, d]),
        Order::ToHeads => Shape::from_dims(&[b, h, t, d]),
    };
    Ok((T::to_cpu_storage_owned(y), shape))
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "difftx-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s.dtype() {
            DType::F32 => fwd_typed::<f32>(self, s, l),
            DType::F64 => fwd_typed::<f64>(self, s, l),
            dt => bail!("difftx-rope: unsupported dtype {dt:?}"),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let inv = Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            interleaved: self.interleaved,
            inverse: !self.inverse,
            order: self.order.reversed(),
        };
        let g = grad_res.to_dtype(arg.dtype())?.contiguous()?;
        Ok(Some(g.apply_op1_no_bwd(&inv)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The op's forward (its own buffer, chunks of positions) gives the decoder's kernel's bits,
    /// both pairings and directions, on position counts that do not fill the last chunk.
    #[test]
    fn new_buffer_forward_equals_the_kernel() {
        for (b, t, h, d) in [(1, 1, 1, 2), (2, 37, 3, 8), (3, 300, 8, 32), (1, 5, 2, 6)] {
            let x: Vec<f64> = (0..b * t * h * d).map(|i| (i as f64 * 0.37).sin()).collect();
            let cos: Vec<f64> = (0..t * d / 2).map(|i| (i as f64 * 0.1).cos()).collect();
            let sin: Vec<f64> = (0..t * d / 2).map(|i| (i as f64 * 0.1).sin()).collect();
            for (interleaved, inverse) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut want = vec![0.0; x.len()];
                rope_kernel(&x, &mut want, &cos, &sin, (b, t, h, d), interleaved, inverse);
                for isa in 0..=crate::cpu::BEST_ISA {
                    let got =
                        rope_new_at(isa, &x, (&cos, &sin), (b, t, h, d), interleaved, inverse, (Order::Same, h * d));
                    assert_eq!(got, want, "{:?} interleaved {interleaved} inverse {inverse} isa {isa}", (b, t, h, d));
                }
            }
        }
    }

    /// The walk over output rows gives `Order::source` of every row, from any first row, for
    /// every order (chunks start mid-head-group and mid-position).
    #[test]
    fn row_walk_equals_order_source() {
        for (b, t, h) in [(1, 1, 1), (2, 5, 3), (3, 7, 1), (2, 1, 4)] {
            for order in [Order::Same, Order::ToHeads, Order::FromHeads] {
                for r0 in 0..b * t * h {
                    let mut walk = RowWalk::new(order, r0, t, h);
                    for r in r0..b * t * h {
                        let (src, tt) = order.source(r, t, h);
                        assert_eq!(walk.source(3, 3 * h), (3 * src, tt), "{order:?} {:?} from {r0} at {r}", (b, t, h));
                        walk.advance();
                    }
                }
            }
        }
    }
}
