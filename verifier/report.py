"""verify.py's plumbing: reading a dump and an adapter, calling the adapter's functions so that any mistake in
them is one line, and the table of differences (its rows, tolerances, and what each row could not have caught).
"""

import dataclasses
import glob
import importlib.util
import json
import math
import os

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.abspath(__file__))
QUANTITIES = [
    "advantages",
    "rewards",
    "returns",
    "kl_coef",
    "log-probs",
    "kl",
    "per-token loss",
    "loss",
    "gradient",
    "update",
]
# (kind, value): "abs" bounds max |ours - theirs| over the real tokens, "rel" bounds it over max |ours|. Whitened
# or normalised quantities (advantages), scale-free ones (gradient, kl_coef) and the KL (it grows with the
# policy's distance from the reference: float noise with it) are relative. Float32 on CPU; a
# dump made under bf16 autocast needs --tol log-probs=1e-2. Adam's update moves an element whose gradient is near
# 0 by up to the learning rate either way in two right implementations: after two steps at lr 1e-2, TRL's log-probs
# are 1.2e-4 from ours; wrong Adam betas (0.99) give 1e-2, a reset optimizer 3: the update gets 1e-3.
TOLERANCES = {
    "advantages": ("rel", 1e-5),
    "rewards": ("abs", 1e-6),
    "returns": ("abs", 1e-6),
    "kl_coef": ("rel", 1e-6),
    "log-probs": ("abs", 1e-5),
    "kl": ("rel", 1e-6),
    "per-token loss": ("abs", 1e-6),
    "loss": ("abs", 1e-6),
    "gradient": ("rel", 1e-5),
    "update": ("abs", 1e-3),
}
FUNCTIONS = [
    "group_advantages",
    "gae",
    "rewards",
    "kl_coef",
    "token_logprobs",
    "kl",
    "per_token_loss",
    "loss",
    "train_loss",
    "update",
]
# Tensors of a PPO dump that belong to its one dumped micro-batch, or to the whole step (not one row each).
MICRO_KEYS = ("micro_index", "minibatch_index", "new_logp", "new_values", "entropy", "per_token_loss")
STEP_KEYS = ("eos_ids", "kl_coef", "loss", "minibatches")


class VerifyError(Exception):
    """Bad input (the dump, the flags): one line, exit status 2."""


class AdapterError(Exception):
    """A mistake in the adapter (raises, returns None or the wrong shape, exits, does not compile): exit status 3."""


class Interrupted(Exception):
    """Ctrl-C: exit status 130, saying where."""


