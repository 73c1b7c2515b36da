mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use common::*;
use difftx_kernels::{flash_attention, TileProducts};

/// Naive attention with candle's composed ops (materialises the [T, S] score map).
fn attn_ref(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, q_offset: usize) -> Result<Tensor> {
    let (b, hq, t, _) = q.dims4()?;
    let (_, hk, s, dk) = k.dims4()?;
    let dv = v.dim(3)?;
    let rep = hq / hk;
    let k = k.unsqueeze(2)?.broadcast_as((b, hk, rep, s, dk))?.reshape((b, hq, s, dk))?;
    let v = v.unsqueeze(2)?.broadcast_as((b, hk, rep, s, dv))?.reshape((b, hq, s, dv))?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    let mask: Vec<f64> =
        (0..t).flat_map(|i| (0..s).map(move |j| if j <= i + q_offset { 0.0 } else { f64::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(mask, (t, s), &Device::Cpu)?.to_dtype(q.dtype())?;
    let scores = scores.broadcast_add(&mask)?;
    let m = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)
}

#[derive(Debug, Clone, Copy)]
struct Case {
    b: usize,
    hq: usize,
    hk: usize,
    t: usize,
    s: usize,
    dk: usize,
    dv: usize,
    off: usize,
    amp: f64,
}

#[allow(clippy::too_many_arguments)]
const fn c(b: usize, hq: usize, hk: usize, t: usize, s: usize, dk: usize, dv: usize, off: usize, amp: f64) -> Case {
    Case { b, hq, hk, t, s, dk, dv, off, amp }
}

const CASES: &[Case] = &[
    c(2, 6, 2, 77, 77, 16, 32, 0, 1.0),   // T not a multiple of the tile, GQA 3, dv = 2 dk
    c(1, 4, 1, 130, 130, 8, 8, 0, 1.0),   // GQA 4 (MQA), three key blocks
    c(1, 4, 2, 37, 100, 16, 16, 63, 1.0), // KV cache: q_offset > 0, T < S
    c(2, 4, 1, 1, 70, 32, 64, 69, 1.0),   // decode T = 1 against a cache
    c(1, 2, 2, 3, 9, 5, 7, 6, 1.0),       // few rows (dot-product path), odd head dims
    c(1, 2, 1, 5, 5, 3, 5, 0, 1.0),       // tiny
    c(1, 2, 2, 200, 200, 32, 64, 0, 2.5), // large scores: online-softmax rescaling matters
    c(1, 3, 3, 65, 65, 24, 12, 0, 1.0),   // dv < dk
    c(1, 4, 2, 300, 300, 8, 16, 0, 1.0),  // three query/key tiles of 128, last one partial
    c(1, 2, 1, 150, 290, 16, 32, 140, 1.0), // cache offset not aligned to tiles, T > tile
    c(1, 2, 2, 150, 290, 16, 32, 140, 1.0), // the same without GQA (the ungrouped forward)
    c(8, 4, 2, 140, 140, 8, 16, 0, 1.0),  // many (batch, kv head) pairs: the one-pass backward
];

fn inputs(cs: &Case, seed: u64, dt: DType) -> Result<(Tensor, Tensor, Tensor)> {
    let q = rand_t(&[cs.b, cs.hq, cs.t, cs.dk], seed, cs.amp, dt)?;
    let k = rand_t(&[cs.b, cs.hk, cs.s, cs.dk], seed + 1, cs.amp, dt)?;
    let v = rand_t(&[cs.b, cs.hk, cs.s, cs.dv], seed + 2, 1.0, dt)?;
    Ok((q, k, v))
}

#[test]
fn forward_matches_naive() -> Result<()> {
    for (i, cs) in CASES.iter().enumerate() {
        let scale = 1.0 / (cs.dk as f64).sqrt();
        let (q, k, v) = inputs(cs, 100 * i as u64, DType::F64)?;
        let want = attn_ref(&q, &k, &v, scale, cs.off)?;
        let got = flash_attention(&q, &k, &v, scale, cs.off, TileProducts::Native)?;
        assert_eq!(got.dims(), &[cs.b, cs.hq, cs.t, cs.dv]);
        let err = rel_err(&got, &want);
        assert!(err < 1e-12, "f64 {cs:?}: err {err}");
        let (q32, k32, v32) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
        let got = flash_attention(&q32, &k32, &v32, scale, cs.off, TileProducts::Native)?;
        assert_eq!(got.dtype(), DType::F32);
        let err = rel_err(&got, &want);
        assert!(err < 1e-5, "f32 {cs:?}: err {err}");
    }
    Ok(())
}

#[test]
fn backward_matches_naive() -> Result<()> {
    for (i, cs) in CASES.iter().enumerate() {
        let scale = 1.0 / (cs.dk as f64).sqrt();
        let (q, k, v) = inputs(cs, 1000 + 100 * i as u64, DType::F64)?;
        let w = rand_t(&[cs.b, cs.hq, cs.t, cs.dv], 7 + i as u64, 1.0, DType::F64)?;
        let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
        let gr =
            (attn_ref(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, cs.off)? * &w)?.sum_all()?.backward()?;
        let want: Vec<Tensor> = [&qv, &kv, &vv].iter().map(|x| gr.get(x.as_tensor()).unwrap().clone()).collect();
        for dt in [DType::F64, DType::F32] {
            let (qv, kv, vv) = (
                Var::from_tensor(&q.to_dtype(dt)?)?,
                Var::from_tensor(&k.to_dtype(dt)?)?,
                Var::from_tensor(&v.to_dtype(dt)?)?,
            );
            let out =
                flash_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, cs.off, TileProducts::Native)?;
            let gf = (out * w.to_dtype(dt)?)?.sum_all()?.backward()?;
            let tol = if dt == DType::F64 { 1e-11 } else { 1e-5 };
            for (name, x, want) in [("dq", &qv, &want[0]), ("dk", &kv, &want[1]), ("dv", &vv, &want[2])] {
                let got = gf.get(x.as_tensor()).unwrap_or_else(|| panic!("no {name}"));
                assert_eq!(got.dims(), want.dims());
                let err = rel_err(got, want);
                assert!(err < tol, "{dt:?} {cs:?}: {name} err {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn backward_finite_differences_f64() -> Result<()> {
    for cs in [c(1, 4, 2, 6, 9, 3, 6, 3, 1.5), c(1, 2, 1, 70, 70, 2, 3, 0, 1.5)] {
        let scale = 0.7;
        let (q, k, v) = inputs(&cs, 77, DType::F64)?;
        let w = rand_t(&[cs.b, cs.hq, cs.t, cs.dv], 78, 1.0, DType::F64)?;
        let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
        let gf =
            (flash_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, cs.off, TileProducts::Native)?
                * &w)?
                .sum_all()?
                .backward()?;
        let loss = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<f64> {
            (flash_attention(q, k, v, scale, cs.off, TileProducts::Native)? * &w)?.sum_all()?.to_scalar()
        };
        let fq = finite_diff(&q, |x| loss(x, &k, &v), 1e-5)?;
        let fk = finite_diff(&k, |x| loss(&q, x, &v), 1e-5)?;
        let fv = finite_diff(&v, |x| loss(&q, &k, x), 1e-5)?;
        for (name, x, fd) in [("dq", &qv, fq), ("dk", &kv, fk), ("dv", &vv, fv)] {
            let err = max_rel_vec(&flat(gf.get(x.as_tensor()).unwrap()), &fd);
            assert!(err < 1e-7, "{cs:?}: {name} err {err}");
        }
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs() -> Result<()> {
    // The model produces q, k, v as [B, T, H, d] views transposed to [B, H, T, d].
    let (b, t, hq, hk, d) = (2, 40, 4, 2, 8);
    let q = rand_t(&[b, t, hq, d], 1, 1.0, DType::F32)?.transpose(1, 2)?;
    let k = rand_t(&[b, t, hk, d], 2, 1.0, DType::F32)?.transpose(1, 2)?;
    let v = rand_t(&[b, t, hk, 2 * d], 3, 1.0, DType::F32)?.transpose(1, 2)?;
    assert!(!q.is_contiguous());
    let got = flash_attention(&q, &k, &v, 0.3, 0, TileProducts::Native)?;
    let want = attn_ref(&q.to_dtype(DType::F64)?, &k.to_dtype(DType::F64)?, &v.to_dtype(DType::F64)?, 0.3, 0)?;
    let err = rel_err(&got, &want);
    assert!(err < 1e-5, "err {err}");
    Ok(())
}

#[test]
fn decode_step_equals_last_row_of_full_pass() -> Result<()> {
    // Running the whole sequence, then only the last query against the full cache, must agree.
    let (b, hq, hk, n, d) = (1, 6, 2, 300, 16);
    let q = rand_t(&[b, hq, n, d], 11, 1.0, DType::F32)?;
    let k = rand_t(&[b, hk, n, d], 12, 1.0, DType::F32)?;
    let v = rand_t(&[b, hk, n, 2 * d], 13, 1.0, DType::F32)?;
    let full = flash_attention(&q, &k, &v, 0.25, 0, TileProducts::Native)?;
    let last = flash_attention(&q.narrow(2, n - 1, 1)?, &k, &v, 0.25, n - 1, TileProducts::Native)?;
    let err = rel_err(&last, &full.narrow(2, n - 1, 1)?);
    assert!(err < 1e-6, "err {err}");
    // and a chunk of 7 queries at the end
    let tail = flash_attention(&q.narrow(2, n - 7, 7)?, &k, &v, 0.25, n - 7, TileProducts::Native)?;
    let err = rel_err(&tail, &full.narrow(2, n - 7, 7)?);
    assert!(err < 1e-6, "err {err}");
    Ok(())
}

#[test]
fn bad_shapes_error() -> Result<()> {
    let q = rand_t(&[1, 3, 4, 8], 1, 1.0, DType::F32)?;
    let k = rand_t(&[1, 2, 4, 8], 2, 1.0, DType::F32)?;
    let v = rand_t(&[1, 2, 4, 8], 3, 1.0, DType::F32)?;
    assert!(flash_attention(&q, &k, &v, 1.0, 0, TileProducts::Native).is_err(), "Hq % Hk != 0");
    let q = rand_t(&[1, 2, 4, 6], 1, 1.0, DType::F32)?;
    assert!(flash_attention(&q, &k, &v, 1.0, 0, TileProducts::Native).is_err(), "dk mismatch");
    let q = rand_t(&[1, 2, 4, 8], 1, 1.0, DType::F16)?;
    assert!(
        flash_attention(&q, &k.to_dtype(DType::F16)?, &v.to_dtype(DType::F16)?, 1.0, 0, TileProducts::Native).is_err(),
        "f16"
    );
    Ok(())
}

#[test]
fn long_sequence_f32_accuracy() -> Result<()> {
    // Many key tiles: f32 rounding in the online softmax / tile accumulations must stay < 1e-5.
    let cs = c(1, 2, 1, 1100, 1100, 32, 64, 0, 2.0);
    let scale = 1.0 / (cs.dk as f64).sqrt();
    let (q, k, v) = inputs(&cs, 4242, DType::F64)?;
    let w = rand_t(&[cs.b, cs.hq, cs.t, cs.dv], 4243, 1.0, DType::F64)?;
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let want_out = attn_ref(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, 0)?;
    let gr = (&want_out * &w)?.sum_all()?.backward()?;
    let (q32, k32, v32) = (
        Var::from_tensor(&q.to_dtype(DType::F32)?)?,
        Var::from_tensor(&k.to_dtype(DType::F32)?)?,
        Var::from_tensor(&v.to_dtype(DType::F32)?)?,
    );
    let out = flash_attention(q32.as_tensor(), k32.as_tensor(), v32.as_tensor(), scale, 0, TileProducts::Native)?;
    let err = rel_err(&out, &want_out);
    assert!(err < 1e-5, "out err {err}");
    let gf = (out * w.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
    for (name, a, b) in [("dq", &q32, &qv), ("dk", &k32, &kv), ("dv", &v32, &vv)] {
        let err = rel_err(gf.get(a.as_tensor()).unwrap(), gr.get(b.as_tensor()).unwrap());
        assert!(err < 1e-5, "{name} err {err}");
    }
    Ok(())
}

#[test]
fn backward_twice_through_the_same_graph() -> Result<()> {
    // The saved log-sum-exp must survive the first backward.
    let cs = c(1, 4, 2, 20, 20, 8, 16, 0, 1.0);
    let (q, k, v) = inputs(&cs, 99, DType::F64)?;
    let qv = Var::from_tensor(&q)?;
    let out = flash_attention(qv.as_tensor(), &k, &v, 0.5, 0, TileProducts::Native)?;
    let loss = out.sqr()?.sum_all()?;
    let g1 = loss.backward()?.get(qv.as_tensor()).unwrap().clone();
    let g2 = loss.backward()?.get(qv.as_tensor()).unwrap().clone();
    assert_eq!(flat(&g1), flat(&g2));
    let want = (attn_ref(qv.as_tensor(), &k, &v, 0.5, 0)?.sqr()?.sum_all()?).backward()?;
    assert!(rel_err(&g1, want.get(qv.as_tensor()).unwrap()) < 1e-11);
    Ok(())
}
