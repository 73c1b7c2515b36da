//! Forward outputs that their kernels write without a zero fill first (`pair_values`,
//! `diff_combine_pairs`, the differential ops' internals): every value must be written by the
//! kernel itself. Before each call the allocator is handed back blocks of the output's size
//! filled with NaN, so a value the kernel skipped would show as NaN or a stale value instead of
//! the element-by-element reference's. Checked by breaking a kernel on purpose (one row
//! skipped): the test failed.

use candle_core::{Device, Tensor};
use difftx_kernels::{diff_combine_pairs, pair_values, PairLayout};

// The allocator of the `difftx` binary: it reuses a freed block of the same size class.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Frees a few NaN-filled blocks of `len` f32 values, so the next allocation of that size is
/// likely to get one of them back.
fn poison(len: usize) {
    drop((0..8).map(|_| vec![f32::NAN; len]).collect::<Vec<_>>());
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed * 13) % 23) as f32 / 8.0 - 1.0).collect()
}

/// The pair `(a, b)` of heads that pair j (or head i's pair) is made of.
fn pair(layout: PairLayout, heads: usize, j: usize) -> (usize, usize) {
    match layout {
        PairLayout::Interleaved => (2 * j, 2 * j + 1),
        PairLayout::Halves => (j, j + heads / 2),
    }
}

#[test]
fn pair_values_writes_every_value() {
    for layout in [PairLayout::Interleaved, PairLayout::Halves] {
        for (b, h, s, d) in [(1, 2, 1, 1), (2, 4, 5, 3), (3, 6, 17, 8), (2, 8, 64, 32)] {
            let v = values(b * h * s * d, 1);
            poison(2 * v.len());
            let got = pair_values(&Tensor::from_vec(v.clone(), (b, h, s, d), &Device::Cpu).unwrap(), layout).unwrap();
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let at = |bi: usize, hi: usize, si: usize| &v[((bi * h + hi) * s + si) * d..][..d];
            let mut want = Vec::with_capacity(got.len());
            for bi in 0..b {
                for i in 0..h {
                    // head i belongs to the pair j whose heads include it
                    let j = match layout {
                        PairLayout::Interleaved => i / 2,
                        PairLayout::Halves => i % (h / 2),
                    };
                    let (a, c) = pair(layout, h, j);
                    for si in 0..s {
                        want.extend_from_slice(at(bi, a, si));
                        want.extend_from_slice(at(bi, c, si));
                    }
                }
            }
            assert_eq!(got, want, "{layout:?} {b}x{h}x{s}x{d}");
        }
    }
}

#[test]
fn diff_combine_pairs_writes_every_value() {
    for layout in [PairLayout::Interleaved, PairLayout::Halves] {
        for per_position in [false, true] {
            for (b, heads, t, w) in [(1, 2, 1, 1), (2, 4, 5, 3), (3, 6, 17, 8), (2, 8, 64, 32)] {
                let p = heads / 2;
                let x = values(b * heads * t * w, 2);
                let lam = if per_position { values(b * p * t, 3) } else { vec![0.375] };
                let lam_t = if per_position {
                    Tensor::from_vec(lam.clone(), (b, p, t, 1), &Device::Cpu).unwrap()
                } else {
                    Tensor::from_vec(lam.clone(), 1, &Device::Cpu).unwrap()
                };
                poison(b * p * t * w);
                let xt = Tensor::from_vec(x.clone(), (b, heads, t, w), &Device::Cpu).unwrap();
                let got: Vec<f32> =
                    diff_combine_pairs(&xt, &lam_t, layout).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let mut want = Vec::with_capacity(got.len());
                for bi in 0..b {
                    for j in 0..p {
                        let (ha, hb) = pair(layout, heads, j);
                        for ti in 0..t {
                            let l = if per_position { lam[(bi * p + j) * t + ti] } else { lam[0] };
                            for c in 0..w {
                                let at = |hh: usize| x[((bi * heads + hh) * t + ti) * w + c];
                                want.push(at(ha) - l * at(hb));
                            }
                        }
                    }
                }
                assert_eq!(got, want, "{layout:?} per-position {per_position} {b}x{heads}x{t}x{w}");
            }
        }
    }
}
