#!/usr/bin/env python3
"""difftx against PyTorch / Hugging Face on the same shapes, side by side, in one run.

Runs `difftx bench` and `bench/pytorch_ref.py` alternately for a few rounds on this machine and
prints one JSON report: the CPU (from difftx's report), every round's tokens/s of both engines, and
the ratios of each round (difftx / PyTorch), so that machine noise shows as spread between rounds
rather than as a bias of one engine. Each round also has both engines' f32 matmul GFLOP/s on the
training step's SwiGLU input product (`host_matmul_gflops`): the training ratio read beside it. difftx's bf16 training (`train_bf16`, where the CPU has AMX or
AVX512_BF16 faster than f32) is compared with PyTorch's f32 training; where `--precision bf16`
runs f32 instead, each round keeps difftx's reason (`train_bf16_note`) and the summary says so.

difftx also times diff-v2 (PyTorch has no counterpart): its step-time ratio over the baseline, and
every DIFF / baseline step ratio again as the median of the round's paired steps with a 95%
interval (`..._paired`, from `difftx bench`).

The report and each round say when they ran (`started_utc`, `finished_utc`: shared hosts change
speed by the hour). It ends with a `summary`: each figure's lowest and highest value over the
rounds, for each target of issue #10 that a round can check, in how many rounds it was met, and
for each paired step ratio, in how many rounds its interval lay wholly below 1.10, wholly above
it, or around it.

Usage:
    python3 bench/side_by_side.py --python /tmp/hfvenv/bin/python [--rounds 2] [--no-train]
        [--no-attn] [--steps 10] [--difftx ./target/release/difftx]
    python3 bench/side_by_side.py --summarize REPORT.json   (the summary of an earlier report)

The PyTorch interpreter needs torch and transformers (`pip install torch transformers` in a venv).
Stdlib only here; not part of the tests.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd):
    print("side_by_side: " + " ".join(cmd), file=sys.stderr)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"side_by_side: cannot run {cmd[0]}: {e} (build it with `cargo build --release -p difftx-cli`, or pass --difftx / --python)")
    if out.returncode != 0:
        sys.exit(f"side_by_side: {cmd[0]} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def get(report, *path):
    for key in path:
        if not isinstance(report, dict) or key not in report:
            return None
        report = report[key]
    return report


# The targets that one round can check: (name, section, key, test).
TARGETS = [
    ("diff-v1 training >= 1.5x PyTorch (f32)", "ratio_difftx_over_pytorch", "train_diff-v1_tokens_per_sec", lambda x: x >= 1.5),
    ("diff-v1 training --precision bf16 >= 2.5x PyTorch f32", "ratio_difftx_over_pytorch",
     "train_bf16_diff-v1_tokens_per_sec_over_pytorch_f32", lambda x: x >= 2.5),
    ("diff-v1 / baseline step time <= 1.10", "difftx", "train_step_time_diff-v1_over_baseline", lambda x: x <= 1.10),
    ("diff-v2 / baseline step time <= 1.10", "difftx", "train_step_time_diff-v2_over_baseline", lambda x: x <= 1.10),
    ("diff-v1 decode >= 10x HF generate", "ratio_difftx_over_pytorch", "decode_diff-v1_tokens_per_sec", lambda x: x >= 10),
    ("diff-v1 decode >= 2,000 tokens/s", "difftx", "decode_diff-v1_tokens_per_sec", lambda x: x >= 2000),
    ("diff-v1 / baseline decode time <= 1.10", "difftx", "decode_time_diff-v1_over_baseline", lambda x: x <= 1.10),
    # The same plain f32 decoder with its model alone in the process, as Hugging Face's
    # `generate` is timed (the figures above step the families in turn; design.md §7.29).
    ("diff-v1 decode alone >= 10x HF generate", "ratio_difftx_over_pytorch",
     "decode_diff-v1_alone_tokens_per_sec_over_hf_generate", lambda x: x >= 10),
    ("diff-v1 decode alone >= 2,000 tokens/s", "difftx", "decode_diff-v1_alone_tokens_per_sec", lambda x: x >= 2000),
    # Speculative decoding (a bf16 draft checked by the f32 decoder): plain greedy's tokens.
    ("diff-v1 speculative decode >= 10x HF generate", "ratio_difftx_over_pytorch",
     "decode_diff-v1_speculative_tokens_per_sec_over_hf_generate", lambda x: x >= 10),
    ("diff-v1 speculative decode >= 2,000 tokens/s", "difftx", "decode_diff-v1_speculative_tokens_per_sec",
     lambda x: x >= 2000),
]


def utc_now():
    """The wall-clock time in UTC, to the second: when a set and each of its rounds ran, for
    labelling the figures (shared hosts change speed by the hour)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def summarize(rounds):
    """Lowest and highest value of every numeric figure over the rounds (nested dicts such as
    the batched decode figures by their keys), and the rounds meeting each target."""
    ranges = {}
    for row in rounds:
        for section in ["difftx", "pytorch", "ratio_difftx_over_pytorch"]:
            for key, value in row.get(section, {}).items():
                items = value.items() if isinstance(value, dict) else [(None, value)]
                for sub, x in items:
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        name = f"{section}.{key}" + (f".{sub}" if sub is not None else "")
                        lo_hi = ranges.setdefault(name, [x, x])
                        lo_hi[0], lo_hi[1] = min(lo_hi[0], x), max(lo_hi[1], x)
    targets = {}
    for name, section, key, test in TARGETS:
        values = [row.get(section, {}).get(key) for row in rounds]
        values = [x for x in values if isinstance(x, (int, float))]
        if values:
            targets[name] = f"{sum(1 for x in values if test(x))} of {len(values)} rounds"
    notes = {row.get("difftx", {}).get("train_bf16_note") for row in rounds} - {None}
    if notes:
        targets["--precision bf16 ran f32"] = "; ".join(sorted(notes))
    # Each paired step ratio's 95% interval against the 1.10 target, round by round.
    intervals = {}
    for key in sorted({k for row in rounds for k in row.get("difftx", {}) if k.endswith("_paired")}):
        cis = [get(row, "difftx", key, "ci95") for row in rounds]
        cis = [ci for ci in cis if isinstance(ci, list) and len(ci) == 2]
        if cis:
            below = sum(1 for lo, hi in cis if hi <= 1.10)
            above = sum(1 for lo, hi in cis if lo > 1.10)
            intervals[key] = f"below 1.10 in {below}, above in {above}, around it in {len(cis) - below - above} of {len(cis)} rounds"
    return {"ranges": ranges, "targets_met": targets, "paired_step_ratio_intervals": intervals}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", help="interpreter with torch and transformers (required unless --summarize)")
    ap.add_argument("--summarize", metavar="REPORT", help="print the summary of an earlier report and exit")
    ap.add_argument("--difftx", default=os.path.join(HERE, "..", "target", "release", "difftx"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-attn", action="store_true")
    a = ap.parse_args()
    if a.summarize:
        try:
            with open(a.summarize) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"side_by_side: cannot read the report {a.summarize}: {e}")
        if not isinstance(report, dict) or not isinstance(report.get("rounds"), list):
            sys.exit(f"side_by_side: {a.summarize} is not a side_by_side report (no rounds)")
        print(json.dumps(summarize([r for r in report["rounds"] if isinstance(r, dict)]), indent=2))
        return
    if not a.python:
        ap.error("--python is required (an interpreter with torch and transformers)")
    if a.rounds < 1 or a.steps < 1:
        ap.error("--rounds and --steps must be at least 1")

    common = ["--steps", str(a.steps)]
    if a.no_train:
        common.append("--no-train")
    if a.no_attn:
        common.append("--no-attn")
    rounds = []
    cpu = None
    started = utc_now()
    for r in range(a.rounds):
        round_started = utc_now()
        # diff-v2 on difftx's side only: PyTorch has no DIFF V2 model.
        ours = run_json([a.difftx, "bench", "--no-reference", "--families", "baseline,diff-v1,diff-v2", *common])
        theirs = run_json([a.python, os.path.join(HERE, "pytorch_ref.py"), "--families", "baseline,diff-v1", *common])
        cpu = ours.get("cpu", cpu)
        row = {
            "round": r + 1,
            "started_utc": round_started,
            "finished_utc": utc_now(),
            "difftx": {},
            "pytorch": {},
            "ratio_difftx_over_pytorch": {},
        }
        for part in ["train", "decode"]:
            for fam in ["baseline", "diff-v1"]:
                key = f"{part}_{fam}_tokens_per_sec"
                x, y = get(ours, part, fam, "tokens_per_sec"), get(theirs, part, fam, "tokens_per_sec")
                row["difftx"][key], row["pytorch"][key] = x, y
                if x and y:
                    row["ratio_difftx_over_pytorch"][key] = round(x / y, 3)
        # difftx's bf16 training (where it runs bf16) against PyTorch's f32 run.
        row["difftx"]["train_bf16_note"] = get(ours, "train_bf16_note")
        for fam in ["baseline", "diff-v1"]:
            key = f"train_bf16_{fam}_tokens_per_sec"
            x, y = get(ours, "train_bf16", fam, "tokens_per_sec"), get(theirs, "train", fam, "tokens_per_sec")
            row["difftx"][key] = x
            if x and y:
                row["ratio_difftx_over_pytorch"][f"{key}_over_pytorch_f32"] = round(x / y, 3)
        # Each engine's f32 matmul speed that hour, on the training step's SwiGLU input product
        # (the mean of its before-training and after-everything figures).
        mm = [get(rep, "host_matmul") or {} for rep in (ours, theirs)]
        g = [round((m["gflops_before"] + m["gflops_after"]) / 2, 1) if m else None for m in mm]
        row["difftx"]["host_matmul_gflops"], row["pytorch"]["host_matmul_gflops"] = g
        if all(g):
            row["ratio_difftx_over_pytorch"]["host_matmul_gflops"] = round(g[0] / g[1], 3)
        for fam in ["diff-v1", "diff-v2"]:
            for prefix in ["train_step_time", "train_bf16_step_time"]:
                for suffix in ["", "_paired"]:
                    key = f"{prefix}_{fam}_over_baseline{suffix}"
                    if key != "train_step_time_diff-v1_over_baseline":  # with PyTorch's, below
                        row["difftx"][key] = get(ours, "ratios", key)
        for key in ["train_step_time_diff-v1_over_baseline", "decode_time_diff-v1_over_baseline"]:
            row["difftx"][key] = get(ours, "ratios", key)
            row["pytorch"][key] = get(theirs, "ratios", key)
        for fam in ["baseline", "diff-v1"]:
            row["difftx"][f"decode_{fam}_batched_tokens_per_sec"] = get(ours, "decode", fam, "batched_tokens_per_sec")
            row["difftx"][f"decode_{fam}_batched_bf16_kv_cache_tokens_per_sec"] = get(
                ours, "decode", fam, "batched_tokens_per_sec_bf16_kv_cache"
            )
            row["difftx"][f"decode_{fam}_batched_bf16_weights_and_kv_cache_tokens_per_sec"] = get(
                ours, "decode", fam, "batched_tokens_per_sec_bf16_weights_and_kv_cache"
            )
            row["difftx"][f"decode_{fam}_batched_bf16_weights_int8_kv_cache_tokens_per_sec"] = get(
                ours, "decode", fam, "batched_tokens_per_sec_bf16_weights_int8_kv_cache"
            )
            row["difftx"][f"decode_{fam}_forward_path_tokens_per_sec"] = get(ours, "decode", fam, "tokens_per_sec_forward_path")
            x, y = get(ours, "decode", fam, "tokens_per_sec_alone"), get(theirs, "decode", fam, "tokens_per_sec")
            row["difftx"][f"decode_{fam}_alone_tokens_per_sec"] = x
            if x and y:
                row["ratio_difftx_over_pytorch"][f"decode_{fam}_alone_tokens_per_sec_over_hf_generate"] = round(x / y, 3)
            spec = get(ours, "decode", fam, "speculative") or {}
            x, y = spec.get("tokens_per_sec"), get(theirs, "decode", fam, "tokens_per_sec")
            row["difftx"][f"decode_{fam}_speculative_tokens_per_sec"] = x
            row["difftx"][f"decode_{fam}_speculative_over_plain"] = spec.get("over_plain")
            row["difftx"][f"decode_{fam}_speculative_acceptance"] = spec.get("acceptance")
            if x and y:
                row["ratio_difftx_over_pytorch"][f"decode_{fam}_speculative_tokens_per_sec_over_hf_generate"] = round(x / y, 3)
        if not a.no_attn:
            row["difftx"]["attn_long"] = ours.get("attn_long")
            row["pytorch"]["attn_long"] = theirs.get("attn_long")
        rounds.append(row)
        print(json.dumps(row["ratio_difftx_over_pytorch"]), file=sys.stderr)
    report = {
        "cpu": cpu,
        "pytorch_engine": theirs.get("engine"),
        "started_utc": started,
        "finished_utc": utc_now(),
        "rounds": rounds,
        "summary": summarize(rounds),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
