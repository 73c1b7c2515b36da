//! bf16 matrix products as candle ops: the AMX / AVX512_BF16 kernel against its emulation (f32
//! gemm on bf16-rounded copies) and against an f64 reference of the rounded operands, forward
//! and backward, on awkward shapes and transposed (strided) operands.

mod common;
use candle_core::{DType, Tensor, Var};
use common::{flat, rand_t, rel_err};
use difftx_kernels::bf16_matmul::{bf16_bits, bf16_to_f32};
use difftx_kernels::{bf16_backend, matmul_bf16, matmul_bf16_emulated};

/// `t` rounded to bf16 values, in f64.
fn round(t: &Tensor) -> Tensor {
    let v: Vec<f64> = flat(t).iter().map(|&x| bf16_to_f32(bf16_bits(x as f32)) as f64).collect();
    Tensor::from_vec(v, t.dims(), t.device()).unwrap()
}

/// a·b of the bf16-rounded operands in f64: the product both paths approximate.
fn reference(a: &Tensor, b: &Tensor) -> Tensor {
    round(a).matmul(&round(b)).unwrap()
}

/// (C, dA, dB) of loss = Σ C ⊙ G through `product`.
fn run(
    product: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    let (va, vb) = (Var::from_tensor(a).unwrap(), Var::from_tensor(b).unwrap());
    let c = product(va.as_tensor(), vb.as_tensor()).unwrap();
    let grads = (&c * g).unwrap().sum_all().unwrap().backward().unwrap();
    (c, grads.get(va.as_tensor()).unwrap().clone(), grads.get(vb.as_tensor()).unwrap().clone())
}

/// Operands of every layout the model uses: x·wᵀ (forward), dy·w (dx) and dyᵀ·x (dw).
fn cases() -> Vec<(String, Tensor, Tensor)> {
    let mut out = Vec::new();
    for (s, &(m, k, n)) in [(1, 1, 1), (3, 5, 7), (33, 64, 17), (70, 100, 45), (45, 1000, 700)].iter().enumerate() {
        let seed = 10 * s as u64;
        let a = rand_t(&[m, k], seed, 2.0, DType::F32).unwrap();
        let b = rand_t(&[k, n], seed + 1, 2.0, DType::F32).unwrap();
        out.push((format!("{m}x{k}x{n} contiguous"), a.clone(), b.clone()));
        let bt = rand_t(&[n, k], seed + 2, 2.0, DType::F32).unwrap().t().unwrap();
        out.push((format!("{m}x{k}x{n} B transposed"), a.clone(), bt));
        let at = rand_t(&[k, m], seed + 3, 2.0, DType::F32).unwrap().t().unwrap();
        out.push((format!("{m}x{k}x{n} A transposed"), at, b));
    }
    out
}

#[test]
fn emulation_matches_the_f64_reference_forward_and_backward() {
    for (label, a, b) in cases() {
        let g = rand_t(&[a.dim(0).unwrap(), b.dim(1).unwrap()], 99, 1.0, DType::F32).unwrap();
        let (c, da, db) = run(matmul_bf16_emulated, &a, &b, &g);
        // dA = bf16(G)·bf16(B)ᵀ, dB = bf16(A)ᵀ·bf16(G): the gradient is rounded like an operand.
        let (ra, rb) = (round(&a), round(&b));
        let want_da = round(&g).matmul(&rb.t().unwrap()).unwrap();
        let want_db = ra.t().unwrap().matmul(&round(&g)).unwrap();
        assert!(rel_err(&c, &reference(&a, &b)) < 1e-5, "{label}: forward");
        assert!(rel_err(&da, &want_da) < 1e-5, "{label}: dA");
        assert!(rel_err(&db, &want_db) < 1e-5, "{label}: dB");
    }
}

#[test]
fn kernel_matches_the_emulation_forward_and_backward() {
    let Some(backend) = bf16_backend() else {
        eprintln!("skipped: this CPU has neither AMX-BF16 nor AVX512_BF16");
        return;
    };
    for (label, a, b) in cases() {
        let g = rand_t(&[a.dim(0).unwrap(), b.dim(1).unwrap()], 99, 1.0, DType::F32).unwrap();
        let (c, da, db) = run(matmul_bf16, &a, &b, &g);
        let (ce, dae, dbe) = run(matmul_bf16_emulated, &a, &b, &g);
        // Same rounded inputs; the f32 sums run in another order.
        for (what, x, y) in [("forward", &c, &ce), ("dA", &da, &dae), ("dB", &db, &dbe)] {
            let e = rel_err(x, y);
            assert!(e < 1e-5, "{backend:?} {label}: {what} differs from the emulation by {e}");
        }
    }
}

