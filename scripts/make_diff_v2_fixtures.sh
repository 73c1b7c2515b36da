#!/usr/bin/env bash
# Makes tests/fixtures/hf/diffv2_*: difftx trains a small diff-v2 model for a few steps, exports
# it (weights + remote code), and the exported PyTorch class records its own logits
# (scripts/diff_v2_remote_check.py, which first checks them against `difftx logits`, generate
# with the cache, padding and training). Needs torch, transformers and safetensors in $PYTHON.
#
#   PYTHON=venv/bin/python scripts/make_diff_v2_fixtures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
cargo build --release -q -p difftx-cli
DIFFTX=target/release/difftx
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" - "$tmp/ids.safetensors" <<'PY'
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(7)
save_file({"input_ids": torch.randint(0, 256, (2, 24), generator=g)}, sys.argv[1])
PY

make_fixture() {
    local name=$1 config=$2
    echo "$config" > "$tmp/$name.json"
    "$DIFFTX" train --config "$tmp/$name.json" --family diff-v2 --steps 4 --out "$tmp/$name-run" > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
    rm -rf "tests/fixtures/hf/$name"
    "$DIFFTX" export --model "$tmp/$name-run" --out "tests/fixtures/hf/$name"
    "$DIFFTX" logits --model "$tmp/$name-run" --ids "$tmp/ids.safetensors" --out "$tmp/$name-native.safetensors"
    "$PYTHON" scripts/diff_v2_remote_check.py "tests/fixtures/hf/$name" "$tmp/$name-native.safetensors" \
        --fixture "tests/fixtures/hf/$name/reference_outputs.safetensors"
}

# GQA: 8 query heads (4 pairs) over one kv head; interleaved RoPE; untied head.
make_fixture diffv2_gqa '{"family": "diff-v2", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 32, "init_std": 0.3}'
# Tied embeddings, rotate-half RoPE, head dim 10 (not D/H), two kv heads.
make_fixture diffv2_tied_rotate_half '{"family": "diff-v2", "vocab_size": 256, "d_model": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 10, "d_ff": 64, "max_seq_len": 32, "tie_embeddings": true, "rope_style": "rotate-half", "init_std": 0.3}'
