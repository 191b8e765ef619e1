"""Batch dumps (--dump-dir, read by the verification snippet) and the guard that stops a run on a NaN or inf with
the offending batch dumped beside it. Nothing here changes what a run computes.
"""

import os

import torch

import distributed as dist
from errors import UsageError


def dump_batch(path, tensors):
    """One safetensors file of named tensors (the batch dumps read by the verification snippet).

    A value may be a list of micro-batch pieces, concatenated here; None (a tensor the run has not) is left out.
    """
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tensors = {k: torch.cat(v) if isinstance(v, list) else torch.as_tensor(v) for k, v in tensors.items() if v is not None}
    # A copy of each: safetensors refuses tensors that share memory (PPO's ref_logp is old_logp without a reference).
    save_file({k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, path)


def dump_step(dump_dir, step, tensors):
    """--dump-dir: one file a step (nothing without the flag)."""
    if dump_dir:
        dump_batch(os.path.join(dump_dir, f"step{step:06d}.safetensors"), tensors)


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
    rank = f"_rank{dist.rank()}" if dist.world_size() > 1 else ""
    dump_path, checkpoint = os.path.join(run_dir, f"nonfinite_step{step}{rank}.safetensors"), os.path.join(run_dir, "checkpoint")
    dump_batch(dump_path, tensors)
    where = f"the last good checkpoint is {checkpoint}" if os.path.isdir(checkpoint) else "no checkpoint was saved yet"
    raise UsageError(
        f"step {step}: the {what} is not finite; the batch is dumped to {dump_path} and {where}: "
        "lower --learning-rate or check the reward function"
    )


def batch_dump(rollout, micro_terms, keys, **extra):
    """A step's batch for --dump-dir and for a NaN stop: the rollout's tensors, these micro-batches' `keys`
    (concatenated by dump_batch), their loss (summed: each micro-batch's is its share of the update's), `extra`."""
    pieces = {key: [terms[key] for terms in micro_terms] for key in keys}
    return dict(rollout, **pieces, loss=sum(terms["loss"].item() for terms in micro_terms), **extra)


def stop_if_not_finite(step, run_dir, dump, reward, micro_terms, gradient):
    """Before an optimizer step: stop on a NaN or inf in the reward, a micro-batch's loss or the gradient norm,
    with `dump` (the batch) written beside the run."""
    check_finite(step, "reward", reward, run_dir, dump)
    check_finite(step, "loss", torch.stack([terms["loss"] for terms in micro_terms]), run_dir, dump)
    check_finite(step, "gradient", gradient, run_dir, dump)
