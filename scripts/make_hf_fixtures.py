#!/usr/bin/env python3
"""Builds the tiny Hugging Face reference folders under tests/fixtures/hf/NAME/.

Each folder is a `save_pretrained` output (config.json, model.safetensors or a sharded index)
plus `reference_outputs.safetensors` with
  input_ids        int64 [B, T]
  logits           f32   [B, T, V]
  hidden_states.K  f32   [B, T, D]   (transformers' output_hidden_states: embeddings, each
                                      block's output, the last one after the final norm)
  loss             f32   [1]         (labels = input_ids, transformers' shifted causal-LM loss)
computed in f32 with eager attention. The Rust tests (crates/difftx-core/tests/hf_parity.rs)
compare the engine against these files; they never run Python.

transformers 5.x refuses DiffLlama with an odd num_key_value_heads, 4.x accepts it. Fixtures whose
`needs` is "4" are only built when running under transformers 4.x, the rest only under 5.x:

  python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors
  /tmp/hfvenv/bin/pip install --target /tmp/tf4 'transformers>=4.56,<5'
  /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py                   # 5.x fixtures
  PYTHONPATH=/tmp/tf4 /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py   # 4.x fixtures

Weights are random (fixed seeds) and larger than the 0.02 init so attention is far from uniform.
"""
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
TF_MAJOR = int(transformers.__version__.split(".")[0])

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

# name, class family, config overrides, storage dtype, max_shard_size, transformers major needed
FIXTURES = [
    ("diffllama_gqa_kv2", "diffllama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8), "float32", None, 5),
    ("diffllama_tied", "diffllama",
     dict(num_attention_heads=4, num_key_value_heads=4, head_dim=12, tie_word_embeddings=True, rope_theta=500000.0,
          rms_norm_eps=1e-6),
     "float32", None, 5),
    ("diffllama_bf16", "diffllama", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1), "bfloat16", None, 5),
    ("diffllama_gqa_kv1", "diffllama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8), "float32", None, 4),
    ("diffllama_gqa_kv3", "diffllama", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, num_hidden_layers=1),
     "float32", None, 4),
    ("llama_gqa", "llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, rope_theta=1e6), "float32", None, 5),
    ("llama_sharded", "llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True), "float16", "30KB", 5),
]


def make_config(family, overrides):
    kw = dict(BASE)
    kw.update(overrides)
    theta = kw.pop("rope_theta", 10000.0)
    if TF_MAJOR >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    if family == "diffllama":
        return transformers.DiffLlamaConfig(**kw)
    return transformers.LlamaConfig(**kw)


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "lambda_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def build(name, family, overrides, dtype, shard, seed):
    out = os.path.join(ROOT, name)
    shutil.rmtree(out, ignore_errors=True)
    cfg = make_config(family, overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = transformers.DiffLlamaForCausalLM if family == "diffllama" else transformers.LlamaForCausalLM
    model = cls(cfg).eval()
    randomise(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # Store in `dtype`, compute the reference from exactly the stored (rounded) weights in f32.
    stored = model.to(getattr(torch, dtype))
    kwargs = dict(safe_serialization=True)
    if shard:
        kwargs["max_shard_size"] = shard
    stored.save_pretrained(out, **kwargs)
    # Reload as users do (stored weights upcast, RoPE buffers rebuilt in f32).
    key = "dtype" if TF_MAJOR >= 5 else "torch_dtype"
    model = cls.from_pretrained(out, attn_implementation="eager", **{key: torch.float32}).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        res = model(input_ids=ids, labels=ids, output_hidden_states=True)
    tensors = {"input_ids": ids.to(torch.int64), "logits": res.logits.float().contiguous(),
               "loss": res.loss.float().reshape(1)}
    for k, h in enumerate(res.hidden_states):
        tensors[f"hidden_states.{k}"] = h.float().contiguous()
    save_file(tensors, os.path.join(out, "reference_outputs.safetensors"))
    for junk in ["generation_config.json"]:
        p = os.path.join(out, junk)
        if os.path.exists(p):
            os.remove(p)
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"{name}: transformers {transformers.__version__}, {files}, {size} bytes, "
          f"max |logit| {res.logits.abs().max().item():.3f}")


def main():
    only = set(sys.argv[1:])
    for seed, (name, family, overrides, dtype, shard, needs) in enumerate(FIXTURES):
        if only and name not in only:
            continue
        if needs != TF_MAJOR:
            print(f"{name}: skipped (needs transformers {needs}.x, running {transformers.__version__})")
            continue
        build(name, family, overrides, dtype, shard, 1000 + seed)


if __name__ == "__main__":
    main()
