#!/usr/bin/env bash
# The scale-out round trip for every family: difftx trains a small model -> `difftx export` ->
# PyTorch DistributedDataParallel fine-tunes it over $NPROC processes (gloo on the CPU,
# scripts/ddp_finetune.py) and saves a Hugging Face folder -> difftx reads that folder back:
# `difftx eval`, `difftx generate`, and the loss on a fixed batch computed by PyTorch from the
# saved folder against the same loss from `difftx logits` (scripts/loss_parity.py, 1e-4).
#
#   PYTHON=venv/bin/python scripts/scale_out_roundtrip.sh     (needs torch, transformers, safetensors)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-2}
cargo build --release -q -p difftx-cli
difftx=target/release/difftx
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -c 300000 data/shakespeare.txt > "$tmp/text.txt"
"$PYTHON" - "$tmp/text.txt" "$tmp/ids.safetensors" <<'PY'
import sys, torch
from safetensors.torch import save_file
data = open(sys.argv[1], "rb").read()
ids = torch.tensor([list(data[1000:1064]), list(data[50000:50064])], dtype=torch.long)
save_file({"input_ids": ids}, sys.argv[2])
PY
"$PYTHON" -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')"
for family in baseline diff-v1 diff-v2; do
    echo "== $family"
    "$difftx" train --preset tiny --family "$family" --steps 60 --data "$tmp/text.txt" --out "$tmp/$family-run" \
        --sample-tokens 0 2>&1 | grep -E "^finished"
    "$difftx" export --model "$tmp/$family-run" --out "$tmp/$family-hf" 2>/dev/null
    "$PYTHON" scripts/ddp_finetune.py "$tmp/$family-hf" "$tmp/$family-ddp" --data "$tmp/text.txt" \
        --nproc "$NPROC" --steps 10 2>&1 | grep -E "^(step|saved)|Error|Traceback"
    ls "$tmp/$family-ddp" | tr '\n' ' '; echo
    "$difftx" eval --model "$tmp/$family-ddp" --data "$tmp/text.txt" --max-batches 4 | tr -d '\n '; echo
    echo "generate: $("$difftx" generate --model "$tmp/$family-ddp" --prompt "ROMEO:" --max-new-tokens 40 --seed 1 | tr '\n' '|')"
    "$difftx" logits --model "$tmp/$family-ddp" --ids "$tmp/ids.safetensors" --out "$tmp/$family-logits.safetensors" >/dev/null
    "$PYTHON" scripts/loss_parity.py "$tmp/$family-ddp" "$tmp/$family-logits.safetensors" 2>"$tmp/err" \
        || { cat "$tmp/err"; exit 1; }
done
echo "round trip passed for baseline, diff-v1 and diff-v2"
