"""A run branched from a checkpoint: `--resume CHECKPOINT --output-dir NEW` continues in a new run folder, the
checkpoint's folder left byte for byte as it was; with the same flags it is the uninterrupted run, a variant's flag
may differ, a flag that fixes what the checkpoint holds may not."""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from test_reproducibility import logged_scalars, only_run_dir, quick_args

import grpo
import ppo
from machinery import checkpoints, errors, models
from machinery.tiny_model import TINY_MODEL


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


def test_a_branch_continues_in_a_new_folder_and_leaves_the_checkpoints_as_it_was(saved, monkeypatch):
    root, checkpoint, whole, whole_scalars = saved
    source = os.path.dirname(checkpoint)
    before = folder_hashes(source)
    assert "checkpoint/state.safetensors" in before and any(name.startswith("events.out") for name in before)
    # The checkpoint given as a relative path with a trailing slash, as a shell completes it: branched_from.json
    # still names it absolutely (it must find it from anywhere), and the source's events are still found.
    monkeypatch.chdir(root)
    given = os.path.relpath(checkpoint, root) + os.sep
    branched = grpo.main(quick_args("grpo", root / "same", num_steps=3, resume=given))
    monkeypatch.undo()
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


# Written out here, not read from checkpoints.BRANCH_FIXED: a flag dropped from that set must fail this test. Each
# value differs from the checkpoint's (and from the flag's default, so "given as the default" cannot pass it).
GRPO_FIXED = [
    ("learning_rate", 1e-3),
    ("seed", 2),
    ("weight_decay", 0.1),
    ("decay_norms_and_biases", False),
    ("warmup_steps", 2),
    ("lora_rank", 2),
    ("task", "addition"),
    ("model", "COPY OF TINY"),
]
PPO_FIXED = [
    ("kl_coef", 0.3),
    ("critic_learning_rate", 1e-3),
    ("learning_rate", 1e-3),
    ("warmup_steps", 2),
    ("critic_model", "COPY OF TINY"),
]
LORA_FIXED = [("lora_alpha", 16.0), ("lora_dropout", 0.1), ("lora_target_modules", ("q_proj",))]


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory):
    """The tiny model's files in another folder: the same weights under another --model (or --critic-model)."""
    return shutil.copytree(models.resolve_model_path(TINY_MODEL), tmp_path_factory.mktemp("copy") / "tiny")


@pytest.mark.parametrize("field, value", GRPO_FIXED)
def test_a_branch_keeps_what_fixes_the_checkpoint(saved, tiny_copy, field, value):
    root, checkpoint, _, _ = saved
    flag = "--" + field.replace("_", "-")
    value = str(tiny_copy) if value == "COPY OF TINY" else value
    with pytest.raises(errors.UsageError, match=f"was run with {flag} .*a branch keeps it"):
        grpo.main(quick_args("grpo", root / f"fixed_{field}", num_steps=3, resume=checkpoint, **{field: value}))
    assert not glob.glob(str(root / f"fixed_{field}" / "*"))  # refused before a folder was made


@pytest.fixture(scope="module")
def ppo_saved(tmp_path_factory):
    """{vf_coef: checkpoint} of two 1-step ppo runs, one with a critic (vf_coef 0.1) and one without (0)."""
    root = tmp_path_factory.mktemp("ppo_branch")
    for vf_coef in (0.1, 0.0):
        ppo.main(quick_args("ppo", root / f"source_{vf_coef}", num_steps=1, save_every=1, vf_coef=vf_coef))
    return root, {
        vf_coef: os.path.join(only_run_dir(root / f"source_{vf_coef}"), "checkpoint") for vf_coef in (0.1, 0.0)
    }


@pytest.mark.parametrize("field, value", PPO_FIXED)
def test_a_ppo_branch_keeps_what_fixes_the_checkpoint(ppo_saved, tiny_copy, field, value):
    """kl_coef above all: the restored KL controller's value would silently override a new --kl-coef."""
    root, checkpoints_by_vf = ppo_saved
    flag = "--" + field.replace("_", "-")
    value = str(tiny_copy) if value == "COPY OF TINY" else value
    with pytest.raises(errors.UsageError, match=f"was run with {flag} .*a branch keeps it"):
        ppo.main(
            quick_args("ppo", root / f"fixed_{field}", num_steps=2, resume=checkpoints_by_vf[0.1], **{field: value})
        )
    assert not glob.glob(str(root / f"fixed_{field}" / "*"))


@pytest.fixture(scope="module")
def lora_saved(tmp_path_factory):
    """A 1-step grpo run with LoRA adapters of rank 2, and its checkpoint."""
    root = tmp_path_factory.mktemp("lora_branch")
    grpo.main(quick_args("grpo", root / "source", num_steps=1, save_every=1, lora_rank=2))
    return root, os.path.join(only_run_dir(root / "source"), "checkpoint")


