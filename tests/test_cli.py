"""Bad Args are refused before anything heavy is loaded (the subprocess table of bad input is in test_bad_input_cli.py);
the hub defaults replace only the fields left at their default."""

import io
import sys

import pytest

import grpo
import ppo
from machinery import errors, flags, models


@pytest.mark.parametrize(
    "field, value",
    [
        ("beta", -0.1),
        ("learning_rate", 0.0),
        ("micro_batch_size", 0),
        ("num_iterations", 0),
        ("num_steps", 0),
        ("clip_high", -0.1),
        ("max_grad_norm", 0.0),
        ("warmup_steps", -1),
    ],
)
def test_other_bad_args_are_usage_errors(field, value, tmp_path, monkeypatch):
    """The same checks in-process (no subprocess start-up), and none of them loads a model first."""
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model before checking Args"))
    with pytest.raises(errors.UsageError, match=field.replace("_", "-")):
        grpo.main(grpo.Args(output_dir=str(tmp_path), **{field: value}))


@pytest.mark.parametrize("module", [grpo, ppo])
def test_hub_defaults_replace_only_the_fields_left_at_their_default(module, monkeypatch):
    """Args declares the tiny model's defaults; on another model HUB_DEFAULTS replace them, never a value set in
    Python or on the command line (even one equal to the tiny default)."""
    assert all(getattr(module.Args(), key) is not None for key in module.HUB_DEFAULTS)  # defaults in sight
    args = module.Args(model="org/model", learning_rate=1e-3)
    assert flags.apply_hub_defaults(args, module.HUB_DEFAULTS) == "hub"
    assert args.learning_rate == 1e-3 and args.max_new_tokens == module.HUB_DEFAULTS["max_new_tokens"]
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", "--model", "org/model", "--micro-batch-size=128"])
    args, given = flags.parse_args(module.Args, module.HUB_DEFAULTS)
    flags.apply_hub_defaults(args, module.HUB_DEFAULTS, given)
    assert args.micro_batch_size == 128 and args.num_steps == module.HUB_DEFAULTS["num_steps"]
    tiny = module.Args(learning_rate=1e-3)
    assert flags.apply_hub_defaults(tiny, module.HUB_DEFAULTS) == "tiny" and tiny.num_steps == module.Args.num_steps


PARSE_ERRORS = [
    (["--no-such-flag", "3"], "Unrecognized options: --no-such-flag, 3"),
    (["--num-steps", "1e3"], "Error parsing --num-steps: invalid literal for int() with base 10: '1e3'"),
    (
        ["--dtype", "float16"],
        "invalid choice 'float16' for argument '--dtype'. Expected one of ('auto', 'bfloat16', 'float32').",
    ),
]


@pytest.mark.parametrize("argv, expected", PARSE_ERRORS)
def test_a_parse_error_is_one_line_with_exit_status_2(argv, expected, monkeypatch, capfd):
    """The parser's usage errors exit 2 (argparse's status for a command line it cannot read), not 1, the status of
    a UsageError found after parsing: a wrapper script tells the two apart."""
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    with pytest.raises(SystemExit) as exited:
        flags.parse_args(grpo.Args, grpo.HUB_DEFAULTS)
    assert exited.value.code == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"error: {expected} (--help lists every flag)"]  # the box's message alone, not its footer


@pytest.mark.parametrize("argv, expected", PARSE_ERRORS)
def test_a_parse_error_is_one_line_whatever_stdouts_encoding(argv, expected, monkeypatch, capfd):
    """Where stdout is not UTF-8 the parser draws its box in ASCII (a title line, rows of dashes): the same line."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    with pytest.raises(SystemExit) as exited:
        flags.parse_args(grpo.Args, grpo.HUB_DEFAULTS)
    assert exited.value.code == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"error: {expected} (--help lists every flag)"]
