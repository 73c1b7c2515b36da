//! The issue rate of `vdpbf16ps` against 16-wide f32 FMAs on one core: sixteen independent
//! accumulator chains each (more than latency × throughput on the CPUs seen so far), nothing
//! else in the loop. What decides whether bf16 products can beat f32 on a CPU without AMX
//! (`difftx_kernels::bf16_outpaces_f32`, docs/design.md §7.26).
//!
//! Usage: `cargo run --release -p difftx-kernels --example bf16_dot_rate [-- ITERATIONS]`
//! (default 50,000,000 per round, three rounds). Prints one JSON document: per round, G
//! instructions/s and GMAC/s of each; `vdpbf16ps` is left out where the CPU lacks AVX512_BF16.
use std::time::Instant;

fn main() {
    let iters: usize = match std::env::args().nth(1).map(|s| s.parse()) {
        None => 50_000_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("bf16_dot_rate: ITERATIONS must be a positive integer");
            std::process::exit(2);
        }
    };
    #[cfg(target_arch = "x86_64")]
    {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("bf16_dot_rate: this CPU has no AVX-512F");
            std::process::exit(1);
        }
        let bf16 = std::is_x86_feature_detected!("avx512bf16");
        let mut rounds = Vec::new();
        for _ in 0..3 {
            let rate = |secs: f64, macs_per_instr: f64| {
                let instrs = (CHAINS * iters) as f64;
                format!(
                    "{{\"g_instr_per_s\": {:.2}, \"gmac_per_s\": {:.1}}}",
                    instrs / secs / 1e9,
                    instrs * macs_per_instr / secs / 1e9
                )
            };
            let t = Instant::now();
            // SAFETY: AVX-512F was detected above.
            let sink_fma = unsafe { x86::fma_chains(iters) };
            let fma = rate(t.elapsed().as_secs_f64(), 16.0);
            let dp = if bf16 {
                let t = Instant::now();
                // SAFETY: AVX-512F and AVX512_BF16 were detected above.
                let sink = unsafe { x86::dpbf16_chains(iters) };
                std::hint::black_box(sink);
                rate(t.elapsed().as_secs_f64(), 32.0)
            } else {
                "null".into()
            };
            std::hint::black_box(sink_fma);
            rounds.push(format!("{{\"f32_fma\": {fma}, \"vdpbf16ps\": {dp}}}"));
        }
        println!("{{\"chains\": {CHAINS}, \"iterations\": {iters}, \"rounds\": [\n  {}\n]}}", rounds.join(",\n  "));
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        eprintln!("bf16_dot_rate: x86_64 only");
        std::process::exit(1);
    }
}

/// Independent accumulators per loop.
const CHAINS: usize = 16;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_chains(iters: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let (a, b) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-30));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(a, b, *v);
            }
            // Keeps the compiler from collapsing the iterations.
            std::arch::asm!("", options(nomem, nostack));
        }
        _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)))
    }

    /// # Safety
    /// The CPU must have AVX-512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_chains(iters: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        // bf16 pairs (1.0, 1.0) and (2^-7, 2^-7): normal values, so no denormal handling.
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3c00_3c00));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
            std::arch::asm!("", options(nomem, nostack));
        }
        _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)))
    }
}
