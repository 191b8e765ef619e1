"""A run branched from a checkpoint: `--resume CHECKPOINT --output-dir NEW` continues in a new run folder, the
checkpoint's folder left byte for byte as it was; with the same flags it is the uninterrupted run, a variant's flag
may differ, a flag that fixes what the checkpoint holds may not."""

import glob
import hashlib
import json
import os

import pytest
from test_reproducibility import logged_scalars, only_run_dir, quick_args

import grpo
import ppo
from machinery import checkpoints, errors


def folder_hashes(folder):
    """{relative path: sha256} of every file under `folder`."""
    hashes = {}
    for path in glob.glob(os.path.join(folder, "**"), recursive=True) + glob.glob(os.path.join(folder, ".*")):
        if os.path.isfile(path):
            hashes[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return hashes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A grpo run of 2 steps with its checkpoint at step 2, and the uninterrupted 3-step run's scores and scalars."""
    root = tmp_path_factory.mktemp("branch")
    grpo.main(quick_args("grpo", root / "source", num_steps=2, save_every=2))
    whole = grpo.main(quick_args("grpo", root / "whole", num_steps=3))
    return (
        root,
        os.path.join(only_run_dir(root / "source"), "checkpoint"),
        whole,
        logged_scalars(only_run_dir(root / "whole")),
    )


def test_a_branch_continues_in_a_new_folder_and_leaves_the_checkpoints_as_it_was(saved):
    root, checkpoint, whole, whole_scalars = saved
    source = os.path.dirname(checkpoint)
    before = folder_hashes(source)
    assert "checkpoint/state.safetensors" in before and any(name.startswith("events.out") for name in before)
    branched = grpo.main(quick_args("grpo", root / "same", num_steps=3, resume=checkpoint))
    assert folder_hashes(source) == before  # not one file of the checkpoint's run folder changed, none added
    run_dir = only_run_dir(root / "same")
    assert json.load(open(os.path.join(run_dir, "branched_from.json")))["checkpoint"] == os.path.abspath(checkpoint)
    assert checkpoints.final_step(os.path.join(run_dir, "final")) == 3  # the source's final/ (step 2) is as it was
    assert checkpoints.final_step(os.path.join(source, "final")) == 2
    # It continued from step 2: the history of steps 1-2 came with the checkpoint, step 3 is new, and with the
    # same flags the branch is the uninterrupted run, its logs (the source's events copied) too.
    assert branched == whole and len(branched) == 3
    assert logged_scalars(run_dir) == whole_scalars


def test_a_branch_may_switch_a_variant_on(saved):
    root, checkpoint, whole, _ = saved
    before = folder_hashes(os.path.dirname(checkpoint))
    branched = grpo.main(quick_args("grpo", root / "variant", num_steps=3, resume=checkpoint, beta=0.2, clip_high=0.28))
    assert branched[:2] == whole[:2] and len(branched) == 3
    assert folder_hashes(os.path.dirname(checkpoint)) == before


@pytest.mark.parametrize("field, value, flag", [("learning_rate", 1e-3, "--learning-rate"), ("seed", 2, "--seed")])
def test_a_branch_keeps_what_fixes_the_checkpoint(saved, field, value, flag):
    root, checkpoint, _, _ = saved
    with pytest.raises(errors.UsageError, match=f"was run with {flag} .*a branch keeps it"):
        grpo.main(quick_args("grpo", root / f"fixed_{field}", num_steps=3, resume=checkpoint, **{field: value}))
    assert not glob.glob(str(root / f"fixed_{field}" / "*"))  # refused before a folder was made


def test_a_resume_in_place_refuses_a_variant_and_names_the_branch(saved):
    root, checkpoint, _, _ = saved
    in_place = os.path.dirname(os.path.dirname(checkpoint))
    with pytest.raises(errors.UsageError, match="was run with --beta .*branch the run with --output-dir NEW"):
        grpo.main(quick_args("grpo", in_place, num_steps=3, resume=checkpoint, beta=0.2))


def test_a_ppo_branch_keeps_its_critic(tmp_path):
    ppo.main(quick_args("ppo", tmp_path / "source", num_steps=1, save_every=1))
    checkpoint = os.path.join(only_run_dir(tmp_path / "source"), "checkpoint")
    with pytest.raises(errors.UsageError, match="not between 0 \\(no critic\\) and above"):
        ppo.main(quick_args("ppo", tmp_path / "b", num_steps=2, resume=checkpoint, vf_coef=0.0))
    ppo.main(quick_args("ppo", tmp_path / "c", num_steps=2, resume=checkpoint, vf_coef=0.2, ent_coef=0.01))
    assert os.path.isdir(os.path.join(only_run_dir(tmp_path / "c"), "critic"))
