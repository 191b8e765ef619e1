"""Bookkeeping shared by grpo.py and ppo.py: nothing here changes what a run computes.

The flags both scripts share (RunArgs), seeding, presets, TensorBoard logging, timing, the one-line
error exit, checkpoints and resume, batch dumps, and the guards that stop a run cleanly (signals, NaN).
"""

import contextlib
import os
import random
import re
import resource
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch

from common import TINY_MODEL, UsageError


@dataclass
class RunArgs:
    """Flags both scripts share that leave the algorithm as it is: prompts and rewards, precision, checkpoints, logs."""

    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template for base models)"""
    reward_model: Optional[str] = None
    """hub id or local folder of a sequence-classification reward model, instead of the task's reward"""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """precision of the forward passes under autocast; weights stay float32 (auto: bfloat16 on GPU, float32 on CPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory (switched off during generation)"""
    deterministic: bool = False
    """torch's deterministic algorithms (CPU runs are reproducible without; the GPU needs it)"""
    eval_every: int = 0
    """greedy evaluation on the held-out split every this many steps, logged as eval/ (0: never)"""
    save_every: int = 0
    """write a checkpoint every this many steps (0: only on a signal); the final model is always saved"""
    resume: Optional[str] = None
    """checkpoint folder to continue from, with the same Args"""
    dump_dir: Optional[str] = None
    """write every step's batch (ids, rewards, advantages, log-probs, losses) as safetensors here"""
    sample_every: int = 50
    """print a few sample completions every this many steps (0: never)"""
    output_dir: str = "runs"
    """TensorBoard logs, checkpoints and the final model(s) go to output_dir/run_name"""


def run_main(main):
    """Run `main()`, turning a UsageError (or running out of GPU memory) into a one-line message."""
    try:
        main()
    except UsageError as e:
        sys.exit(f"error: {e}")
    except torch.OutOfMemoryError:
        sys.exit(
            "error: out of GPU memory: lower --micro-batch-size, --max-new-tokens or --prompts-per-step, "
            "add --gradient-checkpointing, or set the KL coefficient to 0 so no reference model is loaded"
        )


def seed_everything(seed, deterministic=False):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:  # CPU runs are already reproducible; CUDA needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def peak_memory_gb(device):
    """Peak GPU memory allocated on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_name(args):
    """<task>__<exp_name>__<seed>__<unix time>, CleanRL's layout, made safe as a folder name and unique."""
    task = re.sub(r"[^\w.-]+", "_", args.task)
    name = f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    suffix = 1
    while os.path.exists(os.path.join(args.output_dir, name if suffix == 1 else f"{name}_{suffix}")):
        suffix += 1
    return name if suffix == 1 else f"{name}_{suffix}"


def apply_preset(args, presets):
    """Fill the Args left as None from a column of `presets`: `tiny` for the built-in model, else `hub`."""
    preset = args.preset or ("tiny" if args.model == TINY_MODEL else "hub")
    for key, value in presets[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return preset


def make_writer(run_dir, args, purge_step=None):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(run_dir, purge_step=purge_step)  # on resume, drop events logged after the checkpoint
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


def print_settings(args, extra):
    print(f"settings ({extra}):")
    for key, value in vars(args).items():
        print(f"  {key:<22} {value}")


def log_perf(writer, step, timer, total_tokens, device):
    writer.add_scalar("perf/rollout_seconds", timer.seconds.get("rollout", 0.0), step)
    writer.add_scalar("perf/train_seconds", timer.seconds.get("train", 0.0), step)
    writer.add_scalar("perf/tokens_per_second", total_tokens / max(sum(timer.seconds.values()), 1e-9), step)
    writer.add_scalar("perf/peak_memory_gb", peak_memory_gb(device), step)


def print_summary(script, history, seconds, device, final_dir):
    """The one-line summary: mean score over the first 5% and the last 10% of steps (the README's benchmark), the
    step where the 10-step mean score first reached 0.9, and the completion length over the last 10%."""
    scores, lengths = history["score"], history["length"]
    n_first, n_last = max(1, len(scores) // 20), max(1, len(scores) // 10)
    first, last = sum(scores[:n_first]) / n_first, sum(scores[-n_last:]) / n_last
    reached = next((i + 10 for i in range(len(scores) - 9) if sum(scores[i : i + 10]) / 10 >= 0.9), None)
    print(
        f"{script} done: {len(scores)} steps, {seconds:.0f}s | score first 5% {first:.3f} -> last 10% {last:.3f} "
        f"| 10-step mean >= 0.9 at step {reached or 'never'} | length {sum(lengths[-n_last:]) / n_last:.2f} tokens "
        f"| peak memory {peak_memory_gb(device):.2f} GB | model saved to {final_dir}"
    )


class Timer:
    """Accumulates wall seconds per named phase (perf/rollout_seconds, perf/train_seconds)."""

    def __init__(self):
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, name):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels run asynchronously: count each phase's own work
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------
# Checkpoints, resume, batch dumps and faults.
# ---------------------------------------------------------------------------------------------------

# Args that may differ between a checkpoint and the run resuming it: they do not change the trajectory.
RESUMABLE_CHANGES = {"num_steps", "resume", "save_every", "sample_every", "eval_every", "dump_dir", "output_dir"}


def _swap_into_place(tmp, folder):
    """Replace `folder` by the finished `tmp`: at every moment one complete copy exists on disk."""
    old = f"{folder}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(folder):
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_model(model, tokenizer, folder):
    """save_pretrained (model and tokenizer) into a temporary folder, then rename: never half a model."""
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _swap_into_place(tmp, folder)


def rng_state():
    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }  # fmt: skip


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder, script, args, models, tokenizer, state):
    """Everything needed to continue exactly: each model by save_pretrained (loadable by transformers and
    vLLM as it is), and state.pt with the Args, step, optimizer, scheduler and RNG states. Atomic."""
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in models.items():
        model.save_pretrained(os.path.join(tmp, name))
        tokenizer.save_pretrained(os.path.join(tmp, name))
    torch.save({"script": script, "args": vars(args), "rng": rng_state(), **state}, os.path.join(tmp, "state.pt"))
    _swap_into_place(tmp, folder)


