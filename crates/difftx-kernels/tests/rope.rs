//! RoPE kernel against the composed candle ops, forward and backward, and against finite
//! differences in f64, on awkward shapes, both pair layouts, with a position offset.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::{finite_diff, flat, max_rel_vec, rand_t, rel_err};

fn tables(l: usize, half: usize, dt: DType) -> Result<(Tensor, Tensor)> {
    let ang: Vec<f64> = (0..l)
        .flat_map(|p| (0..half).map(move |i| p as f64 * 10000f64.powf(-((2 * i) as f64) / (2 * half) as f64)))
        .collect();
    let cos =
        Tensor::from_vec(ang.iter().map(|a| a.cos()).collect::<Vec<_>>(), (l, half), &Device::Cpu)?.to_dtype(dt)?;
    let sin =
        Tensor::from_vec(ang.iter().map(|a| a.sin()).collect::<Vec<_>>(), (l, half), &Device::Cpu)?.to_dtype(dt)?;
    Ok((cos, sin))
}

/// The composed reference (the model's Kernels::Reference formula).
fn rope_ref(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize, interleaved: bool) -> Result<Tensor> {
    let (b, t, h, d) = x.dims4()?;
    let half = d / 2;
    let cos = cos.narrow(0, offset, t)?;
    let sin = sin.narrow(0, offset, t)?;
    if interleaved {
        let x = x.reshape((b, t, h, half, 2))?;
        let (x0, x1) = (x.narrow(4, 0, 1)?, x.narrow(4, 1, 1)?);
        let cos = cos.reshape((1, t, 1, half, 1))?;
        let sin = sin.reshape((1, t, 1, half, 1))?;
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::cat(&[y0, y1], 4)?.reshape((b, t, h, d))
    } else {
        let (x0, x1) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let cos = cos.reshape((1, t, 1, half))?;
        let sin = sin.reshape((1, t, 1, half))?;
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x1.broadcast_mul(&cos)? + x0.broadcast_mul(&sin)?)?;
        Tensor::cat(&[y0, y1], 3)
    }
}

const SHAPES: [(usize, usize, usize, usize, usize); 4] =
    [(1, 1, 1, 2, 0), (2, 5, 3, 6, 3), (3, 7, 2, 10, 1), (1, 33, 5, 32, 0)];

