"""The flags both scripts share (RunArgs), the checks every flag passes before anything loads, the hub defaults
and the settings printed at start. Nothing here changes what a run computes."""

import contextlib
import dataclasses
import inspect
import io
import itertools
import math
import sys
from dataclasses import dataclass
from typing import Literal, Optional

from machinery import distributed as dist
from machinery import lora
from machinery.errors import UsageError
from machinery.models import TINY_MODELS


@dataclass
class RunArgs:
    """Flags both scripts share that leave the algorithm as it is: prompts and rewards, precision, checkpoints, logs."""

    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template for base models)"""
    system_prompt: Optional[str] = None
    """the chat template's system prompt ("" for an empty one); by default the template's own, if it has one"""
    reward_model: Optional[str] = None
    """hub id or local folder of a sequence-classification reward model, instead of the task's reward"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """precision of the forward passes under autocast; weights stay float32 (auto: bfloat16 on a GPU or CPU that
    computes it natively, else float32; printed at start with the reason, see machinery/precision.py); float16 is
    not offered: it would need loss scaling"""
    threads: str = "auto"
    """threads of torch's CPU operations: auto (torch's default, at most the cores other processes leave idle,
    checked at start, after each step and before each forward pass, and at most the cores over torchrun's
    processes; an OMP_NUM_THREADS of yours wins) or a number; printed at start with the reason, see
    machinery/threads.py"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute activations in the backward pass to save memory (switched off during generation); auto: on where
    a micro-batch's activations would outweigh all else the step holds (printed at load, see
    machinery/model_checks.py)"""
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
    """(the command line as `args_class`, the fields it sets: those keep the value given over a hub default, and an
    --output-dir given makes a branch of --resume even at its default).

    --help shows each field's default as declared, and the hub defaults in the description.
    """
    import tyro

    hub = ", ".join(f"{flag(key)} {value}" for key, value in hub_defaults.items())
    description = (
        f"{inspect.cleandoc(args_class.__doc__)}\n\n"
        f"On a model other than tiny, HUB_DEFAULTS replace these defaults: {hub}."
    )
    refuse_none_text(args_class, sys.argv[1:])
    args = one_line_parse_errors(lambda: tyro.cli(args_class, description=description))
    flags = {word.split("=")[0].replace("_", "-") for word in sys.argv[1:] if word.startswith("--")}
    return args, {field.name for field in dataclasses.fields(args) if flag(field.name) in flags}


def refuse_none_text(args_class, argv):
    """The command line parser reads the text None as no value for a flag that may be unset (--resume None would
    start a new run, --reward-model None train on the task's reward): refused in one line, never read as unset."""
    optional = {flag(f.name) for f in dataclasses.fields(args_class) if f.default is None}
    for i, word in enumerate(argv):
        name, _, value = word.partition("=") if "=" in word else (word, "", argv[i + 1] if i + 1 < len(argv) else "")
        if name.replace("_", "-") in optional and value == "None":
            what = "reword the prompt" if "system" in name else "write a path such as ./None"
            raise UsageError(f"{name} None: None would read as no {name} at all; leave the flag out, or {what}")


def box_message(text):
    """The message of the command line parser's error box: its first section, between the rule under the title and
    the next rule. The box is drawn in lines (a title in its top border) or, where the output is not UTF-8, in
    ASCII (the title on a line of its own, a row of dashes under it): both read as title, rule, message, rule, ..."""
    lines = []
    for line in text.splitlines():
        line = line.strip().strip("│").strip()
        if line.startswith("╭"):  # the top border holds the title
            lines += [line.strip("╭╮─ "), "─"]
        elif line and not line.startswith("╰"):
            lines.append(line)
    is_rule = lambda line: set(line) <= set("─-")  # noqa: E731
    after_title = itertools.dropwhile(lambda line: not is_rule(line), lines)
    next(after_title, None)
    return " ".join(itertools.takewhile(lambda line: not is_rule(line), after_title))


def one_line_parse_errors(parse):
    """`parse()`, with the command line parser's boxed error (an unknown flag, a value of the wrong type, a choice
    not offered) printed as one line, `error: ...`, and exit status 2; --help and anything else as it was."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse()
    except SystemExit as e:
        message = box_message(captured.getvalue())
        if e.code in (0, None) or not message:  # --help, or no box to shorten
            raise
        captured = io.StringIO()
        print(f"error: {message} (--help lists every flag)", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.stderr.write(captured.getvalue())


def flag(name):
    return "--" + name.replace("_", "-")


def check_acts(args, name, active, needs, enable, hub_defaults=None):
    """Refuse flag `name` set to a value of its own while it cannot act (`active` false): `needs` says when it
    acts, `enable` how to make it. Its declared default, or its hub default, changes nothing: passing it is fine."""
    value, defaults = getattr(args, name), [getattr(type(args), name)]
    defaults += [hub_defaults[name]] if name in (hub_defaults or {}) else []
    if not active and value not in defaults:
        shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
        raise UsageError(f"{flag(name)} {shown} acts only {needs}, so it would change nothing: {enable}, or drop it")


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


FLOORS = {  # flags with a range of their own: outside it the weights stay as they are, or a step never ends
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
    "max_sampling_rounds": (
        1,
        100,
        "at most 100: each round samples another --prompts-per-step x --group-size completions; a task whose "
        "groups rarely differ needs a larger --group-size or an easier task, not more rounds",
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
    """The checks of the run flags the three scripts share; each script's check_args calls it first.

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
    if getattr(args, "temperature", 1.0) <= 0:  # reward_model.py samples in its own flags' terms: no --temperature
        raise UsageError(f"--temperature is {args.temperature}: it must be > 0 (the log-probs divide by it)")
    for name, (low, high, why) in FLOORS.items():
        value = getattr(args, name, None)
        if value is not None and (0 < value < low or (high and value > high)):  # <= 0: the range rules
            raise UsageError(f"--{name.replace('_', '-')} is {value}: {why}")
    if not 0 <= getattr(args, "clip_low", 0) < 1 or getattr(args, "clip_high", 0) < 0:
        raise UsageError(
            f"--clip-low {args.clip_low} --clip-high {args.clip_high}: need 0 <= clip-low < 1 and clip-high >= 0"
        )
    check_range(args, "in (0, 1)", "learning_rate")  # Adam moves each weight by about lr a step: 1 or more is noise
    check_range(args, "> 0", "max_grad_norm")
    check_range(args, ">= 0", "weight_decay", "warmup_steps")
    last_rate = args.learning_rate * min(1.0, args.num_steps / (args.warmup_steps + 1))  # the warmup's, at the end
    if args.num_steps >= 1 and last_rate < FLOORS["learning_rate"][0]:  # fewer steps: the script's own line
        raise UsageError(
            f"--warmup-steps {args.warmup_steps} is too long for a run of --num-steps {args.num_steps}: the learning "
            f"rate would reach only {last_rate:.3g} by its last step, below 1e-8, where AdamW moves no weight; "
            "shorten the warmup or lengthen the run"
        )
    if args.learning_rate * args.weight_decay >= 1:  # AdamW multiplies each weight by 1 - lr * wd every step
        raise UsageError(
            f"--learning-rate {args.learning_rate} times --weight-decay {args.weight_decay} is >= 1: every step would "
            "zero or flip the weights; lower --weight-decay"
        )
    if args.system_prompt is not None and not args.chat_template:
        raise UsageError(
            "--system-prompt goes into the chat template's system turn, and --no-chat-template uses none: drop "
            "--system-prompt, or write it into the task's prompts"
        )
    check_names(args)
    for name in ("eval_every", "save_every", "sample_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"{flag(name)} is {getattr(args, name)}: use 0 for never, or a positive number of steps")
    lora.check_args(args)


EMPTY = {  # a flag given as '' (an unset shell variable): what it would have meant, and what to pass instead
    "dump_dir": "a folder to dump into, or leave the flag out for no dumps",
    "resume": "a checkpoint folder, or leave the flag out for a new run",
    "reward_model": "a reward model's folder or hub id, or leave the flag out for the task's reward",
    "critic_model": "the critic's folder or hub id, or leave the flag out for the policy's",
    "output_dir": "a folder for the run folders (runs by default)",
    "exp_name": "a name for the run",
}


def check_names(args):
    """Folder and model flags given as '' are refused (an unset shell variable would silently unset --resume, or
    write into the current folder); --exp-name is one plain name: the run folder stays inside --output-dir."""
    for name, fix in EMPTY.items():
        if getattr(args, name, None) == "":
            raise UsageError(f"{flag(name)} is empty: pass {fix}")
    name = args.exp_name
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UsageError(
            f"--exp-name {name[:60]!r} is not a plain name: it would place the run folder elsewhere than directly "
            "in --output-dir; pass a name without / (choose the folder with --output-dir)"
        )


def apply_hub_defaults(args, hub_defaults, given=()):
    """On a model other than the tiny one (or with --preset hub), each field of `hub_defaults` still at its Args
    default takes the hub value, unless it is in `given` (set on the command line). Returns `tiny` or `hub`."""
    preset = args.preset or ("tiny" if args.model in TINY_MODELS else "hub")
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
