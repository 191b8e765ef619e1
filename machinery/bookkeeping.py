"""The run's flags and logs, shared by grpo.py and ppo.py: nothing here changes what a run computes.

The flags both scripts share (RunArgs) and their checks, the hub defaults, the one-line error exit, seeding,
TensorBoard logging (the averaging of the logged statistics included), timing and the closing summary.
What a run writes to disk to be continued or verified (checkpoints, dumps) is in checkpoints.py.
"""

import contextlib
import dataclasses
import inspect
import itertools
import math
import os
import random
import re
import resource
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch

from common import approx_kl, clip_fraction, masked_mean
from machinery import checkpoints, lora
from machinery import distributed as dist
from machinery.errors import Interrupted, UsageError
from machinery.models import TINY_MODEL


@dataclass
class RunArgs:
    """Flags both scripts share that leave the algorithm as it is: prompts and rewards, precision, checkpoints, logs."""

    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template for base models)"""
    system_prompt: Optional[str] = None
    """the chat template's system prompt ("" for an empty one); by default the template's own, if it has one"""
    reward_model: Optional[str] = None
    """hub id or local folder of a sequence-classification reward model, instead of the task's reward"""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """precision of the forward passes under autocast; weights stay float32 (auto: bfloat16 on a GPU or CPU that
    computes it natively, else float32; printed at start with the reason, see precision.py)"""
    threads: str = "auto"
    """threads of torch's CPU operations: auto (torch's default, at most the cores over torchrun's processes; an
    OMP_NUM_THREADS of yours wins) or a number; printed at start with the reason, see threads.py"""
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
    lora_rank: int = 0
    """train LoRA adapters of this rank instead of every weight (the critic's too; needs peft); 0: full fine-tuning"""
    lora_alpha: float = 32.0
    """LoRA's scale: each adapted layer adds lora_alpha / lora_rank * B A x"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input; above 0 the log-probs of training differ from those that sampled"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """names of the layers that get adapters (peft's target_modules); all-linear: every attention and MLP linear"""
    lora_merged: bool = False
    """also save the final policy merged into its base, a plain transformers model, as final-merged"""


def parse_args(args_class, hub_defaults):
    """(the command line as `args_class`, the fields of `hub_defaults` it sets: those keep the value given).

    --help shows each field's default as declared, and the hub defaults in the description.
    """
    import tyro

    hub = ", ".join(f"{flag(key)} {value}" for key, value in hub_defaults.items())
    description = (
        f"{inspect.cleandoc(args_class.__doc__)}\n\n"
        f"On a model other than tiny, HUB_DEFAULTS replace these defaults: {hub}."
    )
    args = tyro.cli(args_class, description=description)
    flags = {word.split("=")[0].replace("_", "-") for word in sys.argv[1:] if word.startswith("--")}
    return args, {key for key in hub_defaults if flag(key) in flags}


def flag(name):
    return "--" + name.replace("_", "-")


def check_positive(args, *names):
    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"{flag(name)} is {getattr(args, name)}: it must be at least 1")


RANGES = {  # what check_range accepts; NaN fails every one of them
    "> 0": lambda x: x > 0,
    ">= 0": lambda x: x >= 0,
    "in [0, 1]": lambda x: 0 <= x <= 1,
    "in (0, 1)": lambda x: 0 < x < 1,
}


def check_range(args, rule, *names):
    """Refuse the first of these flags whose value breaks `rule` (a key of RANGES), naming it and its value."""
    for name in names:
        if not RANGES[rule](getattr(args, name)):
            raise UsageError(f"{flag(name)} is {getattr(args, name)}: it must be {rule}")


MAX_FLOAT, MIN_FLOAT, MAX_INT = 1e6, 1e-30, 2**31 - 1
FLOORS = {  # flags that leave the weights as they are, or the log-probs meaningless, outside a range of their own
    "temperature": (
        1e-2,
        1e2,
        "use a value in [0.01, 100]: the logits are divided by it, so a smaller one overflows "
        "them and a larger one flattens every distribution (its gradient vanishes)",
    ),
    "learning_rate": (
        1e-8,
        None,
        "it must be at least 1e-8: AdamW moves each weight by about that much a step, and "
        "a float32 weight of size w does not move by less than 6e-8 * w",
    ),
    "critic_learning_rate": (
        1e-8,
        None,
        "it must be at least 1e-8: AdamW moves each weight by about that much a "
        "step, and a float32 weight of size w does not move by less than 6e-8 * w",
    ),
    "max_grad_norm": (
        1e-6,
        None,
        "it must be at least 1e-6: a gradient clipped smaller is lost under AdamW's eps (1e-8), and no weight moves",
    ),
}


def check_magnitude(name, value):
    """One flag's number: finite (NaN passes any check written `x <= 0`, and a run on it ends "done" with a model
    full of NaN), at most MAX_FLOAT in size (a larger coefficient dwarfs every other term, and its products overflow
    float32 at 3e38), 0 or at least MIN_FLOAT (float32 arithmetic reads a smaller one as 0); an int below 2**31."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int) and abs(value) > MAX_INT and name != "seed":
        raise UsageError(f"{flag(name)} is {value}: it must be below 2**31 (no run holds that many)")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{flag(name)} is {value}: it must be a finite number")
    if isinstance(value, float) and abs(value) > MAX_FLOAT:
        raise UsageError(
            f"{flag(name)} is {value:g}: it must be at most 1e6 in size (past that, products in the "
            "loss and its gradient overflow float32, or one term drowns all the others)"
        )
    if isinstance(value, float) and 0 < abs(value) < MIN_FLOAT and name not in FLOORS:  # those: their own floor
        raise UsageError(f"{flag(name)} is {value:g}: float32 reads it as 0; pass 0, or a value of at least 1e-30")


def check_run_args(args):
    """The checks of the flags grpo.py and ppo.py share; each script's check_args calls it first.

    Every number first passes check_magnitude; then the ranges (flags named in FLOORS have their own).
    """
    for field in dataclasses.fields(args):
        check_magnitude(field.name, getattr(args, field.name))
    if not 0 <= args.seed <= 2**32 - dist.world_size():  # numpy's seed range, for seed + rank on every process
        n = dist.world_size()
        raise UsageError(
            f"--seed is {args.seed}: it must be in "
            + (
                "[0, 2**32)"
                if n == 1
                else f"[0, {2**32 - n}] (each of the {n} processes seeds with --seed + its rank, below 2**32)"
            )
        )
    if args.temperature <= 0:
        raise UsageError(f"--temperature is {args.temperature}: it must be > 0 (the log-probs divide by it)")
    for name, (low, high, why) in FLOORS.items():
        value = getattr(args, name, None)
        if value is not None and (0 < value < low or (high and value > high)):  # <= 0: the range rules
            raise UsageError(f"--{name.replace('_', '-')} is {value}: {why}")
    if not 0 <= args.clip_low < 1 or args.clip_high < 0:
        raise UsageError(
            f"--clip-low {args.clip_low} --clip-high {args.clip_high}: need 0 <= clip-low < 1 and clip-high >= 0"
        )
    check_range(args, "in (0, 1)", "learning_rate")  # Adam moves each weight by about lr a step: 1 or more is noise
    check_range(args, "> 0", "max_grad_norm")
    check_range(args, ">= 0", "weight_decay", "warmup_steps")
    if args.learning_rate * args.weight_decay >= 1:  # AdamW multiplies each weight by 1 - lr * wd every step
        raise UsageError(
            f"--learning-rate {args.learning_rate} times --weight-decay {args.weight_decay} is >= 1: every step would "
            "zero or flip the weights; lower --weight-decay"
        )
    if args.dump_dir == "":
        raise UsageError("--dump-dir is empty: pass a folder to dump into, or leave the flag out for no dumps")
    for name in ("eval_every", "save_every", "sample_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"{flag(name)} is {getattr(args, name)}: use 0 for never, or a positive number of steps")
    lora.check_args(args)


def run_main(main):
    """Run `main()`, turning a UsageError (or running out of GPU memory) into a one-line message, and a signal before
    the training loop installs its own handlers (checkpoints.StopSignal) into one line saying nothing was saved."""

    def interrupted(signum, frame):
        Interrupted.received.append(signum)
        raise Interrupted(signum)

    Interrupted.received.clear()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal or ssh session closed
        signal.signal(sig, interrupted)
    try:
        main()
        dist.finish()
    except UsageError as e:
        checkpoints.release_locks()
        remove_empty_run_folders()
        if not dist.is_main() and not dist.initialized():
            sys.exit(1)  # under torchrun, an error before the processes join (a flag, a launch) is every one's
        sys.exit(f"error{'' if dist.is_main() else f' (rank {dist.rank()})'}: {e}")
    except Interrupted as e:
        Interrupted.received.clear()
        remove_empty_run_folders()
        print(f"{signal.Signals(e.signum).name} before the first step: nothing was saved", file=sys.stderr)
        sys.exit(128 + e.signum)
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


MADE_FOLDERS = []  # the folders make_run_dir created, removed again by run_main if a refused start left them empty


def make_run_dir(args):
    """The run's folder, as an absolute path (your reward function may change the working directory).

    A new run's is made now, before any model loads, and exclusively: two runs started in the same second get two.
    On --resume, it is the folder holding the checkpoint. Under torchrun rank 0 makes it, the others take its path.
    """
    return dist.broadcast(_make_run_dir(args) if dist.is_main() else None)


def _make_run_dir(args):
    if args.resume:
        folder = os.path.dirname(os.path.abspath(args.resume))
        if args.output_dir != RunArgs.output_dir and os.path.abspath(args.output_dir) != os.path.dirname(folder):
            raise UsageError(
                f"--resume continues in the checkpoint's run folder {folder}, not under --output-dir "
                f"{args.output_dir}: drop --output-dir (or copy the run folder there first)"
            )
        return folder
    output_dir = os.path.abspath(args.output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output-dir {args.output_dir} is a file, not a folder: pick another --output-dir")
    if not os.path.isdir(output_dir):
        MADE_FOLDERS.append(output_dir)
    base = os.path.join(output_dir, run_name(args))
    for suffix in itertools.count(1):
        folder = base if suffix == 1 else f"{base}_{suffix}"
        try:
            os.makedirs(folder)  # fails if it exists: then the next suffix
        except FileExistsError:
            continue
        except OSError as e:
            raise UsageError(
                f"cannot create the run folder {folder} ({e.strerror}): pick another --output-dir"
            ) from None
        MADE_FOLDERS.append(folder)
        checkpoints.lock_run_folder(folder)  # held while the run lives: a --resume of it meanwhile is refused
        return folder


def remove_empty_run_folders():
    for folder in reversed(MADE_FOLDERS):
        with contextlib.suppress(OSError):
            if os.listdir(folder) == [".lock"]:  # the run's own lock (checkpoints.lock_run_folder)
                os.remove(os.path.join(folder, ".lock"))
            os.rmdir(folder)  # only if empty


def run_name(args):
    """<task>__<exp_name>__<seed>__<unix time>, CleanRL's layout, made safe as a folder name."""
    task = re.sub(r"[^\w.-]+", "_", args.task)
    return f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}"


