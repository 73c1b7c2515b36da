#!/usr/bin/env python3
"""Fixtures for the seed demo tests (crates/difftx-experiments/tests/demo_*.rs).

Runs the source article's numpy code ("Step 1" and "Step 2", copied faithfully below; the only
change is that the analysis half of `verify_diff_transformer` also runs on Q, K, V given from
outside) and records what it prints:

* qkv_small.npz   : small random float64 Q, K, V of shape (B, H, N, d_head), saved with np.savez
* expected.json   : the printed lines for qkv_small.npz, for the article's own synthetic setup
                    (np.random.seed(42)), and a few np.random.randn draws to test the Rust port of
                    numpy's legacy RandomState.

Usage: python3 scripts/seed_demo_fixture.py [OUT_DIR]   (needs numpy only)
"""
import contextlib
import io
import json
import os
import sys

import numpy as np


# ---- The article's code, verbatim ------------------------------------------------------------
def stable_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax implementation."""
    max_vals = np.max(x, axis=axis, keepdims=True)
    exp_x = np.exp(x - max_vals)
    return exp_x / np.sum(exp_x, axis=axis, keepdims=True)


class MultiHeadDifferentialAttention:
    def __init__(self, d_model: int = 64, n_heads: int = 4, layer_idx: int = 1):
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        assert self.d_head % 2 == 0, "Head dimension must be divisible by 2 for DiffAttn."
        # Each sub-head receives d_k = d_head / 2
        self.d_k = self.d_head // 2
        # Depth-dependent lambda initialization
        self.lambda_init = 0.8 - 0.6 * np.exp(-0.3 * (layer_idx - 1))
        self.lambda_scalar = self.lambda_init

    def forward(self, Q: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple:
        B, H, N, D = Q.shape
        scale = 1.0 / np.sqrt(self.d_k)
        # 1. Split Q and K into two halves along feature dimension
        Q1, Q2 = Q[:, :, :, :self.d_k], Q[:, :, :, self.d_k:]
        K1, K2 = K[:, :, :, :self.d_k], K[:, :, :, self.d_k:]
        # 2. Compute dual dot-product attention scores
        scores1 = (Q1 @ K1.transpose(0, 1, 3, 2)) * scale
        scores2 = (Q2 @ K2.transpose(0, 1, 3, 2)) * scale
        # 3. Compute dual softmax attention maps
        A1 = stable_softmax(scores1, axis=-1)
        A2 = stable_softmax(scores2, axis=-1)
        # 4. Subtractive noise cancellation: A_diff = A1 - lambda * A2
        A_diff = A1 - self.lambda_scalar * A2
        # 5. Multiply by values
        out = A_diff @ V
        # 6. Apply gradient alignment multiplier: (1 - lambda_init)
        out = out * (1.0 - self.lambda_init)
        return out, A_diff, A1, A2


def verify_diff_transformer():
    np.random.seed(42)
    B, H, N, D = 1, 4, 128, 64
    d_head = D // H
    d_k = d_head // 2
    # Initialize representations
    Q = np.random.randn(B, H, N, d_head) * 0.1
    K = np.random.randn(B, H, N, d_head) * 0.1
    V = np.random.randn(B, H, N, d_head)
    # Inject a specific factual association (target needle at token 20)
    target_idx = 20
    K[:, :, target_idx, :d_k] += 3.0  # Strong signal in sub-head 1
    Q[:, :, :, :d_k] += 0.8  # Queries searching for signal
    # Inject pervasive common-mode background noise across all tokens
    common_noise = np.random.randn(1, 1, 1, d_k) * 1.5
    K[:, :, :, :d_k] += common_noise
    K[:, :, :, d_k:] += common_noise
    Q[:, :, :, d_k:] += common_noise
    analyze(Q, K, V)


# The analysis half of verify_diff_transformer, verbatim, with Q, K, V as arguments
# (D, d_head, d_k, target_idx and N as the article derives them).
def analyze(Q, K, V, target_idx=20):
    B, H, N, d_head = Q.shape
    D = H * d_head
    # Baseline: Standard Attention
    std_scale = 1.0 / np.sqrt(d_head)
    std_scores = (Q @ K.transpose(0, 1, 3, 2)) * std_scale
    std_attn = stable_softmax(std_scores, axis=-1)
    std_out = std_attn @ V
    # Differential Attention
    diff_layer = MultiHeadDifferentialAttention(d_model=D, n_heads=H, layer_idx=3)
    diff_out, diff_attn, _, _ = diff_layer.forward(Q, K, V)
    # Analyze Signal-to-Noise Ratio (SNR) for Query Token 60
    q_idx = 60
    noise_indices = [i for i in range(N) if i != target_idx]
    std_target_mass = std_attn[0, 0, q_idx, target_idx]
    std_avg_noise = np.mean(std_attn[0, 0, q_idx, noise_indices])
    std_snr = std_target_mass / (std_avg_noise + 1e-9)
    diff_target_mass = diff_attn[0, 0, q_idx, target_idx]
    diff_avg_noise = np.mean(np.abs(diff_attn[0, 0, q_idx, noise_indices]))
    diff_snr = diff_target_mass / (diff_avg_noise + 1e-9)
    print("--- 1. Attention Signal-to-Noise Ratio (SNR) ---")
    print(f"Standard Attention Target Weight: {std_target_mass:.4f}")
    print(f"Standard Attention Avg Noise Weight: {std_avg_noise:.6f}")
    print(f"Standard Attention SNR: {std_snr:.1f}x")
    print(f"DiffAttn Target Net Weight: {diff_target_mass:.4f}")
    print(f"DiffAttn Avg Residual Noise Weight: {diff_avg_noise:.6f}")
    print(f"DiffAttn SNR: {diff_snr:.1f}x")
    print(f"Signal-to-Noise Improvement: {diff_snr / std_snr:.1f}x cleaner attention!")
    # Analyze Activation Outliers (Peak vs Median)
    std_peak_outlier = np.max(np.abs(std_out)) / np.median(np.abs(std_out))
    diff_peak_outlier = np.max(np.abs(diff_out)) / np.median(np.abs(diff_out))
    print("\n--- 2. Activation Outlier Profile ---")
    print(f"Standard Attention Peak/Median Outlier Ratio: {std_peak_outlier:.2f}")
    print(f"DiffAttn Peak/Median Outlier Ratio: {diff_peak_outlier:.2f}")
    print("DiffAttn successfully suppresses extreme activation spikes for low-bit quantization.")
# ----------------------------------------------------------------------------------------------


def captured(fn, *args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue().splitlines()


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "crates", "difftx-experiments", "tests", "fixtures", "demo")
    os.makedirs(out_dir, exist_ok=True)

    # Small random arrays with a planted needle (so the numbers are not all noise):
    # B=2, H=3, N=64 (the article reads query 60 and target 20), d_head=8.
    rng = np.random.RandomState(1234)
    B, H, N, d_head = 2, 3, 64, 8
    d_k = d_head // 2
    Q = rng.randn(B, H, N, d_head) * 0.3
    K = rng.randn(B, H, N, d_head) * 0.3
    V = rng.randn(B, H, N, d_head)
    K[:, :, 20, :d_k] += 2.0
    Q[:, :, :, :d_k] += 0.7
    common = rng.randn(1, 1, 1, d_k)
    K[:, :, :, :d_k] += common
    K[:, :, :, d_k:] += common
    Q[:, :, :, d_k:] += common
    npz = os.path.join(out_dir, "qkv_small.npz")
    np.savez(npz, Q=Q, K=K, V=V)
    with np.load(npz) as f:
        lines_npz = captured(analyze, f["Q"], f["K"], f["V"])

    lines_synth = captured(verify_diff_transformer)

    draws = {}
    for seed, n in [(42, 7), (0, 5), (2024, 3)]:
        np.random.seed(seed)
        draws[str(seed)] = [float(x) for x in np.random.randn(n)]

    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump({
            "numpy_version": np.__version__,
            "npz_file": "qkv_small.npz",
            "npz_output": lines_npz,
            "synthetic_output": lines_synth,
            "randn": draws,
        }, f, indent=2)
        f.write("\n")
    print("\n".join(lines_synth))
    print()
    print("\n".join(lines_npz))


if __name__ == "__main__":
    main()
