#!/usr/bin/env python3
"""PyTorch / Hugging Face reference for `difftx bench` (docs/design.md §4.3), printing the same JSON keys.

baseline = LlamaForCausalLM, diff-v1 = DiffLlamaForCausalLM (no diff-v2 in transformers), both
at bench-s: 6 layers, D 256, 8 heads (d 32), SwiGLU 704, vocab 256, f32, torch threads = 2.

* train: tokens/s of fwd + cross-entropy + bwd + clip_grad_norm_(1.0) + AdamW(0.9, 0.95, wd 0.1)
  on batch 8 x 256 random tokens, after warmup steps; the families' timed steps alternate.
* decode: `generate`, batch 1, greedy, KV cache, 256 new tokens after a 16-token prompt.
* attn_long: one layer's self-attention forward (SDPA) on [1, N, 256], each N in a child process
  whose peak RSS (VmHWM) is reported, including its baseline (interpreter, torch, the layer).
* host_matmul: GFLOP/s of one f32 product [batch*seq, 256] @ [704, 256]^T (the median of 5 blocks
  of ~50 ms) before training and after everything, as `difftx bench` times it through candle.

Usage: /tmp/hfvenv/bin/python bench/pytorch_ref.py [--quick] [--families baseline,diff-v1]
       [--steps 10] [--attn-lengths 4096,16384,65536] [--no-attn] [--no-train]
bench/side_by_side.py runs this and `difftx bench` in alternation and prints the ratios.
Not part of the tests (needs torch + transformers).
"""
import argparse
import json
import os
import subprocess
import sys
import time


def rss_mib():
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                k, v = line.split(":")
                vals[k] = int(v.strip().split()[0]) / 1024.0
    return vals["VmHWM"], vals["VmRSS"]