def apply_hub_defaults(args, hub_defaults, given=()):
    """On a model other than the tiny one (or with --preset hub), each field of `hub_defaults` still at its Args
    default takes the hub value, unless it is in `given` (set on the command line). Returns `tiny` or `hub`."""
    preset = args.preset or ("tiny" if args.model == TINY_MODEL else "hub")
    if preset == "hub":
        defaults = {field.name: field.default for field in dataclasses.fields(args)}
        for key, value in hub_defaults.items():
            if key not in given and getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    return preset


def print_settings(args, run_dir, preset, hub_defaults):
    print(f"settings ({preset} defaults, run {run_dir}):")
    for key, value in vars(args).items():
        hub = "   (HUB_DEFAULTS)" if preset == "hub" and key in hub_defaults and value == hub_defaults[key] else ""
        print(f"  {key:<22} {value}{hub}")


class NoWriter:
    """What the processes other than rank 0 log to under torchrun: nothing (the logged values are global)."""

    def add_scalar(self, *args, **kwargs):
        pass

    def close(self):
        pass


def make_writer(run_dir, args, first_step, **models):
    """A TensorBoard writer; a new run logs the parameter count of each model (0: not loaded) at step 0."""
    from torch.utils.tensorboard import SummaryWriter

    if not dist.is_main():
        return NoWriter()
    writer = SummaryWriter(run_dir, purge_step=first_step)  # on resume, drop events logged after the checkpoint
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    if first_step == 1:  # once, so a resumed run's log is the uninterrupted run's
        for name, model in models.items():
            count = sum(p.numel() for p in model.parameters()) if model is not None else 0
            writer.add_scalar(f"charts/params_{name}", count, 0)
    return writer