#[test]
fn forward_and_backward_match_composed_ops() {
    for dt in [DType::F32, DType::F64] {
        for (si, &(b, t, h, d, off)) in SHAPES.iter().enumerate() {
            for interleaved in [false, true] {
                let (cos, sin) = tables(t + off + 2, d / 2, dt).unwrap();
                let x = Var::from_tensor(&rand_t(&[b, t, h, d], si as u64, 1.0, dt).unwrap()).unwrap();
                let w = rand_t(&[b, t, h, d], 100 + si as u64, 1.0, dt).unwrap();
                let yf = difftx_kernels::rope(x.as_tensor(), &cos, &sin, off, interleaved).unwrap();
                let yr = rope_ref(x.as_tensor(), &cos, &sin, off, interleaved).unwrap();
                let tol = if dt == DType::F64 { 1e-13 } else { 1e-6 };
                let e = rel_err(&yf, &yr);
                assert!(e < tol, "{dt:?} {:?} interleaved={interleaved}: forward {e}", SHAPES[si]);
                let gf = (&yf * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let gr = (&yr * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let e = rel_err(gf.get(x.as_tensor()).unwrap(), gr.get(x.as_tensor()).unwrap());
                assert!(e < tol, "{dt:?} {:?} interleaved={interleaved}: backward {e}", SHAPES[si]);
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences_f64() {
    let (b, t, h, d, off) = (2, 4, 3, 6, 2);
    for interleaved in [false, true] {
        let (cos, sin) = tables(t + off, d / 2, DType::F64).unwrap();
        let x0 = rand_t(&[b, t, h, d], 7, 1.0, DType::F64).unwrap();
        let w = rand_t(&[b, t, h, d], 8, 1.0, DType::F64).unwrap();
        // A non-linear loss so the gradient depends on y: sum(w * y^2).
        let f = |x: &Tensor| -> Result<f64> {
            (difftx_kernels::rope(x, &cos, &sin, off, interleaved)?.sqr()? * &w)?.sum_all()?.to_scalar::<f64>()
        };
        let x = Var::from_tensor(&x0).unwrap();
        let y = difftx_kernels::rope(x.as_tensor(), &cos, &sin, off, interleaved).unwrap();
        let g = (y.sqr().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let analytic = flat(g.get(x.as_tensor()).unwrap());
        let numeric = finite_diff(&x0, f, 1e-6).unwrap();
        let e = max_rel_vec(&analytic, &numeric);
        assert!(e < 1e-7, "interleaved={interleaved}: {e}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let (cos, sin) = tables(4, 3, DType::F32).unwrap();
    let x = rand_t(&[1, 4, 2, 6], 1, 1.0, DType::F32).unwrap();
    assert!(difftx_kernels::rope(&x, &cos, &sin, 1, false).is_err(), "positions past the table");
    let odd = rand_t(&[1, 2, 2, 5], 1, 1.0, DType::F32).unwrap();
    assert!(difftx_kernels::rope(&odd, &cos, &sin, 0, false).is_err(), "odd head dim");
    let x64 = x.to_dtype(DType::F64).unwrap();
    assert!(difftx_kernels::rope(&x64, &cos, &sin, 0, true).is_err(), "dtype mismatch");
}

/// `rope_to_heads` gives the bits of `rope` followed by the transpose to `[B, H, T, d]`, forward
/// and backward (its backward writes the gradient back in `[B, T, H, d]` itself).
#[test]
fn to_heads_equals_rope_then_transpose() {
    for dt in [DType::F32, DType::F64] {
        for (si, &(b, t, h, d, off)) in SHAPES.iter().chain(&[(2, 300, 3, 8, 5)]).enumerate() {
            for interleaved in [false, true] {
                let (cos, sin) = tables(t + off + 2, d / 2, dt).unwrap();
                let x = Var::from_tensor(&rand_t(&[b, t, h, d], si as u64, 1.0, dt).unwrap()).unwrap();
                let w = rand_t(&[b, h, t, d], 100 + si as u64, 1.0, dt).unwrap();
                let fused = difftx_kernels::rope_to_heads(x.as_tensor(), &cos, &sin, off, interleaved).unwrap();
                let composed = difftx_kernels::rope(x.as_tensor(), &cos, &sin, off, interleaved)
                    .and_then(|y| y.transpose(1, 2)?.contiguous())
                    .unwrap();
                let what = format!("{dt:?} {:?} interleaved={interleaved}", (b, t, h, d, off));
                assert_eq!(fused.dims(), &[b, h, t, d], "{what}");
                assert_eq!(flat(&fused), flat(&composed), "{what}: forward");
                let gf = (&fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let gc = (&composed * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let (gf, gc) = (gf.get(x.as_tensor()).unwrap(), gc.get(x.as_tensor()).unwrap());
                assert_eq!(gf.dims(), &[b, t, h, d], "{what}");
                assert_eq!(flat(gf), flat(gc), "{what}: backward");
            }
        }
    }
}

/// Heads narrowed out of a joined projection `[B, T, Hq + Hk + Hv, d]` (the model's q, k and v,
/// read in place) give what their contiguous copies give: `rope`, `rope_to_heads` and
/// `swap_dims12`, forward and backward, each part and every part of one tensor together.
#[test]
fn heads_narrowed_out_of_a_joined_projection_equal_their_copies() {
    let joined = [(2, 37, [3, 1, 1], 8, 5), (1, 1, [2, 2, 2], 4, 9), (3, 5, [4, 2, 2], 6, 0), (2, 1, [1, 1, 1], 2, 3)];
    for dt in [DType::F32, DType::F64] {
        for (si, &(b, t, parts, d, off)) in joined.iter().enumerate() {
            let heads: usize = parts.iter().sum();
            let (cos, sin) = tables(t + off, d / 2, dt).unwrap();
            let x = Var::from_tensor(&rand_t(&[b, t, heads, d], si as u64, 1.0, dt).unwrap()).unwrap();
            for interleaved in [false, true] {
                // (name, op): each takes [B, T, h, d]
                type Op<'a> = Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>;
                let ops: [(&str, Op); 3] = [
                    ("rope", Box::new(|x: &Tensor| difftx_kernels::rope(x, &cos, &sin, off, interleaved))),
                    (
                        "rope_to_heads",
                        Box::new(|x: &Tensor| difftx_kernels::rope_to_heads(x, &cos, &sin, off, interleaved)),
                    ),
                    ("swap_dims12", Box::new(difftx_kernels::swap_dims12)),
                ];
                for (name, op) in &ops {
                    let what = format!("{dt:?} {:?} {name} interleaved={interleaved}", (b, t, parts, d, off));
                    let (mut loss_in_place, mut loss_copied) = (Vec::new(), Vec::new());
                    let mut start = 0;
                    for (p, &h) in parts.iter().enumerate() {
                        let part = x.as_tensor().narrow(2, start, h).unwrap();
                        assert!(!part.is_contiguous() || parts.len() == 1 || b * t == 1, "{what}: a strided part");
                        let y = op(&part).unwrap();
                        let y_copy = op(&part.contiguous().unwrap()).unwrap();
                        assert_eq!(flat(&y), flat(&y_copy), "{what}: part {p} forward");
                        let w = rand_t(y.dims(), 50 + p as u64, 1.0, dt).unwrap();
                        loss_in_place.push((&y * &w).unwrap().sum_all().unwrap());
                        loss_copied.push((&y_copy * &w).unwrap().sum_all().unwrap());
                        start += h;
                    }
                    let total = |l: &[Tensor]| l.iter().skip(1).fold(l[0].clone(), |a, b| (a + b).unwrap());
                    let g_in_place = total(&loss_in_place).backward().unwrap();
                    let g_copied = total(&loss_copied).backward().unwrap();
                    let (gi, gc) = (g_in_place.get(x.as_tensor()).unwrap(), g_copied.get(x.as_tensor()).unwrap());
                    assert_eq!(flat(gi), flat(gc), "{what}: backward");
                }
            }
        }
    }
}
