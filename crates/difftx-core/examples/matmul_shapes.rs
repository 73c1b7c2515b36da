//! GFLOP/s of candle's f32 matmul on the bench-s training shapes (tokens 2048 = 8 × 256), to set
//! beside PyTorch's on the same machine: `cargo run --release -p difftx-core --example matmul_shapes`.
use candle_core::{Device, Tensor};

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for &(m, k, n) in
        &[(2048usize, 256usize, 768usize), (2048, 256, 1408), (2048, 704, 256), (2048, 256, 256), (1024, 1024, 1024)]
    {
        let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        let bt = b.t()?;
        a.matmul(&bt)?; // warm
        let reps = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            a.matmul(&bt)?;
        }
        let s = t0.elapsed().as_secs_f64() / reps as f64;
        println!("{m}x{k} · ({n}x{k})ᵀ: {:.1} GFLOP/s ({:.2} ms)", 2.0 * (m * k * n) as f64 / s / 1e9, s * 1e3);
    }
    Ok(())
}
