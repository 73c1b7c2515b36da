#!/usr/bin/env python3
"""PyTorch's f32 matmul GFLOP/s on the bench-s training shapes, 2 threads: the same products as
`cargo run --release -p difftx-core --example matmul_shapes` (candle + gemm), to run beside it.

Usage: VENV/bin/python bench/torch_matmul_shapes.py   (needs torch; not part of the tests)
"""
import time

import torch

torch.set_num_threads(2)
for m, k, n in [(2048, 256, 768), (2048, 256, 1408), (2048, 704, 256), (2048, 256, 256), (1024, 1024, 1024)]:
    a = torch.randn(m, k)
    bt = torch.randn(n, k).t()
    a @ bt  # warm
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ bt
    s = (time.perf_counter() - t0) / reps
    print(f"{m}x{k} · ({n}x{k})ᵀ: {2 * m * k * n / s / 1e9:.1f} GFLOP/s ({s * 1e3:.2f} ms)")
