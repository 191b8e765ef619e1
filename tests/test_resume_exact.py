"""A resume continues with the straight run's learning rate (mid-warmup) and PPO's adaptive kl_coef, and a
checkpoint file changed without changing its size is refused."""

import os

import pytest
from test_reproducibility import (
    SCRIPTS,
    assert_same_weights,
    final_weights,
    logged_scalars,
    only_run_dir,
    quick_args,
    resolved_args,
)

import grpo
from machinery import checkpoints, errors

EXTRA = {
    "grpo": dict(warmup_steps=3, learning_rate=2e-3),
    "ppo": dict(warmup_steps=3, learning_rate=2e-3, target_kl=0.01, kl_horizon=8, kl_coef=0.1),
}


@pytest.mark.exact
@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_mid_warmup_and_mid_kl_control_continues_exactly(script, tmp_path):
    """2 steps, a checkpoint, 2 more: the learning rates logged (lr * s / (warmup + 1) at step s, by the
    formula here) and the KL coefficients are the straight run's, and so are the final weights."""
    main, k, m = SCRIPTS[script].main, 2, 2
    main(quick_args(script, tmp_path / "whole", num_steps=k + m, **EXTRA[script]))
    main(quick_args(script, tmp_path / "parts", num_steps=k, save_every=k, **EXTRA[script]))
    run_dir = only_run_dir(tmp_path / "parts")
    checkpoint = os.path.join(run_dir, "checkpoint")
    main(quick_args(script, tmp_path / "parts", num_steps=k + m, resume=checkpoint, **EXTRA[script]))
    whole, resumed = logged_scalars(only_run_dir(tmp_path / "whole")), logged_scalars(run_dir)
    lr = EXTRA[script]["learning_rate"]
    assert [s for s, _ in resumed["charts/learning_rate"]] == [1, 2, 3, 4]
    rates = [value for _, value in resumed["charts/learning_rate"]]
    assert rates == pytest.approx([lr * s / 4 for s in (1, 2, 3, 4)], rel=1e-6)
    assert resumed["charts/learning_rate"] == whole["charts/learning_rate"]
    if script == "ppo":
        coefs = [value for _, value in whole["charts/kl_coef"]]
        assert len(set(coefs)) == k + m, coefs  # the controller moved it every step
        assert resumed["charts/kl_coef"] == whole["charts/kl_coef"]
    assert resumed == whole
    assert_same_weights(final_weights(only_run_dir(tmp_path / "whole"), script), final_weights(run_dir, script))


def test_a_changed_file_of_the_same_size_is_refused(tmp_path):
    grpo.main(quick_args("grpo", tmp_path, num_steps=1, save_every=1))
    checkpoint = os.path.join(only_run_dir(tmp_path), "checkpoint")
    path = os.path.join(checkpoint, "policy", "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1  # the last byte of a weight: same size, still a readable file
    open(path, "wb").write(data)
    args = resolved_args("grpo", tmp_path, num_steps=2, resume=checkpoint)
    with pytest.raises(errors.UsageError, match="model.safetensors was changed after the save"):
        checkpoints.load_checkpoint(checkpoint, "grpo", args)
