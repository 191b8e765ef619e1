"""Memory of one training forward and backward of the policy, full fine-tuning against LoRA, each in its own process.

Prints the bytes autograd saves for the backward (hooked with torch.autograd.graph.saved_tensors_hooks, each storage
once, the weights left out) and the peak RSS after the forward and after the backward.

    OMP_NUM_THREADS=1 python benchmarks/lora_memory.py --model FILE.gguf --batch 8          # rank 0, then rank 16
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/lora_memory.py ...     # big frees returned at once
"""

import argparse
import os
import resource
import subprocess
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def measure(model_name, rank, batch, tokens, new_tokens):
    import torch

    import common
    from machinery import lora, models

    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args = types.SimpleNamespace(
        model=model_name, seed=1, lora_rank=rank, lora_alpha=32.0, lora_dropout=0.0, lora_target_modules=("all-linear",)
    )
    model = lora.wrap(models.load_causal_lm(model_name, models.CPU), args)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    torch.manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, tokens))
    mask = torch.ones(batch, new_tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp = common.token_logprobs(model, input_ids, torch.ones_like(input_ids), mask, 0.7)
    forward = rss()
    logp.sum().backward()
    print(
        f"rank {rank:3}: saved for the backward {sum(saved.values()) / 2**30:.3f} GiB, peak RSS after the forward "
        f"{forward:.2f} GB, after the backward {rss():.2f} GB"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rank", type=int, action="append", help="LoRA ranks (0: full fine-tuning; default 0 and 16)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=62, help="prompt + completion tokens per row")
    parser.add_argument("--new-tokens", type=int, default=16, help="completion tokens per row")
    args = parser.parse_args()
    if args.rank and len(args.rank) == 1:
        return measure(args.model, args.rank[0], args.batch, args.tokens, args.new_tokens)
    for rank in args.rank or [0, 16]:  # each in its own process, so each peak is its own
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--rank",
                str(rank),
                "--batch",
                str(args.batch),
                "--tokens",
                str(args.tokens),
                "--new-tokens",
                str(args.new_tokens),
            ],
            check=True,
        )


if __name__ == "__main__":
    main()
