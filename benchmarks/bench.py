"""Throughput of grpo.py and ppo.py on random-init models of real sizes, with nothing to download.

    python benchmarks/bench.py --shape small                              # CPU, about 2 minutes
    python benchmarks/bench.py --shape qwen2.5-0.5b --shape qwen2.5-1.5b  # one GPU, a few minutes
    python benchmarks/bench.py --nproc 8 --shape qwen2.5-1.5b             # 8 GPUs under torchrun (FSDP2)

Each shape is built from its config (random weights, the real architecture and size), saved with a
byte-level tokenizer like any hub model, and each script runs a few steps on it in a subprocess (so
peak memory is its own) on a task of random digit prompts. The numbers come from the run's TensorBoard
scalars, with the first (warm-up) step left out:

    rollout tokens/s   completion tokens generated / perf/rollout_seconds (which also holds scoring and
                       the no-grad passes: old and reference log-probs, PPO's values)
    training tokens/s  prompt + completion tokens trained on, times the passes over the batch
                       (PPO: --update-epochs), / perf/train_seconds
    MFU                6 * N FLOPs per trained token (N: policy parameters, plus the critic's for PPO)
                       over --peak-tflops; printed on CUDA only
    peak memory        perf/peak_memory_gb: GPU memory allocated on CUDA, resident memory on CPU
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN25 = dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
SHAPES = {
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, **QWEN25
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, **QWEN25
    ),
}
PROMPT_DIGITS = 64  # each prompt: "Repeat: " and 64 random digits, 72 tokens of the byte-level tokenizer
# The answer is the first of them, so that any --max-new-tokens fits it; the throughput is the point, not the reward.


def byte_tokenizer():
    """Every UTF-8 byte one token (no merges), plus <|endoftext|> as EOS and padding: any text reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<|endoftext|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_model(shape, folder, device):
    """A random-init Qwen2 of `shape`, saved with save_pretrained (bfloat16 on CUDA, to write half as much)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        **SHAPES[shape], pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.5B parameters on a CPU alone takes a minute
        model = Qwen2ForCausalLM(config)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the runs are other processes: leave them the memory
    return tokenizer


def write_task(path, n=256, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            digits = "".join(rng.choice("0123456789") for _ in range(PROMPT_DIGITS))
            f.write(json.dumps({"prompt": f"Repeat: {digits}", "answer": digits[0]}) + "\n")
    return f"jsonl:{path}"


def read_scalars(run_dir):
    """{tag: {step: value}} from the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def run_script(script, model_dir, task, args, output_dir):
    """Run grpo.py or ppo.py for args.steps steps; the same number of completions per step for both."""
    flags = [
        "--model",
        model_dir,
        "--task",
        task,
        "--num-steps",
        str(args.steps),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--sample-every",
        "0",
        "--output-dir",
        output_dir,
    ]
    if script == "grpo":
        flags += ["--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)]
    else:  # PPO needs no group: as many distinct prompts, one completion each
        flags += [
            "--prompts-per-step",
            str(args.prompts_per_step * args.group_size),
            "--update-epochs",
            str(args.update_epochs),
        ]
        flags += ["--num-minibatches", str(args.num_minibatches)]
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)] if args.nproc > 1 else []
    )
    result = subprocess.run([*launcher, f"{script}.py", *flags], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{script}.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    (name,) = os.listdir(output_dir)
    return read_scalars(os.path.join(output_dir, name))


def measure(script, shape, scalars, prompt_tokens, args, device):
    """One table row from the scalars, leaving out step 1 (warm-up: allocator, kernels, caches)."""
    steps = sorted(scalars["perf/rollout_seconds"])
    first, timed = steps[0], steps[1:]
    completions = args.prompts_per_step * args.group_size
    rollout_seconds = scalars["perf/rollout_seconds"][steps[-1]] - scalars["perf/rollout_seconds"][first]  # cumulative
    train_seconds = scalars["perf/train_seconds"][steps[-1]] - scalars["perf/train_seconds"][first]
    generated = sum(scalars["charts/completion_length"][s] * completions for s in timed)
    passes = 1 if script == "grpo" else args.update_epochs
    trained = sum((prompt_tokens + scalars["charts/completion_length"][s]) * completions for s in timed) * passes
    params = scalars["charts/params_policy"][0] + scalars.get("charts/params_critic", {}).get(0, 0)
    mfu = 6 * params * trained / train_seconds / (args.peak_tflops * 1e12 * args.nproc)  # per GPU
    return {
        "script": script,
        "shape": shape,
        "trained params": f"{params / 1e6:,.0f}M",
        "completions/step": completions,
        "rollout tokens/s": f"{generated / rollout_seconds:,.0f}",
        "training tokens/s": f"{trained / train_seconds:,.0f}",
        "MFU": f"{100 * mfu:.1f}%" if device.type == "cuda" else "-",
        "peak memory (GB)": f"{max(scalars['perf/peak_memory_gb'].values()):.1f}",
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", action="append", choices=list(SHAPES), help="model shape; repeat for several (default: small)"
    )
    parser.add_argument(
        "--script", action="append", choices=["grpo", "ppo"], help="script to time; repeat for both (default: both)"
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per run, the first of them a warm-up (at least 2)")
    parser.add_argument(
        "--prompts-per-step", type=int, default=None, help="GRPO prompts per step (default 8 on GPU, 4 on CPU)"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="GRPO completions per prompt (default 8 on GPU, 4 on CPU); PPO "
        "gets prompts-per-step * group-size prompts with one completion each",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="completion length (default 256 on GPU, 32 on CPU)"
    )
    parser.add_argument("--micro-batch-size", type=int, default=8, help="completions per forward/backward pass")
    parser.add_argument("--update-epochs", type=int, default=1, help="PPO passes over each batch")
    parser.add_argument("--num-minibatches", type=int, default=2, help="PPO optimizer steps per pass")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU (H100/H200: 989)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes (GPUs) under torchrun; the batch is the whole step's, shared out",
    )
    parser.add_argument(
        "--keep", default=None, help="keep the models and runs in this folder (default: a temporary one, deleted)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    args.prompts_per_step = args.prompts_per_step or (8 if on_gpu else 4)
    args.group_size = args.group_size or (8 if on_gpu else 4)
    args.max_new_tokens = args.max_new_tokens or (256 if on_gpu else 32)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up and is not timed")

    work = args.keep or tempfile.mkdtemp(prefix="bench-")
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        task = write_task(os.path.join(work, "digits.jsonl"))
        for shape in args.shape or ["small"]:
            start = time.time()
            model_dir = os.path.join(work, shape)
            tokenizer = build_model(shape, model_dir, device)
            prompt_tokens = len(tokenizer("Repeat: " + "0" * PROMPT_DIGITS)["input_ids"])
            print(f"built {shape} in {time.time() - start:.0f}s", file=sys.stderr)
            for script in args.script or ["grpo", "ppo"]:
                start = time.time()
                scalars = run_script(script, model_dir, task, args, os.path.join(work, f"runs-{script}-{shape}"))
                rows.append(measure(script, shape, scalars, prompt_tokens, args, device))
                print(f"ran {script} on {shape}: {args.steps} steps in {time.time() - start:.0f}s", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{args.nproc} x {torch.cuda.get_device_name() if on_gpu else 'CPU'}: "
        f"{args.steps - 1} timed step(s) after 1 warm-up, "
        f"prompts of {prompt_tokens} tokens, up to {args.max_new_tokens} new tokens\n"
    )
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