@pytest.mark.parametrize("field, value", LORA_FIXED)
def test_a_lora_branch_keeps_what_fixes_the_checkpoint(lora_saved, field, value):
    """The adapters' scale, dropout and layers fix what a LoRA checkpoint holds."""
    root, checkpoint = lora_saved
    flag = "--" + field.replace("_", "-")
    with pytest.raises(errors.UsageError, match=f"was run with {flag} .*a branch keeps it"):
        grpo.main(quick_args("grpo", root / field, num_steps=2, resume=checkpoint, lora_rank=2, **{field: value}))
    assert not glob.glob(str(root / field / "*"))


def test_a_branch_is_not_refused_by_the_sources_final_model(saved, tmp_path):
    """The source's run went on past its checkpoint (its final model is of step 3): a branch to step 3 writes its
    own final model in its own folder, so it runs; a resume in place would overwrite it, so it is refused."""
    root, checkpoint, _, _ = saved
    source = shutil.copytree(
        os.path.dirname(checkpoint), tmp_path / "source" / "run", ignore=shutil.ignore_patterns(".lock")
    )
    with open(os.path.join(source, "final", checkpoints.FINAL_STEP), "w", encoding="utf-8") as f:
        json.dump({"step": 3}, f)
    copied = os.path.join(source, "checkpoint")
    grpo.main(quick_args("grpo", tmp_path / "branch", num_steps=3, resume=copied))
    assert checkpoints.final_step(os.path.join(only_run_dir(tmp_path / "branch"), "final")) == 3
    with pytest.raises(errors.UsageError, match="holds the model of step 3"):
        grpo.main(quick_args("grpo", tmp_path / "source", num_steps=3, resume=copied))


def test_a_branch_reads_a_source_that_is_still_running(saved, tmp_path):
    """The source's run still goes on (another process holds its folder's lock): a branch only reads its checkpoint,
    so it runs; a resume in place would write beside that run, so it is refused."""
    root, checkpoint, _, _ = saved
    source = shutil.copytree(os.path.dirname(checkpoint), tmp_path / "source" / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, os.path.join(source, ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        copied = os.path.join(source, "checkpoint")
        with pytest.raises(errors.UsageError, match="is in use by another run"):
            grpo.main(quick_args("grpo", tmp_path / "source", num_steps=3, resume=copied))
        grpo.main(quick_args("grpo", tmp_path / "branch", num_steps=3, resume=copied))
    finally:
        holder.kill()
        holder.wait()
    assert checkpoints.final_step(os.path.join(only_run_dir(tmp_path / "branch"), "final")) == 3


HOLD_LOCK = """import fcntl, sys, time
handle = open(sys.argv[1], "a")
fcntl.flock(handle, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_resume_with_output_dir_at_its_default_continues_in_place(saved, tmp_path, monkeypatch):
    """--output-dir left at its default ("runs", here a folder that is not the checkpoint's) is no branch: the
    run continues in the checkpoint's own folder, so a variant's flag is refused as for any resume in place."""
    root, checkpoint, _, _ = saved
    monkeypatch.chdir(tmp_path)
    default = quick_args("grpo", "runs", resume=checkpoint)
    assert not checkpoints.branches(default)
    assert checkpoints.branches(quick_args("grpo", "elsewhere", resume=checkpoint))
    # The checkpoint's own parent, however it is spelled, is no branch either.
    assert not checkpoints.branches(quick_args("grpo", os.path.relpath(root / "source", tmp_path), resume=checkpoint))
    with pytest.raises(errors.UsageError, match="was run with --beta .*branch the run with --output-dir NEW"):
        grpo.main(quick_args("grpo", "runs", num_steps=3, resume=checkpoint, beta=0.2))
    assert not os.path.exists(tmp_path / "runs")


def test_a_resume_in_place_refuses_a_variant_and_names_the_branch(saved):
    root, checkpoint, _, _ = saved
    in_place = os.path.dirname(os.path.dirname(checkpoint))
    with pytest.raises(errors.UsageError, match="was run with --beta .*branch the run with --output-dir NEW"):
        grpo.main(quick_args("grpo", in_place, num_steps=3, resume=checkpoint, beta=0.2))


def test_a_ppo_branch_keeps_its_critic(ppo_saved, tmp_path):
    """--vf-coef may change on a branch, but not between 0 (no critic) and above, in either direction."""
    _, checkpoints_by_vf = ppo_saved
    with pytest.raises(
        errors.UsageError, match="with --vf-coef 0.1, not 0.0: .*not between 0 \\(no critic\\) and above"
    ):
        ppo.main(quick_args("ppo", tmp_path / "a", num_steps=2, resume=checkpoints_by_vf[0.1], vf_coef=0.0))
    with pytest.raises(
        errors.UsageError, match="with --vf-coef 0.0, not 0.2: .*not between 0 \\(no critic\\) and above"
    ):
        ppo.main(quick_args("ppo", tmp_path / "b", num_steps=2, resume=checkpoints_by_vf[0.0], vf_coef=0.2))
    assert not glob.glob(str(tmp_path / "*" / "*"))  # refused before a folder was made
    ppo.main(quick_args("ppo", tmp_path / "c", num_steps=2, resume=checkpoints_by_vf[0.1], vf_coef=0.2, ent_coef=0.01))
    assert os.path.isdir(os.path.join(only_run_dir(tmp_path / "c"), "critic"))
