"""Peak memory of one forward + backward of common.token_logprobs on a real model shape, random weights.

    python benchmarks/logprob_memory.py                                   # this checkout, qwen2.5-0.5b shape
    git worktree add /tmp/before HEAD~1 && python benchmarks/logprob_memory.py --repo /tmp/before   # another version

Each measurement runs in a fresh subprocess, so the peak (resident memory on CPU, allocated memory on CUDA)
is that of the model, the batch and one log-prob pass alone. The vocabulary (151,936 for Qwen2.5) is what
makes the logits large: [batch, completion, vocab] floats.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, {repo!r})
sys.path.insert(0, {here!r})
import common
from bench import SHAPES
from transformers import Qwen2Config, Qwen2ForCausalLM
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
with torch.device(device):
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[{shape!r}], pad_token_id=0, eos_token_id=1, bos_token_id=None))
B, P, T = {batch}, {prompt}, {completion}
input_ids = torch.randint(2, 1000, (B, P + T), device=device)
attention_mask = torch.ones_like(input_ids)
completion_mask = torch.ones(B, T, dtype=torch.long, device=device)
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
start = time.perf_counter()
with common.autocast(device, dtype):
    logp = common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.7)
logp.sum().backward()
seconds = time.perf_counter() - start
peak = (
    torch.cuda.max_memory_allocated() / 2**30
    if device.type == "cuda"
    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
)
print(json.dumps(dict(device=device.type, peak_gb=peak, before_pass_gb=base, seconds=seconds)))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=os.path.dirname(HERE), help="checkout whose common.py is measured")
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=72)
    parser.add_argument("--completion", type=int, default=512)
    a = parser.parse_args()
    code = CHILD.format(
        repo=os.path.abspath(a.repo), here=HERE, shape=a.shape, batch=a.batch, prompt=a.prompt, completion=a.completion
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr.strip().splitlines()[-1])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"{a.shape}, batch {a.batch} x ({a.prompt} prompt + {a.completion} completion) tokens, {result['device']}: "
        f"peak {result['peak_gb']:.2f} GB ({result['before_pass_gb']:.2f} GB before the pass), "
        f"{result['seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()
