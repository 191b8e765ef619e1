"""Bad input on the command line gets a one-line error, not a traceback, before anything heavy is loaded."""

import os
import subprocess
import sys

import pytest

import common
import grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_FLAGS = [
    ["--group-size", "1"],
    ["--prompts-per-step", "0"],
    ["--max-new-tokens", "0"],
    ["--task", "nosuchtask"],
    ["--model", "/no/such/dir"],
    ["--temperature", "0"],
    ["--clip-low", "1.5"],
    ["--clip-low", "-0.1"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=" ".join)
def test_bad_flag_gives_one_line_error(flags, tmp_path, xdg_cache):
    env = dict(os.environ, XDG_CACHE_HOME=xdg_cache)
    result = subprocess.run(
        [sys.executable, "grpo.py", *flags, "--output-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert not os.listdir(tmp_path)  # it stopped before creating the run folder


@pytest.mark.parametrize(
    "field, value",
    [("beta", -0.1), ("learning_rate", 0.0), ("micro_batch_size", 0), ("num_iterations", 0), ("num_steps", 0),
     ("clip_high", -0.1), ("max_grad_norm", 0.0), ("warmup_steps", -1)],
)  # fmt: skip
def test_other_bad_args_are_usage_errors(field, value, tmp_path, monkeypatch):
    """The same checks in-process (no subprocess start-up), and none of them loads a model first."""
    monkeypatch.setattr(common, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model before checking Args"))
    with pytest.raises(common.UsageError, match=field.replace("_", "-")):
        grpo.main(grpo.Args(output_dir=str(tmp_path), **{field: value}))
