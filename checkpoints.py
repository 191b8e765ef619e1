"""What a run writes to disk, and reads back: the final models, checkpoints and resuming from them, batch dumps,
and the guards that stop a run cleanly (a signal saves a checkpoint; a NaN stops it with the batch dumped).

Nothing here changes what a run computes; a resumed run is the uninterrupted one, bit for bit on CPU.
"""

import os
import random
import shlex
import shutil
import signal
import sys

import numpy as np
import torch

from errors import UsageError


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


def check_weights_finite(models, folder):
    """Never save weights that an update made NaN or inf: the copy already on disk stays the last good one."""
    for name, model in models.items():
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            checkpoint = os.path.join(os.path.dirname(folder), "checkpoint")
            last = f"the last good checkpoint is {checkpoint}" if os.path.isdir(checkpoint) else "no checkpoint was saved"
            raise UsageError(f"the {name}'s weights are not finite after the last update, so {folder} was not "
                             f"written ({last}): lower --learning-rate")


def save_model(model, tokenizer, folder):
    """save_pretrained (model and tokenizer) into a temporary folder, then rename: never half a model."""
    check_weights_finite({"model": model}, folder)
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


def save_checkpoint(folder, script, args, models, tokenizer, step, optimizer, scheduler, sampler, **state):
    """Everything needed to continue exactly: each model by save_pretrained (loadable by transformers and vLLM
    as it is), and state.pt with the Args, step, optimizer, scheduler, prompt order, RNG states and `state`
    (the history, and what else the algorithm carries from step to step). Atomic."""
    check_weights_finite(models, folder)
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in models.items():
        model.save_pretrained(os.path.join(tmp, name))
        tokenizer.save_pretrained(os.path.join(tmp, name))
    state.update(script=script, args=vars(args), rng=rng_state(), step=step, optimizer=optimizer.state_dict(),
                 scheduler=scheduler.state_dict(), sampler=sampler.state_dict())  # fmt: skip
    torch.save(state, os.path.join(tmp, "state.pt"))
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


def restore_state(state, optimizer, scheduler, sampler):
    """Put back a checkpoint's optimizer, scheduler, prompt order and RNG states; (first step to run, history)."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    return state["step"] + 1, state["history"]


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves a checkpoint and exits.
    A second signal stops at once, with exit status 128 + signal, even while a step hangs in your reward function
    (the last checkpoint on disk stays intact: saves are atomic)."""

    def __init__(self, checkpoint_dir):
        self.name, self.checkpoint_dir = None, checkpoint_dir
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.name is not None:
            saved = os.path.isdir(self.checkpoint_dir)
            where = f"the last checkpoint is {self.checkpoint_dir}" if saved else "no checkpoint was saved"
            print(f"\n{signal.Signals(signum).name} again: stopped at once, in the middle of a step; {where}",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)  # not an exception: code that catches everything (a reward function) cannot hold it
        self.name = signal.Signals(signum).name
        print(f"\n{self.name}: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)", file=sys.stderr)

    def exit(self, step, writer, script):
        """Once the checkpoint is saved: close the logs and stop, with the command that resumes the run."""
        writer.close()
        command = resume_command(script, self.checkpoint_dir)
        raise SystemExit(f"stopped by {self.name} after step {step}; resume with: {command}")


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

    A value may be a list of micro-batch pieces, concatenated here; None (a tensor the run has not) is left out.
    """
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tensors = {k: torch.cat(v) if isinstance(v, list) else torch.as_tensor(v) for k, v in tensors.items() if v is not None}
    # A copy of each: safetensors refuses tensors that share memory (PPO's ref_logp is old_logp without a reference).
    save_file({k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, path)


def start_dumps(args, script, run_dir):
    """--dump-dir: made absolute, checked and given its metadata.json before any model loads. A folder holding
    another run's dumps is refused, never overwritten in part; resuming the run that wrote it continues it."""
    import json
    import platform

    import transformers

    if not args.dump_dir:
        return
    args.dump_dir = dump_dir = os.path.abspath(args.dump_dir)
    meta_path = os.path.join(dump_dir, "metadata.json")
    if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
        raise UsageError(f"--dump-dir {dump_dir} is a file, not a folder: pick another --dump-dir")
    if os.path.isdir(dump_dir) and os.listdir(dump_dir):
        try:
            with open(meta_path, encoding="utf-8") as f:
                owner = json.load(f).get("run_dir")
        except (OSError, ValueError, AttributeError):
            owner = None
        if owner != run_dir:
            raise UsageError(f"--dump-dir {dump_dir} already holds files of {owner or 'another run'}: pass an empty or new folder")
    meta = {"script": script, "run_dir": run_dir, "args": vars(args), "versions": {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}}  # fmt: skip
    try:
        os.makedirs(dump_dir, exist_ok=True)
        with open(meta_path, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
    except OSError as e:
        raise UsageError(f"cannot write to --dump-dir {dump_dir} ({e.strerror}): pick another --dump-dir") from None


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


def batch_dump(rollout, micro_terms, keys):
    """A step's batch for --dump-dir and for a NaN stop: the rollout's tensors, these micro-batches' `keys`
    (concatenated by dump_batch) and their loss (summed: each micro-batch's is its share of the update's)."""
    pieces = {key: [terms[key] for terms in micro_terms] for key in keys}
    return dict(rollout, **pieces, loss=sum(terms["loss"].item() for terms in micro_terms))


def stop_if_not_finite(step, run_dir, dump, reward, micro_terms, gradient):
    """Before an optimizer step: stop on a NaN or inf in the reward, a micro-batch's loss or the gradient norm,
    with `dump` (the batch) written beside the run."""
    check_finite(step, "reward", reward, run_dir, dump)
    check_finite(step, "loss", torch.stack([terms["loss"] for terms in micro_terms]), run_dir, dump)
    check_finite(step, "gradient", gradient, run_dir, dump)
