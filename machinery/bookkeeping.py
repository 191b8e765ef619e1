"""The run's logs and folders, shared by grpo.py and ppo.py: nothing here changes what a run computes.

The one-line error exit, seeding, the run folder, TensorBoard logging, timing and the closing summary. The flags
are in flags.py; what a run writes to disk to be continued or verified (checkpoints, dumps) is in checkpoints.py
and dumps.py.
"""

import contextlib
import itertools
import os
import random
import re
import resource
import signal
import sys
import time

import numpy as np
import torch

from machinery import checkpoints, threads
from machinery import distributed as dist
from machinery.errors import Interrupted, UsageError


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
            "pass --gradient-checkpointing on, or set the KL coefficient to 0 so no reference model is loaded"
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
    On --resume, it is the folder holding the checkpoint; on a branch (--resume with another --output-dir) a new one.
    Under torchrun rank 0 makes it, the others take its path.
    """
    return dist.broadcast(_make_run_dir(args) if dist.is_main() else None)


def _make_run_dir(args):
    if args.resume and not checkpoints.branches(args):  # continues in the checkpoint's own run folder
        return os.path.dirname(os.path.abspath(args.resume))
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
        if args.resume:  # a branch: a new run folder, the checkpoint's left as it is
            checkpoints.start_branch(args.resume, folder)
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


def progress(script, first_step, num_steps):
    """The steps left to run, as a progress bar (on the main process only)."""
    from tqdm import tqdm

    steps = range(first_step, num_steps + 1)
    return tqdm(
        steps, desc=script, initial=first_step - 1, total=num_steps, dynamic_ncols=True, disable=not dist.is_main()
    )


def record(history, sampled, all_scores, pbar):
    """A step's tallies in the history (the summary's and the checkpoint's), shown on the progress bar: the tokens
    sampled, prompts and completions, the mean score and completion length, over every process's. Returns every
    process's completion lengths [N]."""
    mask = sampled["completion_mask"]
    history["tokens"] += dist.sum(int(sampled["prompt_mask"].sum() + mask.sum()))
    lengths = dist.gather(mask.sum(1).float())
    history["score"].append(all_scores.mean().item())
    history["length"].append(lengths.mean().item())
    pbar.set_postfix(score=f"{history['score'][-1]:.3f}", len=f"{history['length'][-1]:.1f}")
    return lengths


def log_step(writer, step, scalars, losses, timer, total_tokens, device):
    """One step's scalars: the loop's own (`scalars`), the losses of its updates (common.logged_losses), and the
    time and memory; then, under --threads auto, the threads follow the cores other processes left idle
    (threads.py), logged as perf/threads."""
    losses = {f"losses/{key}": value for key, value in losses.items()}
    for name, value in dict(scalars, **losses, **perf_scalars(timer, total_tokens, device)).items():
        writer.add_scalar(name, float(value), step)
    writer.add_scalar("perf/threads", threads.follow_idle_cores(), step)


def perf_scalars(timer, total_tokens, device):
    seconds = timer.seconds  # each phase's: rollout and train, or reward_model.py's batch and train
    return {
        **{f"perf/{phase}_seconds": value for phase, value in seconds.items()},
        "perf/tokens_per_second": total_tokens / max(sum(seconds.values()), 1e-9),
        "perf/peak_memory_gb": peak_memory_gb(device),
    }


def print_summary(script, history, seconds, device, final_dir, learnt_reward=None):
    """The one-line summary: mean score over the first 5% and the last 10% of steps (docs/benchmarks.md), the
    step where the 10-step mean score first reached 0.9 (not for a `learnt_reward`, --reward-model, whose scale
    is its own), and the completion length over the last 10%."""
    checkpoints.release_locks()  # the run is over: its folder may be resumed
    scores, lengths = history["score"], history["length"]
    n_first, n_last = max(1, len(scores) // 20), max(1, len(scores) // 10)
    first, last = sum(scores[:n_first]) / n_first, sum(scores[-n_last:]) / n_last
    reached = next((i + 10 for i in range(len(scores) - 9) if sum(scores[i : i + 10]) / 10 >= 0.9), None)
    print(
        f"{script} done: {len(scores)} steps, {seconds:.0f}s | score first 5% {first:.3f} -> last 10% {last:.3f} "
        + ("" if learnt_reward else f"| 10-step mean >= 0.9 at step {reached or 'never'} ")
        + f"| length {sum(lengths[-n_last:]) / n_last:.2f} tokens "
        f"| peak memory {peak_memory_gb(device):.2f} GB | model saved to {final_dir}"
    )


class Timer:
    """Accumulates wall seconds per named phase (perf/rollout_seconds, perf/train_seconds; reward_model.py's
    perf/batch_seconds)."""

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
