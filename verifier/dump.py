"""verify.py's input: a dump read and checked (its flags are a run's, its tensors what that run writes), and the
batch each adapter function receives: only its inputs (common.entry_batch), never the value it is compared with.
"""

import dataclasses
import glob
import json
import os
import typing

import torch
from safetensors.torch import load_file

import common
from machinery.errors import UsageError
from verifier.report import VerifyError, one_line

IDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
INTEGER = ("prompt_ids", "completion_ids", "eos_ids", "micro_index", "minibatch_index", "minibatches")
# Where a PPO dump's one micro-batch sits in its step: verify.py's bookkeeping, no entry point's input.
BOOKKEEPING = ("micro_index", "minibatch_index", "minibatches")
MICRO = ("new_logp", "new_values", "entropy", "per_token_loss")  # PPO: of the dumped micro-batch alone
# What each script's dump holds a step (beyond IDS): [N] or [N, T] a completion, or one value for the step. A PPO
# dump of an older version lacks token_scores and eos_ids, or the micro-batch: those rows say so and are skipped.
LAYOUT = {
    "grpo": dict(
        rows=dict(rewards=1, advantages=1, old_logp=2, new_logp=2, per_token_loss=2, ref_logp=2),
        step=("loss",),
        optional=(),
    ),
    "ppo": dict(
        rows=dict(scores=1, values=2, old_logp=2, ref_logp=2, rewards=2, advantages=2, returns=2, token_scores=2),
        step=("loss", "kl_coef", "eos_ids"),
        optional=(("token_scores", "eos_ids"), BOOKKEEPING + MICRO),
    ),
}


def script_fields(script):
    """{field: (default, type)} of grpo.Args or ppo.Args."""
    import grpo
    import ppo

    args_class = {"grpo": grpo.Args, "ppo": ppo.Args}[script]
    hints = typing.get_type_hints(args_class)
    fields = {}
    for f in dataclasses.fields(args_class):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        fields[f.name] = (default, hints[f.name])
    return fields


def fits(value, kind):
    """Whether a JSON value is one of the type `kind` (bool, int, float, str, Literal, Optional, tuple)."""
    origin, inner = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return any(fits(value, k) for k in inner)
    if origin is typing.Literal:
        return value in inner
    if origin in (tuple, list):
        return isinstance(value, (list, tuple)) and all(fits(v, inner[0]) for v in value)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def check_args(args, meta_path):
    """The dump's flags: each of its field's type, then the script's own check_args (a group size of 0 is refused
    here as grpo.py refuses it)."""
    import grpo
    import ppo

    fields = script_fields(args["script"])
    for name, (_, kind) in fields.items():
        if not fits(args[name], kind):
            raise VerifyError(
                f"{meta_path}: {name} is {args[name]!r}, not of type {getattr(kind, '__name__', kind)}: a dump of "
                "another version of this project (or a damaged one); make the dump again with this version"
            )
    module = {"grpo": grpo, "ppo": ppo}[args["script"]]
    try:
        module.check_args(module.Args(**{k: v for k, v in args.items() if k in fields}))
    except UsageError as e:
        raise VerifyError(f"{meta_path}: {one_line(e)} (no run has these flags: the dump is damaged)") from None