def one_line(e):
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def load_adapter(name):
    """A shipped adapter (adapters/NAME.py) or a path to a .py file."""
    path = name if name.endswith(".py") or os.sep in name else os.path.join(ROOT, "adapters", f"{name}.py")
    if not os.path.isfile(path):
        shipped = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "adapters", "*.py")))
        raise VerifyError(f"no adapter {name!r}: pass one of {', '.join(shipped)} or the path of a .py file")
    label = os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(f"verify_adapter_{label}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise VerifyError(f"adapter {label!r} cannot be imported: {one_line(e)}") from None
    except SyntaxError as e:
        raise AdapterError(f"adapter {label!r} does not compile: {e.filename}:{e.lineno}: {e.msg}") from None
    except KeyboardInterrupt:
        raise Interrupted(f"while importing adapter {label!r}") from None
    except SystemExit as e:
        raise AdapterError(f"adapter {label!r} called sys.exit({e.code!r}) on import") from None
    except Exception as e:
        raise AdapterError(f"adapter {label!r} raised {type(e).__name__} on import: {one_line(e)}") from None
    if not any(callable(getattr(module, f, None)) for f in FUNCTIONS):
        raise VerifyError(f"adapter {label!r} ({path}) defines none of the functions {', '.join(FUNCTIONS)}")
    module.label = label
    return module


def parse_options(adapter, pairs):
    """--set name=value pairs, checked against the adapter's OPTIONS and typed like their defaults."""
    options = dict(getattr(adapter, "OPTIONS", {}))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in options:
            known = f"(options: {', '.join(options) or 'none'})"
            raise VerifyError(f"--set {pair!r}: adapter {adapter.label!r} has no option {key!r} {known}")
        kind = type(options[key])
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise VerifyError(f"--set {pair!r}: {key} takes true or false")
            options[key] = value.lower() == "true"
            continue
        try:
            options[key] = kind(value)
        except (TypeError, ValueError):
            raise VerifyError(f"--set {pair!r}: {key} takes a {kind.__name__}, like its default {options[key]!r}")
        if kind is float and not math.isfinite(options[key]):
            raise VerifyError(f"--set {pair!r}: {key} must be a finite number")
    return options


def parse_tolerances(pairs):
    tolerances = dict(TOLERANCES)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in tolerances:
            raise VerifyError(f"--tol {pair!r}: the quantities are {', '.join(QUANTITIES)}")
        try:
            tol = float(value)
        except ValueError:
            tol = float("nan")
        if not math.isfinite(tol) or tol < 0:
            raise VerifyError(f"--tol {pair!r}: the tolerance must be a finite number >= 0, e.g. {key}=1e-4")
        tolerances[key] = (tolerances[key][0], tol)
    return tolerances


def script_fields(script):
    """{field: default} of grpo.Args or ppo.Args."""
    import grpo
    import ppo

    args_class = {"grpo": grpo.Args, "ppo": ppo.Args}[script]
    fields = {}
    for f in dataclasses.fields(args_class):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        fields[f.name] = default
    return fields


def load_dump(dump_dir):
    """(the run's Args as a dict, plus "script"; {step: tensors}; notes), or one line saying why this is not a
    dump. Flags the run had not (a dump of an older version) get their defaults, named in a note."""
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
    missing = sorted(set(fields) - set(args))
    if missing:
        args.update({k: fields[k] for k in missing})
        notes.append(f"the dump has no {', '.join(missing)} (an older version): their defaults are used")
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
        missing = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask"} - d.keys()
        if missing:
            raise VerifyError(f"step {step} lacks {', '.join(sorted(missing))}: not a dump of this project")
        shape = tuple(d["completion_mask"].shape)
        for key, value in d.items():
            if value.dim() == 2 and not key.startswith("prompt") and value.shape[1] != shape[1]:
                raise VerifyError(f"step {step}: {key} has shape {tuple(value.shape)}, completion_mask {shape}")
        if d["prompt_ids"].shape != d["prompt_mask"].shape or len(d["prompt_ids"]) != shape[0]:
            prompt = tuple(d["prompt_ids"].shape)
            raise VerifyError(f"step {step}: prompt_ids {prompt} do not fit {shape[0]} completions")
    return args, steps, notes


def call(adapter, name, *args):
    """The adapter's function's result and None, or None and why it is skipped (no such function, or it raised
    NotImplementedError(reason)). Anything else it does wrong is an AdapterError naming it."""
    fn = getattr(adapter, name, None)
    if fn is None:
        return None, f"adapter has no {name}()"
    # Copies of the batch's tensors and of the run's args: an adapter that writes into them cannot change later
    # checks (update()'s state, the one other dict, is the adapter's to keep).
    args = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in a.items()}
        if isinstance(a, dict) and ("completion_mask" in a or "script" in a)
        else a
        for a in args
    ]
    try:
        out = fn(*args)
    except NotImplementedError as e:
        return None, str(e) or f"{name}() is not implemented for this run"
    except KeyboardInterrupt:
        raise Interrupted(f"in adapter {adapter.label!r}'s {name}()") from None
    except SystemExit as e:
        raise AdapterError(f"adapter {adapter.label!r}: {name}() called sys.exit({e.code!r})") from None
    except Exception as e:
        raise AdapterError(f"adapter {adapter.label!r}: {name}() raised {type(e).__name__}: {one_line(e)}") from None
    if out is None and name not in ("update", "setup"):
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned None: return its value, or raise "
            "NotImplementedError(reason) to skip the check"
        )
    return out, None


def as_tensor(adapter, name, value):
    try:
        return torch.as_tensor(value.detach() if torch.is_tensor(value) else value).float().cpu()
    except Exception:
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned {type(value).__name__}, not a tensor"
        ) from None


class Report:
    """One row per quantity: the worst difference over the steps checked, or why it was skipped; with what the
    dump could not exercise (a condition no step met), and a known difference accepted by --accept."""

    def __init__(self, tolerances):
        self.rows = {
            q: dict(steps={}, abs=0.0, rel=0.0, skip=None, nonfinite=False, conditions={}, known=None)
            for q in QUANTITIES
        }
        self.tolerances = tolerances

    def skip(self, quantity, reason):
        if reason and not self.rows[quantity]["steps"] and self.rows[quantity]["skip"] is None:
            self.rows[quantity]["skip"] = reason

    def exercise(self, quantity, condition, met):
        """Record whether this step meets `condition`, a branch the row claims to check."""
        conditions = self.rows[quantity]["conditions"]
        conditions[condition] = conditions.get(condition, False) or bool(met)

    def add(self, quantity, step, actual, expected, mask=None, what=""):
        """Compare `actual` (the adapter's, already a float tensor of the dump's shape) with `expected` on the
        positions `mask` keeps. A NaN or inf on either side fails the row."""
        if expected is None:
            return self.skip(quantity, f"the dump has no {what}")
        expected = torch.as_tensor(expected).detach().float().cpu()
        if mask is not None:
            keep = torch.as_tensor(mask).bool()
            actual, expected = actual[keep], expected[keep]
        row = self.rows[quantity]
        if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
            row["nonfinite"], diff, scale = True, math.inf, 1.0
        else:
            diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
            scale = expected.abs().max().item() if expected.numel() else 0.0
        diffs, at_step = (
            dict(abs=diff, rel=diff / max(scale, 1e-30)),
            row["steps"].setdefault(step, dict(abs=0.0, rel=0.0)),
        )
        for kind, value in diffs.items():
            row[kind], at_step[kind] = max(row[kind], value), max(at_step[kind], value)
        row["skip"] = None

    def passed(self, quantity):
        row, (kind, tol) = self.rows[quantity], self.tolerances[quantity]
        return row[kind] <= tol if row["steps"] else None

    def unexercised(self, quantity):
        return [c for c, met in self.rows[quantity]["conditions"].items() if not met]

    def result(self, quantity):
        row, (kind, tol) = self.rows[quantity], self.tolerances[quantity]
        if self.passed(quantity):
            missed = self.unexercised(quantity)
            return "pass" + (f"; never exercised: {', '.join(missed)}" if missed else "")
        failing = ",".join(str(s) for s, diffs in sorted(row["steps"].items()) if diffs[kind] > tol)
        if row["known"]:
            return f"differs (known: {row['known']}) at step {failing}"
        return "FAIL" + (" (NaN or inf)" if row["nonfinite"] else "") + f" at step {failing}"

    def table(self):
        lines = ["| quantity | steps | max abs diff | max rel diff | tolerance | result |", "|---" * 6 + "|"]
        for q, row in self.rows.items():
            kind, tol = self.tolerances[q]
            if row["steps"]:
                steps = ",".join(map(str, sorted(row["steps"])))
                lines.append(
                    f"| {q} | {steps} | {row['abs']:.2e} | {row['rel']:.2e} | {kind} {tol:.0e} | {self.result(q)} |"
                )
            elif row["skip"]:
                lines.append(f"| {q} | - | - | - | {kind} {tol:.0e} | skip: {row['skip']} |")
        return "\n".join(lines)

    def failures(self):
        return [q for q in self.rows if self.passed(q) is False and not self.rows[q]["known"]]


