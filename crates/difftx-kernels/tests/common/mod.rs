#![allow(dead_code)]
use candle_core::{DType, Device, Result, Tensor};

/// Deterministic splitmix64 uniform numbers in [-1, 1).
pub fn uniform(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

pub fn rand_t(dims: &[usize], seed: u64, scale: f64, dt: DType) -> Result<Tensor> {
    let n = dims.iter().product();
    let v: Vec<f64> = uniform(n, seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dt)
}

pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// max |a - b| / max(max |b|, 1e-30)
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let (a, b) = (flat(a), flat(b));
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    let diff = a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff.is_finite(), "non-finite difference");
    diff / scale
}

/// Central finite differences of the scalar function `f` at `x` (f64), for every element.
pub fn finite_diff(x: &Tensor, f: impl Fn(&Tensor) -> Result<f64>, h: f64) -> Result<Vec<f64>> {
    let base = flat(x);
    let mut g = Vec::with_capacity(base.len());
    for i in 0..base.len() {
        let mut p = base.clone();
        p[i] += h;
        let fp = f(&Tensor::from_vec(p.clone(), x.dims(), &Device::Cpu)?)?;
        p[i] -= 2.0 * h;
        let fm = f(&Tensor::from_vec(p, x.dims(), &Device::Cpu)?)?;
        g.push((fp - fm) / (2.0 * h));
    }
    Ok(g)
}

pub fn max_rel_vec(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}
