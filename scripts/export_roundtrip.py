#!/usr/bin/env python3
"""Checks a folder written by `difftx_core::hf::export_hf` against the native model's logits.

  export_roundtrip.py HF_DIR NATIVE_LOGITS.safetensors [--tol 1e-4]

NATIVE_LOGITS.safetensors holds `input_ids` (int64 [B, T]) and `logits` (f32 [B, T, V]) computed by
the engine on the native (pre-export) model. The folder is loaded with
`transformers.AutoModelForCausalLM.from_pretrained` in f32 with eager attention, run on the same
ids, and the max |diff| of the logits is printed; exit status 1 when it exceeds --tol.
Works with transformers 4.x and 5.x (DiffLlama needs >= 4.49).
"""
import argparse
import sys

import torch
import transformers
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("native_logits")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()

    ref = load_file(args.native_logits)
    ids = ref["input_ids"].to(torch.int64)
    want = ref["logits"].to(torch.float32)
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, attn_implementation="eager", **dtype_kw)
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits.to(torch.float32)
    if got.shape != want.shape:
        print(f"shape mismatch: transformers {tuple(got.shape)} vs native {tuple(want.shape)}")
        return 1
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"{args.hf_dir}: {type(model).__name__}, transformers {transformers.__version__}, "
          f"logits max |diff| {diff:.3e} (max |logit| {scale:.3f})")
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