def log_step(writer, step, scalars, updates, args, timer, total_tokens, device):
    """One step's scalars: the loop's own (`scalars`), the losses of its updates, and the time and memory."""
    losses = {f"losses/{key}": value for key, value in logged_losses(updates, args).items()}
    for name, value in dict(scalars, **losses, **perf_scalars(timer, total_tokens, device)).items():
        writer.add_scalar(name, float(value), step)


def logged_losses(updates, args):
    """The losses/ scalars of one step (README, "What is logged"), from the per-token terms the update gathered.

    updates: per optimizer step, the terms of each micro-batch (grpo_loss's or ppo_loss's, with the entropy).
    Each statistic is a token mean over its update's batch (a micro-batch weighs its share of the update's real
    tokens; under torchrun, over every process's micro-batches), averaged over the step's updates.
    """
    names, sums = None, []  # per update: each statistic times tokens, summed over micro-batches; then the tokens
    for micro_terms in updates:
        update = 0
        for terms in micro_terms:
            means = token_means(terms, args)
            names = list(means)
            tokens = terms["mask"].sum().double()
            update = update + torch.stack([value.double() * tokens for value in means.values()] + [tokens])
        sums.append(update)
    sums = dist.sum(torch.stack(sums))  # [updates, statistics + 1]
    means = sums[:, :-1] / sums[:, -1:].clamp(min=1)
    return {name: value.item() for name, value in zip(names, means.mean(0))}