def load_dump(dump_dir):
    """(the run's Args as a dict, plus "script"; {step: tensors}; notes; metadata), or one line saying why this is
    not a dump of this project. Flags the run had not (a dump of an older version) get their defaults, noted."""
    meta_path = os.path.join(dump_dir, "metadata.json")
    if not os.path.isfile(meta_path):
        raise VerifyError(f"{dump_dir!r} is not a dump folder (no metadata.json): pass a run's --dump-dir")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        args = dict(meta["args"], script=meta["script"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise VerifyError(f"{meta_path} is not a dump's metadata ({type(e).__name__}: {one_line(e)})") from None
    if args["script"] not in ("grpo", "ppo"):
        raise VerifyError(f"{meta_path} is from {args['script']!r}, not grpo or ppo")
    fields, notes = script_fields(args["script"]), []
    unknown = sorted(set(args) - set(fields) - {"script"})
    if unknown:
        raise VerifyError(
            f"{meta_path} says {args['script']}.py but holds flags it has not ({', '.join(unknown[:4])}):"
            " the metadata of another script or version; make the dump again with this version"
        )
    if isinstance(args.get("gradient_checkpointing"), bool):  # the version before auto|on|off: a bool
        args["gradient_checkpointing"] = "on" if args["gradient_checkpointing"] else "off"
        notes.append(
            "the dump is from an older version (--gradient-checkpointing true/false): read as "
            f"--gradient-checkpointing {args['gradient_checkpointing']}"
        )
    missing = sorted(set(fields) - set(args))
    if missing:
        args.update({k: fields[k][0] for k in missing})
        notes.append(f"the dump has no {', '.join(missing)} (an older version): their defaults are used")
    check_args(args, meta_path)
    paths = sorted(glob.glob(os.path.join(dump_dir, "step*.safetensors")))
    if not paths:
        raise VerifyError(f"{dump_dir!r} has no stepNNNNNN.safetensors: the run stopped before its first step")
    steps = {}
    for path in paths:
        try:
            steps[int(os.path.basename(path)[4:-12])] = load_file(path)
        except Exception as e:  # a truncated or foreign file
            raise VerifyError(f"{path} cannot be read ({type(e).__name__}: {one_line(e)})") from None
    for step, d in steps.items():
        problem = check_step(d, args)
        if problem:
            raise VerifyError(
                f"step {step}: {problem}: not a step of this {args['script']}.py run (damaged, or a step of "
                "another run mixed in); make the dump again"
            )
    return args, steps, notes, meta


def check_step(d, args):
    """What is wrong with one step's tensors for these flags (keys, dtypes, shapes, indices), or None."""
    layout = LAYOUT[args["script"]]
    required = set(IDS) | set(layout["rows"]) | set(layout["step"])
    if args["script"] == "grpo" and args["beta"] == 0:
        required.discard("ref_logp")
    for group in layout["optional"]:  # all of a group, or none of it (an older version)
        required -= set(group) if not set(group) & d.keys() else set()
    missing = sorted(required - d.keys())
    if missing:
        return f"it lacks {', '.join(missing)}"
    for key, value in d.items():
        integer, known = key in INTEGER, key in required or key in MICRO
        if known and not key.endswith("_mask") and integer == value.is_floating_point():
            return f"{key} is {str(value.dtype).removeprefix('torch.')}, not {'integer' if integer else 'floating'}"
    mask = d["completion_mask"]
    if mask.dim() != 2 or d["prompt_mask"].dim() != 2 or not ((mask == 0) | (mask == 1)).all():
        return "completion_mask and prompt_mask must be [N, T] tensors of 0 and 1"
    (N, T), P = mask.shape, d["prompt_mask"].shape[1]
    flag = "--group-size" if args["script"] == "grpo" else "--samples-per-prompt"
    per_prompt = args["group_size"] if args["script"] == "grpo" else args["samples_per_prompt"]
    if N != args["prompts_per_step"] * per_prompt:
        return f"{N} completions, where --prompts-per-step {args['prompts_per_step']} {flag} {per_prompt} give " + str(
            args["prompts_per_step"] * per_prompt
        )
    if T > args["max_new_tokens"]:
        return f"completions of {T} tokens, beyond --max-new-tokens {args['max_new_tokens']}"
    shapes = {k: (N,) if dims == 1 else (N, T) for k, dims in layout["rows"].items()}
    shapes.update(prompt_ids=(N, P), completion_ids=(N, T))
    if args["script"] == "ppo" and "micro_index" in d:
        shapes.update(dict.fromkeys(MICRO, (len(d["micro_index"]), T)))
    for key, shape in shapes.items():
        if key in d and tuple(d[key].shape) != shape:
            return f"{key} has shape {tuple(d[key].shape)}, where completion_mask {tuple(mask.shape)} gives {shape}"
    if d["prompt_ids"].shape != d["prompt_mask"].shape:
        return f"prompt_ids {tuple(d['prompt_ids'].shape)} and prompt_mask {tuple(d['prompt_mask'].shape)} differ"
    if any(d[k].numel() != 1 for k in ("loss", "kl_coef") if k in d):
        return "loss and kl_coef must hold one value"
    if "minibatches" in d:
        size = N // args["num_minibatches"]
        indices = [d[k].flatten() for k in BOOKKEEPING]
        if len(d["minibatch_index"]) != size or d["minibatches"].numel() != args["update_epochs"] * N:
            return f"its minibatches are not {args['update_epochs']} passes over {N} completions in {size}s"
        if any(((i < 0) | (i >= N)).any() for i in indices) or not torch.isin(indices[0], indices[1]).all():
            return "micro_index, minibatch_index or minibatches point outside the step's completions"
    return None


def step_tensors(d, args):
    """The step's tensors by the loop's names: without verify's bookkeeping, and (PPO) its one micro-batch's."""
    leave = BOOKKEEPING + (MICRO if args["script"] == "ppo" else ())
    return {k: v for k, v in d.items() if k not in leave}


def whole_batch(d, args):
    """The step's batch with the loss's denominators (num_seqs, num_tokens: the whole batch's)."""
    mask = d["completion_mask"]
    return dict(step_tensors(d, args), num_seqs=len(mask), num_tokens=int(mask.sum()))


def micro_batch(d):
    """PPO's dumped micro-batch with the log-probs and values its loss used (its loss divides by its minibatch's)."""
    if "micro_index" not in d:
        return None
    idx, minibatch = d["micro_index"], d["minibatch_index"]
    n = len(d["completion_mask"])
    rows = {k: v[idx] for k, v in d.items() if k not in BOOKKEEPING + MICRO and v.dim() > 0 and len(v) == n}
    whole = {k: v for k, v in d.items() if k in MICRO or (k not in BOOKKEEPING and k not in rows)}
    return dict(rows, **whole, num_seqs=len(minibatch), num_tokens=int(d["completion_mask"][minibatch].sum()))


def inputs(function, batch, args):
    """The batch the adapter's `function` receives: the inputs of the entry point it stands for, as the loop gives
    them (common.entry_batch), never what it is compared with; num_seqs and num_tokens with the loss's alone. The
    pure loss checks also get the stored outputs of the models (new_logp; PPO: new_values, entropy);
    token_logprobs gets the ids and masks alone, with the counts."""
    counts = {k: batch[k] for k in ("num_seqs", "num_tokens") if k in batch}
    if function == "token_logprobs":
        return dict({k: batch[k] for k in IDS}, **counts)
    if function == "kl_coef":
        return batch
    entry = {
        "group_advantages": "compute_advantages",
        "gae": "compute_advantages",
        "rewards": "compute_rewards",
        "kl": "compute_rewards" if args["script"] == "ppo" else "compute_loss",
    }.get(function, "compute_loss")
    out = common.entry_batch(entry, batch)
    if entry != "compute_loss":  # the loss's denominators: the loss's alone
        return {k: v for k, v in out.items() if k not in counts}
    if function in ("kl", "per_token_loss", "loss"):
        out.update({k: batch[k] for k in common.MODEL_OUTPUTS if k in batch})
    return out
