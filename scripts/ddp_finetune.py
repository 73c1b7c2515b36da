#!/usr/bin/env python3
"""Fine-tunes a Hugging Face folder exported by `difftx export` with PyTorch DistributedDataParallel
over N processes, and saves a Hugging Face folder that `difftx` reads back.

  python scripts/ddp_finetune.py HF_IN HF_OUT --data TEXT [--nproc 2] [--steps 10] [--backend gloo]

Works for all three families (DiffLlama, Llama, difftx's diff-v2 with its remote code). On a CPU
machine it uses the gloo backend over loopback; on GPUs, `--backend nccl` puts rank r on cuda:r and
changes nothing else. Every rank draws its own windows of the text (byte tokens, or the folder's
tokenizer.json); DDP averages the gradients; rank 0 saves the model (safetensors) and the
tokenizer. Prints the mean loss over ranks at every step.
"""
import argparse
import os
import random
import shutil
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP


def token_ids(folder, path):
    text = open(path, encoding="utf-8", errors="replace").read()
    tok_file = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tok_file):
        import tokenizers
        return torch.tensor(tokenizers.Tokenizer.from_file(tok_file).encode(text).ids, dtype=torch.long)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def worker(rank, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(args.backend, rank=rank, world_size=args.nproc)
    device = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial state everywhere (DDP also broadcasts it)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_in, trust_remote_code=True, dtype=torch.float32)
    model.to(device).train()
    ddp = DDP(model, device_ids=[rank] if args.backend == "nccl" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ids = token_ids(args.hf_in, args.data)
    seq = min(args.seq_len, model.config.max_position_embeddings)
    rng = random.Random(args.seed * 1000 + rank)
    for step in range(1, args.steps + 1):
        starts = [rng.randrange(0, len(ids) - seq) for _ in range(args.batch)]
        batch = torch.stack([ids[s:s + seq] for s in starts]).to(device)
        loss = ddp(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}/{args.steps} loss {mean.item() / args.nproc:.4f} ({args.nproc} processes, {args.backend})", flush=True)
    if rank == 0:
        model.save_pretrained(args.hf_out, safe_serialization=True)
        for f in ("tokenizer.json",):
            if os.path.isfile(os.path.join(args.hf_in, f)):
                shutil.copy(os.path.join(args.hf_in, f), args.hf_out)
        print(f"saved {args.hf_out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_in")
    ap.add_argument("hf_out")
    ap.add_argument("--data", required=True, help="training text (a UTF-8 file)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="sequences per process and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