def token_means(terms, args):
    """One micro-batch's statistics, means over its real tokens: the clipped surrogate's, GRPO's KL term, PPO's
    critic."""
    mask, logratio = terms["mask"], terms["logratio"]
    means = dict(
        policy_loss=masked_mean(terms["pg_loss"], mask),
        approx_kl=approx_kl(logratio, mask),
        clipfrac=clip_fraction(logratio, terms["advantages"], args.clip_low, args.clip_high, mask),
        entropy=masked_mean(terms["entropy"], mask),
    )
    if "kl_ref" in terms:
        means["kl_ref"] = masked_mean(terms["kl_ref"], mask)
    if "v_loss" in terms:
        v_clipped = (terms["new_values"] - terms["old_values"]).abs() > args.cliprange_value
        means.update(value_loss=masked_mean(terms["v_loss"], mask), clipfrac_value=masked_mean(v_clipped.float(), mask))
    return means


def perf_scalars(timer, total_tokens, device):
    seconds = timer.seconds
    return {
        "perf/rollout_seconds": seconds.get("rollout", 0.0),
        "perf/train_seconds": seconds.get("train", 0.0),
        "perf/tokens_per_second": total_tokens / max(sum(seconds.values()), 1e-9),
        "perf/peak_memory_gb": peak_memory_gb(device),
    }


def print_summary(script, history, seconds, device, final_dir):
    """The one-line summary: mean score over the first 5% and the last 10% of steps (the README's benchmark), the
    step where the 10-step mean score first reached 0.9, and the completion length over the last 10%."""
    checkpoints.release_locks()  # the run is over: its folder may be resumed
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
