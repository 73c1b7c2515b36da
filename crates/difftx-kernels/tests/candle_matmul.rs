//! candle's CPU matmul as vendored here (vendor/README.md) no longer zeroes its output before
//! gemm writes it: every element must then be written by gemm itself, whatever the shape (k = 0,
//! single rows and columns, which gemm sends down other paths), batch and operand layout. Before
//! each product the allocator is handed back blocks of the output's size filled with NaN, so an
//! element gemm skipped would show as NaN, a stale value or (fresh memory) zero instead of the f64
//! reference's. Checked by breaking the patch on purpose (gemm told one row fewer): both tests
//! failed.

use candle_core::{DType, Device, Tensor};

// The allocator of the `difftx` binary: it reuses a freed block of the same size class.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Frees a few blocks of `len` values of each float type filled with NaN, so the next
/// allocations of that size are likely to get one of them back.
fn poison(len: usize) {
    let f32s: Vec<Vec<f32>> = (0..8).map(|_| vec![f32::NAN; len]).collect();
    let f64s: Vec<Vec<f64>> = (0..8).map(|_| vec![f64::NAN; len]).collect();
    drop((f32s, f64s));
}

/// `[b, rows, cols]` with distinct small values; `transposed` stores it as the transpose of a
/// contiguous `[b, cols, rows]` (a strided operand).
fn operand(b: usize, rows: usize, cols: usize, seed: usize, transposed: bool, dtype: DType) -> Tensor {
    let value = |i: usize| ((i * 7 + seed * 13) % 23) as f64 / 8.0 - 1.0;
    let data: Vec<f64> = (0..b * rows * cols).map(value).collect();
    let t = if transposed {
        Tensor::from_vec(data, (b, cols, rows), &Device::Cpu).unwrap().transpose(1, 2).unwrap()
    } else {
        Tensor::from_vec(data, (b, rows, cols), &Device::Cpu).unwrap()
    };
    t.to_dtype(dtype).unwrap()
}

/// `a · b` per batch, in f64 from the operands' values.
fn reference(a: &Tensor, b: &Tensor) -> Vec<Vec<Vec<f64>>> {
    let a = a.to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
    a.iter()
        .zip(&b)
        .map(|(a, b)| {
            let n = b.first().map_or(0, |r| r.len());
            a.iter().map(|row| (0..n).map(|j| row.iter().zip(b).map(|(x, br)| x * br[j]).sum()).collect()).collect()
        })
        .collect()
}

#[test]
fn every_output_element_is_written() {
    let mut checked = 0;
    for dtype in [DType::F32, DType::F64] {
        for b in [1, 3] {
            for (m, k, n) in [
                (1, 0, 1),
                (5, 0, 3),
                (1, 1, 1),
                (1, 7, 17),
                (17, 7, 1),
                (2, 2, 2),
                (3, 64, 5),
                (33, 17, 33),
                (16, 9, 16),
                (40, 64, 24),
            ] {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let a = operand(b, m, k, 1, ta, dtype);
                    let w = operand(b, k, n, 2, tb, dtype);
                    let want = reference(&a, &w);
                    poison(b * m * n);
                    let got = a.matmul(&w).unwrap().to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
                    for (bi, (g, r)) in got.iter().zip(&want).enumerate() {
                        for (i, (gr, rr)) in g.iter().zip(r).enumerate() {
                            for (j, (x, y)) in gr.iter().zip(rr).enumerate() {
                                assert!(
                                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                                    "{dtype:?} b={b} m={m} k={k} n={n} a^T={ta} b^T={tb}: [{bi}, {i}, {j}] is {x}, want {y}"
                                );
                            }
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 160);
}

#[test]
fn a_batch_invariant_rhs_is_written_in_full() {
    // A rhs broadcast over the batch folds the batches into the rows of one product.
    let a = operand(4, 3, 5, 3, false, DType::F32);
    let w = operand(1, 5, 6, 4, false, DType::F32).broadcast_as((4, 5, 6)).unwrap();
    let want = reference(&a, &w.contiguous().unwrap());
    poison(4 * 3 * 6);
    let got = a.matmul(&w).unwrap().to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
    for (g, r) in got.iter().flatten().flatten().zip(want.iter().flatten().flatten()) {
        assert!((g - r).abs() <= 1e-5 * (1.0 + r.abs()), "{g} against {r}");
    }
}
