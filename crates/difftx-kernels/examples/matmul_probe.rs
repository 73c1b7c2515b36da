//! GMAC/s and GB/s of `matmul_packed` at batch 1 from cache (one weight) and from memory (28
//! weights, 19 MiB in f32), f32 and bf16: the decode roofline of this machine; then GMAC/s of
//! several rows at once (batched decode) on the 28 weights and on one weight in cache, f32 and
//! bf16 (whose products round the rows to bf16 too). Runs on
//! a rayon worker, as the fused decoder does, so products split over the pool's threads
//! (`RAYON_NUM_THREADS=1`: one).
use difftx_kernels::decode::{matmul_packed, PackedWeight, WeightPrecision};
fn main() {
    println!("{} threads", rayon::current_num_threads());
    rayon::scope(|_| probe());
}

fn probe() {
    for precision in [WeightPrecision::F32, WeightPrecision::Bf16] {
        let bytes_per = if precision == WeightPrecision::F32 { 4.0 } else { 2.0 };
        for &(n_w, reps) in &[(1usize, 5000usize), (28, 200)] {
            let ws: Vec<PackedWeight> = (0..n_w)
                .map(|k| {
                    PackedWeight::from_rows_as(
                        &(0..704 * 256).map(|i| ((i + k) % 7) as f32 * 0.1).collect::<Vec<_>>(),
                        256,
                        precision,
                    )
                })
                .collect();
            let x = vec![0.5f32; 256];
            let mut y = vec![0f32; 704];
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                for w in &ws {
                    matmul_packed(&x, w, &mut y);
                }
            }
            let s = t0.elapsed().as_secs_f64();
            let macs = (reps * n_w * 704 * 256) as f64;
            println!(
                "{precision:?} {:.1} MiB of weights: {:.1} GMAC/s, {:.1} GB/s, {:.2} us per 704x256 matmul",
                n_w as f64 * 704.0 * 256.0 * bytes_per / (1 << 20) as f64,
                macs / s / 1e9,
                macs * bytes_per / s / 1e9,
                s / (reps * n_w) as f64 * 1e6
            );
        }
    }
    for precision in [WeightPrecision::F32, WeightPrecision::Bf16] {
        let ws: Vec<PackedWeight> = (0..28)
            .map(|k| {
                let w: Vec<f32> = (0..704 * 256).map(|i| ((i + k) % 7) as f32 * 0.1).collect();
                PackedWeight::from_rows_as(&w, 256, precision)
            })
            .collect();
        for rows in [1usize, 2, 3, 4, 5, 6, 7, 8, 16] {
            println!("{precision:?} {rows} rows: {:.1} GMAC/s", rows_gmacs(&ws, rows, 100));
        }
        // One 256 × 256 weight (256 KiB in f32, kept in cache): the kernel's own speed, to set
        // beside the same row counts from memory above.
        let w: Vec<f32> = (0..256 * 256).map(|i| (i % 7) as f32 * 0.1).collect();
        let cached = [PackedWeight::from_rows_as(&w, 256, precision)];
        for rows in [1usize, 2, 3, 4, 6, 8, 16] {
            println!(
                "{precision:?} {rows} rows, one 256x256 weight (cache): {:.1} GMAC/s",
                rows_gmacs(&cached, rows, 20000 / rows)
            );
        }
    }
}

/// GMAC/s of `rows` rows multiplied by every weight of `ws` in turn, `reps` times.
fn rows_gmacs(ws: &[PackedWeight], rows: usize, reps: usize) -> f64 {
    let x = vec![0.5f32; rows * ws[0].in_dim()];
    let mut y = vec![0f32; rows * ws[0].out_dim()];
    let t0 = std::time::Instant::now();
    for _ in 0..reps {
        for w in ws {
            matmul_packed(&x, w, &mut y);
        }
    }
    let macs: usize = ws.iter().map(|w| rows * w.in_dim() * w.out_dim()).sum();
    (reps * macs) as f64 / t0.elapsed().as_secs_f64() / 1e9
}
