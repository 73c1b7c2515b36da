//! candle's narrow backward as vendored here (vendor/README.md) writes the gradients of disjoint
//! parts narrowed out of one tensor into one buffer instead of padding each part to the whole
//! and summing. Whatever the parts (covering the tensor or leaving gaps, overlapping, along
//! different dims, mixed with other uses of the tensor in either order), the gradient must be the
//! one `index_select` gives (its backward, an index add, is not patched). Checked by breaking the
//! patch on purpose (each part copied one place too early): the tests failed.

use candle_core::{DType, Device, Result, Tensor, Var};

/// `x.narrow(dim, start, len)` by `index_select`, whose backward is upstream's.
fn selected(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    let ids = Tensor::arange(start as u32, (start + len) as u32, x.device())?;
    x.index_select(&ids, dim)
}

/// A use of the tensor in the loss: a part along `dim`, or the whole tensor (`None`).
type Part = Option<(usize, usize, usize)>;

/// `Σ_i sum(part_i(y) · w_i)` with `y = x · 3` (a computed node, so its gradient also flows on),
/// its gradient for x by narrow and by `index_select`.
fn gradients(dims: &[usize], parts: &[Part]) -> Result<(Vec<f64>, Vec<f64>)> {
    let dev = Device::Cpu;
    let n: usize = dims.iter().product();
    let values: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin()).collect();
    let x = Var::from_tensor(&Tensor::from_vec(values, dims, &dev)?)?;
    let mut by = Vec::new();
    for narrow in [true, false] {
        let y = (x.as_tensor() * 3.0)?;
        let mut loss = Tensor::zeros((), DType::F64, &dev)?;
        for (i, part) in parts.iter().enumerate() {
            let view = match *part {
                Some((dim, start, len)) if narrow => y.narrow(dim, start, len)?,
                Some((dim, start, len)) => selected(&y, dim, start, len)?,
                None => y.clone(),
            };
            let w = Tensor::arange(0.0, view.elem_count() as f64, &dev)?
                .affine(0.01, 0.5 + i as f64)?
                .reshape(view.dims())?;
            loss = (loss + (view * w)?.sum_all()?)?;
        }
        let grads = loss.backward()?;
        let g = grads.get(x.as_tensor()).expect("x has a gradient");
        by.push(g.flatten_all()?.to_vec1::<f64>()?);
    }
    Ok((by.remove(0), by.remove(0)))
}

#[test]
fn narrowed_parts_get_index_selects_gradient() -> Result<()> {
    let dims = [2, 3, 7, 4];
    let cases: [(&str, Vec<Part>); 9] = [
        ("three parts covering dim 2", vec![Some((2, 0, 2)), Some((2, 2, 3)), Some((2, 5, 2))]),
        ("the same, last part first", vec![Some((2, 5, 2)), Some((2, 0, 2)), Some((2, 2, 3))]),
        ("parts with gaps", vec![Some((2, 1, 2)), Some((2, 4, 1))]),
        ("one part", vec![Some((2, 3, 2))]),
        ("overlapping parts", vec![Some((2, 0, 3)), Some((2, 2, 3)), Some((2, 2, 1))]),
        ("parts along two dims", vec![Some((2, 0, 2)), Some((1, 1, 2)), Some((2, 3, 2))]),
        ("the whole tensor before the parts", vec![None, Some((2, 0, 3)), Some((2, 3, 4))]),
        ("the whole tensor between the parts", vec![Some((2, 0, 3)), None, Some((2, 3, 4))]),
        ("the whole tensor after the parts", vec![Some((3, 0, 1)), Some((3, 1, 3)), None]),
    ];
    for (what, parts) in cases {
        let (narrow, select) = gradients(&dims, &parts)?;
        assert_eq!(narrow.len(), select.len());
        for (i, (a, b)) in narrow.iter().zip(&select).enumerate() {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{what}: element {i}: {a} against {b}");
        }
    }
    Ok(())
}

/// A part of the same tensor taken twice (one narrow node used twice) and a narrow of a narrow.
#[test]
fn repeated_and_nested_narrows() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::arange(0.0, 24.0, &dev)?.reshape((4, 6))?)?;
    let w = Tensor::arange(1.0, 9.0, &dev)?.reshape((4, 2))?;
    let part = x.as_tensor().narrow(1, 1, 2)?;
    let inner = x.as_tensor().narrow(1, 2, 4)?.narrow(1, 2, 2)?; // columns 4 and 5
    let loss = ((&part * &w)?.sum_all()? + (&part * &w)?.sum_all()? + (&inner * &w)?.sum_all()?)?;
    let g = loss.backward()?.get(x.as_tensor()).expect("x has a gradient").to_vec2::<f64>()?;
    let w = w.to_vec2::<f64>()?;
    for (r, row) in g.iter().enumerate() {
        let want = [0.0, 2.0 * w[r][0], 2.0 * w[r][1], 0.0, w[r][0], w[r][1]];
        assert_eq!(row, &want, "row {r}");
    }
    Ok(())
}
