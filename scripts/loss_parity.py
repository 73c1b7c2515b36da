#!/usr/bin/env python3
"""The causal-LM loss of a Hugging Face folder on fixed ids, computed by PyTorch from the folder,
against the same loss computed from `difftx logits` on that folder.

  python scripts/loss_parity.py HF_DIR IDS_AND_DIFFTX_LOGITS.safetensors [--tol 1e-4]
"""
import argparse
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("difftx_logits")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    ref = load_file(args.difftx_logits)
    ids = ref["input_ids"].to(torch.int64)
    logits = ref["logits"].to(torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        torch_loss = model(input_ids=ids, labels=ids).loss.item()
    v = logits.shape[-1]
    difftx_loss = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1)).item()
    diff = abs(torch_loss - difftx_loss)
    print(f"{args.hf_dir}: loss on {tuple(ids.shape)} ids: PyTorch {torch_loss:.6f}, difftx {difftx_loss:.6f}, |diff| {diff:.2e}")
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
