"""Bad Args are refused before anything heavy is loaded (the subprocess table of bad input is in test_bad_input.py)."""

import pytest

import common
import grpo


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