EARLY = "a completion that ends early"


def whole_batch(d, args):
    """The step's batch (PPO: without its one micro-batch's tensors) with the loss's denominators."""
    mask = d["completion_mask"]
    batch = {k: v for k, v in d.items() if args["script"] == "grpo" or k not in MICRO_KEYS}
    return dict(batch, num_seqs=len(mask), num_tokens=int(mask.sum()))


def ppo_micro_batch(d):
    """The dumped micro-batch with the log-probs and values its loss used (its loss divides by its minibatch's)."""
    if "micro_index" not in d or "minibatch_index" not in d:
        return None
    idx, minibatch = d["micro_index"], d["minibatch_index"]
    rows = {k: v[idx] for k, v in d.items() if k not in MICRO_KEYS + STEP_KEYS and v.dim() > 0}
    whole = {k: d[k] for k in MICRO_KEYS[2:] + STEP_KEYS if k in d}
    return dict(rows, **whole, num_seqs=len(minibatch), num_tokens=int(d["completion_mask"][minibatch].sum()))


def compare(report, quantity, step, adapter, fn, value, expected, mask=None, what=""):
    """The adapter's `value` (from `fn`) against the dump's `expected`, which must have the same shape."""
    if value is None:
        return
    if expected is None:
        return report.skip(quantity, f"the dump has no {what}")
    actual = as_tensor(adapter, fn, value)
    if actual.shape != expected.shape:
        raise AdapterError(
            f"adapter {adapter.label!r}: {fn}() returned shape {tuple(actual.shape)} at step {step}; "
            f"the dump's {what} is {tuple(expected.shape)}"
        )
    report.add(quantity, step, actual, expected, mask, what)


def loss_conditions(report, quantities, ref, batch, args):
    """What a loss row exercises on this batch, read from this project's own per-token terms."""
    _, terms = ref._loss(batch, args)
    if "logratio" not in terms or "advantages" not in terms:  # a loss without a ratio: nothing to say
        return
    real = batch["completion_mask"].bool()
    ends_early = (real[:, -1] == 0).any()
    ratio, adv = terms["logratio"].exp()[real], terms["advantages"].expand_as(real)[real]
    low, high = ratio < 1 - args["clip_low"], ratio > 1 + args["clip_high"]
    for q in quantities:
        report.exercise(q, "a ratio away from 1", ((ratio - 1).abs() > 1e-6).any())
        report.exercise(q, EARLY, ends_early)  # the aggregation's denominators differ
        report.exercise(q, "a ratio clipped below with A < 0", (low & (adv < 0)).any())
        report.exercise(q, "a ratio clipped above with A > 0", (high & (adv > 0)).any())
        report.exercise(
            q,
            "a ratio out of the clip range where the clip does not bind",
            ((low & (adv > 0)) | (high & (adv < 0))).any(),
        )
        if "new_values" in terms and "old_values" in terms:
            moved = (terms["new_values"] - terms["old_values"])[real]
            report.exercise(q, "values moved from the rollout's", (moved != 0).any())
            report.exercise(
                q, "a value clipped (|V - V_old| > cliprange_value)", (moved.abs() > args["cliprange_value"]).any()
            )
            report.exercise(q, "a micro-batch smaller than its minibatch", batch["num_seqs"] > len(real))
        elif "kl_ref" in terms:
            report.exercise(q, "a KL that is not 0", (terms["kl_ref"][real] != 0).any())
