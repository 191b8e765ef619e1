"""Batch dumps (--dump-dir, read by the verification snippet) and the guard that stops a run on a NaN or inf with
the offending batch dumped beside it. Nothing here changes what a run computes.
"""

import os

import torch

from machinery import checkpoints
from machinery import distributed as dist
from machinery.errors import UsageError


def is_tensors(values):
    return all(torch.is_tensor(v) for v in values)


def dump_batch(path, tensors, checkpoint=None):
    """One safetensors file of named tensors (the batch dumps read by the verification snippet).

    A value may be a list of micro-batch pieces, concatenated here; None (a tensor the run has not) is left out, and
    so is a list of what is not a tensor (an example's text field: batches.example_fields).
    A write that fails (a full disk) is one line naming the last good checkpoint (in folder `checkpoint`).
    """
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    kept = {k: v for k, v in tensors.items() if v is not None and not (isinstance(v, list) and not is_tensors(v))}
    tensors = {k: torch.cat(v) if isinstance(v, list) else torch.as_tensor(v) for k, v in kept.items()}
    # A copy of each: safetensors refuses tensors that share memory (PPO's ref_logp is old_logp without a reference).
    try:
        save_file({k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, path)
    except checkpoints.WRITE_ERRORS as e:
        if os.path.isfile(path):  # never half a dump
            os.remove(path)
        raise checkpoints.write_failed(f"the dump {path}", checkpoint or "", e) from None


def dump_step(dump_dir, step, tensors):
    """--dump-dir: one file a step (nothing without the flag)."""
    if dump_dir:
        dump_batch(os.path.join(dump_dir, f"step{step:06d}.safetensors"), tensors, run_checkpoint(dump_dir))


def run_checkpoint(dump_dir):
    """The checkpoint folder of the run that writes `dump_dir` (its metadata.json names the run folder)."""
    import json

    try:
        with open(os.path.join(dump_dir, "metadata.json"), encoding="utf-8") as f:
            return os.path.join(json.load(f)["run_dir"], "checkpoint")
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
            raise UsageError(
                f"--dump-dir {dump_dir} already holds files of {owner or 'another run'}: pass an empty or new folder"
            )
    from machinery import precision

    device = precision.pick_device()  # the dtype resolve_dtype printed: verify.py names it when a check misses
    dtype, _ = precision.choose_dtype(args.dtype, device.type, precision.native_bf16(device), args.model)
    meta = {
        "script": script,
        "run_dir": run_dir,
        "autocast_dtype": str(dtype).removeprefix("torch."),
        "args": vars(args),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    try:
        os.makedirs(dump_dir, exist_ok=True)
        with open(meta_path, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
    except OSError as e:
        raise UsageError(f"cannot write to --dump-dir {dump_dir} ({e.strerror}): pick another --dump-dir") from None


def finite(value):  # a tensor, a number, None, or a list of micro-batch pieces
    if isinstance(value, list):
        return all(finite(piece) for piece in value)
    return value is None or bool(torch.isfinite(torch.as_tensor(value)).all())


# The second term of each loss, by the key that holds it (grpo_loss: kl_ref, ppo_loss: v_loss): its flag, its name,
# and what to change when the term itself (before its coefficient) overflows.
SECOND_TERMS = {
    "kl_ref": ("--beta", "the k3 KL term", "lower --learning-rate (the policy moved far from the reference)"),
    "v_loss": ("--vf-coef", "the value loss", "scale the reward down (the returns overflow it)"),
}


def cause(what, dump, micro_terms):
    """(the term that went non-finite first, what to change) for a non-finite reward, loss or gradient, read off the
    step's batch and its micro-batches' loss terms in the order the step computes them."""
    rollout = [
        ("old_logp", "the policy's log-probs", "lower --learning-rate"),
        ("ref_logp", "the reference model's log-probs", "check the reference model's weights"),
        ("kl_coef", "the adaptive --kl-coef", "raise --kl-horizon, so the coefficient moves more slowly"),
        ("values", "the critic's values", "lower --critic-learning-rate"),
        ("scores", "the score", "check the reward function or --reward-model"),
        (
            "rewards",
            "the reward" + (" (score - --missing-eos-penalty - --kl-coef * KL)" if "scores" in dump else ""),
            "lower --kl-coef or --missing-eos-penalty, or scale the reward down"
            if "scores" in dump
            else "check the reward function or --reward-model",
        ),
        ("returns", "the returns (the rewards summed over tokens)", "scale the reward down"),
        ("advantages", "the advantages", "scale the reward down"),
    ]
    for key, name, fix in rollout:
        if key in dump and not finite(dump[key]):
            return name, fix
    second = next(((key, *SECOND_TERMS[key]) for key in SECOND_TERMS if key in micro_terms[0]), None)
    sizes = {"the policy term -A * ratio": max(t["pg_loss"].abs().max().item() for t in micro_terms)}
    if second:  # the second term as weighted in the loss: per_token_loss - pg_loss
        key, flag, name, raw_fix = second
        if what == "loss" and not all(finite(t[key]) for t in micro_terms):
            return name, raw_fix
        weighted = [(t["per_token_loss"] - t["pg_loss"] * t["mask"]).abs().max().item() for t in micro_terms]
        sizes[f"{flag} times {name}"] = max(weighted)
    bad = [name for name, size in sizes.items() if not finite(size)]
    if what == "loss" and bad:
        fixes = {"the policy term -A * ratio": "lower --learning-rate (the ratio exp(logp - old_logp) overflowed)"}
        return bad[0], fixes.get(bad[0], f"lower {bad[0].split()[0]}")
    if what == "gradient":
        largest = max(sizes, key=lambda name: sizes[name] if finite(sizes[name]) else float("inf"))
        fix = "lower --learning-rate" if largest.startswith("the policy") else f"lower {largest.split()[0]}"
        return f"the gradient of {largest} (up to {sizes[largest]:.3g} a token)", fix
    return None, "lower --learning-rate or check the reward function"


def check_finite(step, what, value, run_dir, tensors, micro_terms=None):
    """Stop the run on a NaN or inf: dump the offending batch beside the run, keep the last good checkpoint untouched;
    the line names the term that went non-finite first (cause)."""
    if finite(value):
        return
    rank = f"_rank{dist.rank()}" if dist.world_size() > 1 else ""
    dump_path, checkpoint = (
        os.path.join(run_dir, f"nonfinite_step{step}{rank}.safetensors"),
        os.path.join(run_dir, "checkpoint"),
    )
    dump_batch(dump_path, tensors, checkpoint)
    where = f"the last good checkpoint is {checkpoint}" if os.path.isdir(checkpoint) else "no checkpoint was saved yet"
    term, fix = (
        cause(what, tensors, micro_terms)
        if micro_terms
        else (None, "lower --learning-rate or check the reward function")
    )
    raise UsageError(
        f"step {step}: the {what} is not finite{f' ({term} went non-finite)' if term else ''}; the "
        f"batch is dumped to {dump_path} and {where}: {fix}"
    )


def batch_dump(rollout, micro_terms, keys, **extra):
    """A step's batch for --dump-dir and for a NaN stop: the rollout's tensors, these micro-batches' `keys`
    (concatenated by dump_batch), their loss (summed: each micro-batch's is its share of the update's), `extra`."""
    pieces = {key: [terms[key] for terms in micro_terms] for key in keys}
    return dict(rollout, **pieces, loss=sum(terms["loss"].item() for terms in micro_terms), **extra)


def stop_if_not_finite(step, run_dir, dump, reward, micro_terms, gradient):
    """Before an optimizer step: stop on a NaN or inf in the reward, a micro-batch's loss or the gradient norm,
    with `dump` (the batch) written beside the run."""
    check_finite(step, "reward", reward, run_dir, dump, micro_terms)
    check_finite(step, "loss", torch.stack([terms["loss"] for terms in micro_terms]), run_dir, dump, micro_terms)
    check_finite(step, "gradient", gradient, run_dir, dump, micro_terms)
