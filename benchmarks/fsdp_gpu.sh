#!/usr/bin/env bash
# grpo.py and ppo.py under torchrun (FSDP2) on one node: the Qwen2.5 shapes of benchmarks/README.md, random
# weights, nothing downloaded. Prepared, not yet run: no GPU was lent while it was written.
#   bash benchmarks/fsdp_gpu.sh        # all the node's GPUs; NPROC=4 bash benchmarks/fsdp_gpu.sh for 4
# Each line prints a table (tokens/s of the whole node, MFU and peak memory per GPU: rank 0's).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
# The same step as one GPU's benchmark (8 prompts x 8 completions), shared out: 8 / NPROC prompts per GPU.
python benchmarks/bench.py --nproc "$NPROC" --shape qwen2.5-0.5b --shape qwen2.5-1.5b --prompts-per-step 8
# A step 8 times larger, as the processes would be used: 64 prompts x 8 completions.
python benchmarks/bench.py --nproc "$NPROC" --shape qwen2.5-1.5b --prompts-per-step 64