#[test]
fn linear_equals_the_product_with_the_transposed_weight() {
    // linear_bf16(x, w) against matmul_bf16(x, wᵀ): the same products, so the same bits forward
    // and in both gradients; only the weight gradient's route (a blocked transpose instead of
    // candle's strided copy) differs. Shapes with partial 32-blocks on every side.
    type Product = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
    let mut pairs: Vec<(&str, Product, Product)> =
        vec![("emulated", difftx_kernels::linear_bf16_emulated, |x, w| matmul_bf16_emulated(x, &w.t()?))];
    if bf16_backend().is_some() {
        pairs.push(("kernel", difftx_kernels::linear_bf16, |x, w| matmul_bf16(x, &w.t()?)));
    }
    for (m, k, n) in [(1, 1, 1), (3, 5, 7), (70, 100, 45), (45, 1000, 700)] {
        let x = rand_t(&[m, k], 1, 2.0, DType::F32).unwrap();
        let w = rand_t(&[n, k], 2, 2.0, DType::F32).unwrap();
        let g = rand_t(&[m, n], 3, 1.0, DType::F32).unwrap();
        for &(label, linear, product) in &pairs {
            let (y, dx, dw) = run(linear, &x, &w, &g);
            let (y2, dx2, dw2) = run(product, &x, &w, &g);
            for (what, a, b) in [("y", &y, &y2), ("dx", &dx, &dx2), ("dw", &dw, &dw2)] {
                assert_eq!(flat(a), flat(b), "{label} {m}x{k}x{n}: {what}");
            }
        }
    }
}

#[test]
fn bf16_stays_within_bf16_error_of_f32() {
    // Against the exact f32 product: inputs carry 8 significant bits.
    let a = rand_t(&[64, 256], 1, 1.0, DType::F32).unwrap();
    let b = rand_t(&[256, 96], 2, 1.0, DType::F32).unwrap();
    let exact = a.matmul(&b).unwrap();
    let e = rel_err(&matmul_bf16_emulated(&a, &b).unwrap(), &exact);
    assert!(e > 1e-5 && e < 1e-2, "bf16 vs f32: {e}");
}

#[test]
fn bad_operands_are_errors() {
    let a = rand_t(&[3, 4], 1, 1.0, DType::F32).unwrap();
    let b = rand_t(&[5, 2], 2, 1.0, DType::F32).unwrap();
    assert!(matmul_bf16_emulated(&a, &b).unwrap_err().to_string().contains("cannot multiply"));
    let a64 = rand_t(&[3, 4], 1, 1.0, DType::F64).unwrap();
    let b4 = rand_t(&[4, 2], 2, 1.0, DType::F32).unwrap();
    assert!(matmul_bf16_emulated(&a64, &b4).unwrap_err().to_string().contains("f32 operands only"));
    if bf16_backend().is_some() {
        assert!(matmul_bf16(&a, &b).unwrap_err().to_string().contains("cannot multiply"));
    }
    // The linear form: x [3, 4] against a weight of input size 2, a rank-1 weight, f64, no rows.
    use difftx_kernels::{linear_bf16, linear_bf16_emulated};
    let w = rand_t(&[5, 2], 3, 1.0, DType::F32).unwrap();
    let mut linears: Vec<fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>> = vec![linear_bf16_emulated];
    if bf16_backend().is_some() {
        linears.push(linear_bf16);
    }
    for linear in linears {
        assert!(linear(&a, &w).unwrap_err().to_string().contains("does not end in the weight's input size 2"));
        assert!(linear(&a, &rand_t(&[4], 4, 1.0, DType::F32).unwrap()).is_err(), "rank-1 weight");
        assert!(linear(&a64, &rand_t(&[2, 4], 5, 1.0, DType::F32).unwrap())
            .unwrap_err()
            .to_string()
            .contains("f32 operands only"));
        let empty =
            linear(&rand_t(&[0, 4], 6, 1.0, DType::F32).unwrap(), &rand_t(&[2, 4], 7, 1.0, DType::F32).unwrap())
                .unwrap();
        assert_eq!(empty.dims(), &[0, 2]);
    }
}