def host_matmul_gflops(m, k=256, n=704, blocks=5):
    import torch

    a = torch.randn(m, k)
    w = torch.randn(n, k)
    t0 = time.perf_counter()
    a @ w.t()
    reps = max(1, min(1000, int(0.05 / max(time.perf_counter() - t0, 1e-6))))
    rates = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(reps):
            a @ w.t()
        rates.append(2.0 * m * k * n * reps / (time.perf_counter() - t) / 1e9)
    return round(sorted(rates)[blocks // 2], 1)


def make_model(family, layers=6, max_pos=512):
    import torch
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    if family == "baseline":
        return LlamaForCausalLM(LlamaConfig(**common)).float()
    if family == "diff-v1":
        return DiffLlamaForCausalLM(DiffLlamaConfig(lambda_std_dev=0.1, **common)).float()
    raise SystemExit(f"no Hugging Face model for family {family}")


class TrainRun:
    """One family's training run; `step(timed)` runs one step on a fresh random batch."""

    def __init__(self, family, batch, seq):
        import torch

        self.model = make_model(family)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.g = torch.Generator().manual_seed(0)
        self.batch, self.seq = batch, seq
        self.ph = dict(forward_loss=0.0, backward=0.0, clip=0.0, adamw=0.0)
        self.times, self.loss_v = [], float("nan")

    def step(self, timed):
        import torch
        import torch.nn.functional as F

        x = torch.randint(0, 256, (self.batch, self.seq), generator=self.g)
        y = torch.randint(0, 256, (self.batch, self.seq), generator=self.g)
        t0 = time.perf_counter()
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.loss_v = loss.item()
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t3 = time.perf_counter()
        self.opt.step()
        t4 = time.perf_counter()
        if timed:
            self.times.append(t4 - t0)
            for k, a, b in (("forward_loss", t0, t1), ("backward", t1, t2), ("clip", t2, t3), ("adamw", t3, t4)):
                self.ph[k] += b - a

    def report(self, warmup):
        steps, total = len(self.times), sum(self.times)
        ms = lambda s: round(s / steps * 1e3, 1)
        return {
            "tokens_per_sec": round(self.batch * self.seq * steps / total),
            "step_ms_mean": ms(total), "step_ms_median": round(sorted(self.times)[steps // 2] * 1e3, 1),
            "phase_ms_mean": {k: ms(v) for k, v in self.ph.items()},
            "steps": steps, "warmup_steps": warmup, "batch": self.batch, "seq": self.seq,
            "params": sum(p.numel() for p in self.model.parameters()), "last_loss": self.loss_v,
        }


def bench_train(families, batch, seq, warmup, steps):
    """Every family's training, timed side by side: after the warmup steps, one timed step of each
    in turn (as `difftx bench` does), so that a shared host's swings in speed fall on all alike."""
    runs = {f: TrainRun(f, batch, seq) for f in families}
    for run in runs.values():
        for _ in range(warmup):
            run.step(False)
    for _ in range(steps):
        for run in runs.values():
            run.step(True)
    return {f: run.report(warmup) for f, run in runs.items()}


def bench_decode(family, prompt_tokens, new_tokens):
    import torch

    model = make_model(family)
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, prompt_tokens), generator=g)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        secs = time.perf_counter() - t0
    n = out.shape[1] - prompt_tokens
    return {"tokens_per_sec": round(n / secs, 1), "new_tokens": int(n), "prompt_tokens": prompt_tokens,
            "secs": round(secs, 3), "includes_prefill": True}


def attn_child(family, n):
    import torch

    hwm_start, _ = rss_mib()
    model = make_model(family, layers=1, max_pos=n)
    model.eval()
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, n, 256)
    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        pe = model.model.rotary_emb(x, position_ids=pos)
        _, rss_before = rss_mib()
        t0 = time.perf_counter()
        y = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
        secs = time.perf_counter() - t0
    hwm, _ = rss_mib()
    return {"family": family, "n": n, "secs": round(secs, 3), "tokens_per_sec": round(n / secs),
            "peak_rss_mib": round(hwm), "rss_before_forward_mib": round(rss_before),
            "rss_at_start_mib": round(hwm_start), "mean_square_out": float(y.pow(2).mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="baseline,diff-v1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--attn-lengths", default="4096,16384,65536")
    ap.add_argument("--no-attn", action="store_true")
    ap.add_argument("--no-train", action="store_true", help="skip the training measurements")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn-child", nargs=2, metavar=("FAMILY", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 1 or a.warmup_steps < 0 or a.threads < 1:
        ap.error("--steps and --threads must be at least 1, --warmup-steps at least 0")

    import torch
    torch.set_num_threads(a.threads)
    if a.attn_child:
        print(json.dumps(attn_child(a.attn_child[0], int(a.attn_child[1]))))
        return

    families = [f for f in a.families.split(",") if f]
    batch, seq, new_tokens, prompt = (8, 256, 256, 16) if not a.quick else (2, 64, 8, 4)
    steps, warmup = (a.steps, a.warmup_steps) if not a.quick else (2, 1)
    lengths = [] if a.no_attn else [int(n) for n in a.attn_lengths.split(",") if n]
    if a.quick:
        lengths = [256, 512]
    train, decode, attn = {}, {}, {}
    matmul_before = host_matmul_gflops(batch * seq)
    if not a.no_train and families:
        print(f"pytorch_ref: training {', '.join(families)} side by side ...", file=sys.stderr)
        train = bench_train(families, batch, seq, warmup, steps)
        for f in families:
            print(f"pytorch_ref: {f} {json.dumps(train[f])}", file=sys.stderr)
    for f in families:
        print(f"pytorch_ref: decoding {f} ...", file=sys.stderr)
        decode[f] = bench_decode(f, prompt, new_tokens)
        print(f"pytorch_ref: {json.dumps(decode[f])}", file=sys.stderr)
    for f in families:
        rows = []
        for n in lengths:
            print(f"pytorch_ref: attn-long {f} N = {n} ...", file=sys.stderr)
            out = subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--attn-child", f, str(n)],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                rows.append({"family": f, "n": n, "error": out.stderr.strip().splitlines()[-1:] or ["failed"]})
            else:
                rows.append(json.loads(out.stdout.strip()))
            print(f"pytorch_ref: {json.dumps(rows[-1])}", file=sys.stderr)
        if rows:
            attn[f] = rows
    ratios = {}
    if "baseline" in train and "diff-v1" in train:
        ratios["train_step_time_diff-v1_over_baseline"] = round(train["diff-v1"]["step_ms_mean"] / train["baseline"]["step_ms_mean"], 3)
    if "baseline" in decode and "diff-v1" in decode:
        ratios["decode_time_diff-v1_over_baseline"] = round(decode["baseline"]["tokens_per_sec"] / decode["diff-v1"]["tokens_per_sec"], 3)
    report = {
        "engine": f"pytorch {torch.__version__} + transformers {__import__('transformers').__version__}",
        "threads": torch.get_num_threads(), "preset": "bench-s" if not a.quick else "quick",
        "batch": batch, "seq": seq, "dtype": "f32",
        "host_matmul": {"shape_m_k_n": [batch * seq, 256, 704], "gflops_before": matmul_before,
                        "gflops_after": host_matmul_gflops(batch * seq)},
        "train": train, "train_reference_kernels": {}, "decode": decode, "ratios": ratios, "attn_long": attn,
        "notes": "HF LlamaForCausalLM (baseline) / DiffLlamaForCausalLM (diff-v1), SDPA; attn_long peak_rss_mib is the child's VmHWM including its baseline (rss_before_forward_mib)",
    }
    print(json.dumps(report, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
