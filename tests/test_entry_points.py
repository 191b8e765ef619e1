"""The entry points (compute_rewards, compute_advantages, compute_loss) get their batch from one function,
common.entry_batch: never what they or a later entry point compute; and the training loops give each the keys
verify.py gives it, so a variant that reads a new input reads it in the run as in verify."""

import json

import pytest
from verify_helpers import run

import common
import grpo
import ppo

STEP = dict.fromkeys(
    ["prompt_ids", "completion_mask", "rewards", "old_logp", "advantages", "returns", "new_logp", "per_token_loss"]
)


def test_an_entry_point_never_gets_what_it_or_a_later_one_computes():
    assert set(common.entry_batch("compute_rewards", STEP)) == {"prompt_ids", "completion_mask", "old_logp"}
    advantages = set(common.entry_batch("compute_advantages", STEP))
    assert advantages == {"prompt_ids", "completion_mask", "old_logp", "rewards"}
    assert set(common.entry_batch("compute_loss", STEP)) == advantages | {"advantages", "returns"}


ENTRY_POINTS = {
    "grpo": ["compute_advantages", "compute_loss"],
    "ppo": ["compute_rewards", "compute_advantages", "compute_loss"],
}


def record_keys(monkeypatch, path, script):
    """Each entry point of `script` writes the keys of the batch it gets to `path` (verify.py's child process too)."""
    module = grpo if script == "grpo" else ppo
    for name in ENTRY_POINTS[script]:
        real = getattr(module, name)

        def recorded(*args, name=name, real=real, **kwargs):
            batch = args[1] if name == "compute_loss" else args[0]
            with open(path, "a") as f:
                f.write(json.dumps([name, sorted(batch)]) + "\n")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)


def keys_by_entry_point(path):
    out = {}
    for line in open(path):
        name, keys = json.loads(line)
        out.setdefault(name, set()).update(keys)
    return out


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_loop_and_verify_give_each_entry_point_the_same_keys(capsys, monkeypatch, tmp_path, script):
    module = grpo if script == "grpo" else ppo
    size = dict(group_size=4) if script == "grpo" else dict(micro_batch_size=4, target_kl=1.0, kl_horizon=100)
    record_keys(monkeypatch, tmp_path / "run.jsonl", script)
    module.main(
        module.Args(
            seed=3,
            prompts_per_step=4,
            max_new_tokens=4,
            num_steps=2,
            sample_every=0,
            output_dir=str(tmp_path / "r"),
            dump_dir=str(tmp_path / "dump"),
            **size,
        )
    )
    monkeypatch.undo()
    record_keys(monkeypatch, tmp_path / "verify.jsonl", script)
    code, out, _ = run(capsys, tmp_path / "dump", "--against", "self")
    assert code == 0, out
    in_run, in_verify = keys_by_entry_point(tmp_path / "run.jsonl"), keys_by_entry_point(tmp_path / "verify.jsonl")
    assert in_run.keys() == in_verify.keys() == set(ENTRY_POINTS[script])
    differ = [
        f"{name}: only in the run {sorted(in_run[name] - in_verify[name])}, only in verify "
        f"{sorted(in_verify[name] - in_run[name])}"
        for name in ENTRY_POINTS[script]
        if in_run[name] != in_verify[name]
    ]
    assert not differ, "; ".join(differ)