def load_checkpoint(folder, script, args):
    """The state of a checkpoint written by `script`, after checking it fits these Args."""
    path = os.path.join(folder, "state.pt")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {folder!r} is not a checkpoint (no state.pt in it): pass a run's checkpoint folder")
    try:
        state = torch.load(path, weights_only=False)  # our own file: it holds Python RNG states
    except Exception as e:
        raise UsageError(f"--resume {folder!r}: state.pt cannot be read ({type(e).__name__}): the checkpoint is corrupt") from None
    if state.get("script") != script:
        raise UsageError(f"--resume {folder!r} is a checkpoint of {state.get('script')}.py, not {script}.py: resume it with that script")
    for key, value in vars(args).items():
        if key not in RESUMABLE_CHANGES and state["args"].get(key) != value:
            raise UsageError(
                f"--resume {folder!r} was run with --{key.replace('_', '-')} {state['args'].get(key)}, not {value}: "
                "drop the flag or pass the checkpoint's value"
            )
    return state


def restore_state(resume, optimizer, scheduler, sampler, history):
    """(first step to run, history): 1 and `history` for a new run; for a resumed one, the checkpoint's,
    with its optimizer, scheduler, prompt order and RNG states put back."""
    if not resume:
        return 1, history
    optimizer.load_state_dict(resume["optimizer"])
    scheduler.load_state_dict(resume["scheduler"])
    sampler.load_state_dict(resume["sampler"])
    set_rng_state(resume["rng"])
    return resume["step"] + 1, resume["history"]


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves a checkpoint and exits.
    A second Ctrl-C stops at once (the last checkpoint on disk stays intact: saves are atomic)."""

    def __init__(self):
        self.name = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        print(f"\n{self.name}: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)", file=sys.stderr)


def resume_command(script, checkpoint_dir):
    """The command that continues this run: its own flags (load_checkpoint wants the same Args back), then --resume."""
    flags = sys.argv[1:] if os.path.basename(sys.argv[0]) == f"{script}.py" else []  # [] when main() is called from Python
    kept = []
    for i, flag in enumerate(flags):
        if not (flag.startswith("--resume=") or flag == "--resume" or (i > 0 and flags[i - 1] == "--resume")):
            kept.append(flag)
    return " ".join(shlex.quote(part) for part in ["python", f"{script}.py", *kept, "--resume", checkpoint_dir])


def dump_batch(path, tensors):
    """One safetensors file of named tensors (the batch dumps read by the verification snippet).

    A value may be a list of micro-batch pieces, concatenated here, so the loop only appends to it.
    """
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tensors = {k: torch.cat(v) if isinstance(v, list) else torch.as_tensor(v) for k, v in tensors.items() if not (isinstance(v, list) and not v)}
    # A copy of each: safetensors refuses tensors that share memory (PPO's ref_logp is old_logp without a reference).
    save_file({k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, path)


def write_dump_metadata(dump_dir, script, args):
    import json
    import platform

    import transformers

    os.makedirs(dump_dir, exist_ok=True)
    meta = {"script": script, "args": vars(args), "versions": {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}}  # fmt: skip
    with open(os.path.join(dump_dir, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=2)


def check_finite(step, what, value, run_dir, tensors):
    """Stop the run on a NaN or inf: dump the offending batch beside the run, keep the last good checkpoint untouched."""
    if torch.isfinite(torch.as_tensor(value)).all():
        return
    dump_path, checkpoint = os.path.join(run_dir, f"nonfinite_step{step}.safetensors"), os.path.join(run_dir, "checkpoint")
    dump_batch(dump_path, tensors)
    where = f"the last good checkpoint is {checkpoint}" if os.path.isdir(checkpoint) else "no checkpoint was saved yet"
    raise UsageError(
        f"step {step}: the {what} is not finite; the batch is dumped to {dump_path} and {where}: "
        "lower --learning-rate or check the reward function"
    )
