#!/usr/bin/env python3
"""Checks a diff-v2 folder written by `difftx export` (its remote code) in PyTorch.

  diff_v2_remote_check.py HF_DIR NATIVE_LOGITS.safetensors [--tol 1e-4] [--fixture OUT.safetensors]

NATIVE_LOGITS.safetensors holds `input_ids` [B, T] and `logits` [B, T, V] from `difftx logits` on
the native model. Loads the folder with AutoModelForCausalLM and trust_remote_code=True (f32) and
checks: (1) its logits equal difftx's (max |diff| <= tol); (2) greedy `generate` with the KV cache
gives the tokens of a loop without cache; (3) a loss with labels back-propagates to every
parameter (finite gradients, lambda_proj's non-zero) and a few optimizer steps lower it; (4) the
same logits come from a batch with left padding (attention_mask). With --fixture, writes the ids
and the class's own logits for difftx's parity test. Exit status 1 on the first failure.
"""
import argparse
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("native_logits")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--fixture")
    args = ap.parse_args()
    torch.manual_seed(0)
    ref = load_file(args.native_logits)
    ids = ref["input_ids"].to(torch.int64)
    want = ref["logits"].to(torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    name = f"{args.hf_dir}: {type(model).__name__}, transformers {transformers.__version__}, torch {torch.__version__}"

    with torch.no_grad():
        got = model(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    print(f"{name}\n  logits vs difftx: max |diff| {diff:.3e} (max |logit| {want.abs().max().item():.3f})")
    if got.shape != want.shape or diff > args.tol:
        return 1

    prompt = ids[:1, : max(2, ids.shape[1] // 2)]
    steps = min(12, model.config.max_position_embeddings - prompt.shape[1])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        x = prompt
        for _ in range(steps):
            x = torch.cat([x, model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    same = cached.tolist() == x.tolist()
    print(f"  generate with KV cache = loop without cache ({steps} tokens): {same}")
    if not same:
        return 1

    with torch.no_grad():
        pad = 3
        padded = torch.cat([torch.zeros(ids.shape[0], pad, dtype=ids.dtype), ids], 1)
        mask = torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.long), torch.ones_like(ids)], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        got_pad = model(input_ids=padded, attention_mask=mask, position_ids=positions).logits[:, pad:]
    diff_pad = (got_pad - want).abs().max().item()
    print(f"  left-padded batch: max |diff| {diff_pad:.3e}")
    if diff_pad > args.tol:
        return 1

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if any(g is None or not torch.isfinite(g).all() for g in grads.values()):
            print("  a parameter got no or a non-finite gradient")
            return 1
        if all(g.abs().max().item() == 0 for n, g in grads.items() if "lambda_proj" in n):
            print("  lambda_proj got no gradient")
            return 1
        opt.step()
        losses.append(loss.item())
    print(f"  training: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} AdamW steps, every gradient finite")
    if not losses[-1] < losses[0]:
        return 1

    if args.fixture:
        save_file({"input_ids": ids, "logits": got.contiguous()}, args.fixture)
        print(f"  wrote {args.fixture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
