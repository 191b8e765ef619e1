"""A baseline others can verify against: same seed, same run; a resumed run is the uninterrupted one, bit for bit."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

import grpo
import ppo
from machinery import checkpoints, errors, flags, models
from machinery.tiny_model import TINY_MODEL

SCRIPTS = {"grpo": grpo, "ppo": ppo}

# Small but complete: grpo with old log-probs (num_iterations 2) and a reference (beta > 0), ppo with
# a reference (kl_coef > 0), minibatches and micro-batches, so every stored state takes part.
QUICK = {
    "grpo": dict(prompts_per_step=2, group_size=3, max_new_tokens=4, num_iterations=2, beta=0.1, micro_batch_size=4),
    "ppo": dict(
        prompts_per_step=4, max_new_tokens=4, kl_coef=0.1, update_epochs=2, num_minibatches=2, micro_batch_size=1
    ),
}


def quick_args(script, output_dir, **overrides):
    fields = dict(seed=1, num_steps=2, sample_every=0, output_dir=str(output_dir), **QUICK[script])
    fields.update(overrides)
    return SCRIPTS[script].Args(**fields)


def resolved_args(script, output_dir, **overrides):
    """quick_args with the preset applied, as main() has them when it reads a checkpoint."""
    args = quick_args(script, output_dir, **overrides)
    flags.apply_hub_defaults(args, SCRIPTS[script].HUB_DEFAULTS)
    return args


def only_run_dir(output_dir):
    (run_dir,) = glob.glob(os.path.join(output_dir, "*"))
    return run_dir


def logged_scalars(run_dir):
    """{tag: [(step, value), ...]} of every scalar in the run's event files, perf/* (timings) left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if not tag.startswith("perf/")]
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}


def final_weights(run_dir, script):
    folders = ["final", "critic"] if script == "ppo" else ["final"]
    return {folder: load_file(os.path.join(run_dir, folder, "model.safetensors")) for folder in folders}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for folder in a:
        assert a[folder].keys() == b[folder].keys()
        for name in a[folder]:
            assert torch.equal(a[folder][name], b[folder][name]), f"{folder}/{name} differs"


@pytest.mark.exact
@pytest.mark.parametrize("script", SCRIPTS)
def test_same_seed_same_run(script, tmp_path):
    results = []
    for name in ("a", "b"):
        per_step = SCRIPTS[script].main(quick_args(script, tmp_path / name, num_steps=3))
        run_dir = only_run_dir(tmp_path / name)
        results.append((per_step, logged_scalars(run_dir), final_weights(run_dir, script)))
    (steps_a, scalars_a, weights_a), (steps_b, scalars_b, weights_b) = results
    assert steps_a == steps_b
    assert {"charts/score", "losses/policy_loss", "losses/kl_ref", "losses/grad_norm"} <= scalars_a.keys()
    assert [step for step, _ in scalars_a["charts/score"]] == [1, 2, 3]
    assert scalars_a == scalars_b  # exact: not one bit of any logged number differs
    assert_same_weights(weights_a, weights_b)


@pytest.mark.exact
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_deterministic_flag_turns_on_deterministic_algorithms_and_reproduces(script, tmp_path):
    """--deterministic (what a GPU run needs) switches torch's deterministic algorithms on, and changes no result on
    CPU."""
    try:
        results = []
        for name in ("a", "b"):
            per_step = SCRIPTS[script].main(quick_args(script, tmp_path / name, deterministic=True))
            assert torch.are_deterministic_algorithms_enabled()
            results.append((per_step, logged_scalars(only_run_dir(tmp_path / name))))
    finally:
        torch.use_deterministic_algorithms(False)
    plain = SCRIPTS[script].main(quick_args(script, tmp_path / "plain"))
    assert results[0] == results[1]
    assert results[0][0] == plain


def test_another_seed_another_run(tmp_path):
    """The check above can fail: a different seed changes the logged numbers."""
    grpo.main(quick_args("grpo", tmp_path / "a", seed=1))
    grpo.main(quick_args("grpo", tmp_path / "b", seed=2))
    assert logged_scalars(only_run_dir(tmp_path / "a")) != logged_scalars(only_run_dir(tmp_path / "b"))


@pytest.mark.exact
@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_continues_exactly(script, tmp_path):
    k, m = 2, 2
    main = SCRIPTS[script].main
    whole = main(quick_args(script, tmp_path / "whole", num_steps=k + m))
    first = main(quick_args(script, tmp_path / "parts", num_steps=k, save_every=k))
    run_dir = only_run_dir(tmp_path / "parts")
    checkpoint = os.path.join(run_dir, "checkpoint")
    assert (
        checkpoints.load_checkpoint(checkpoint, script, resolved_args(script, tmp_path / "parts", num_steps=k + m))[
            "step"
        ]
        == k
    )
    resumed = main(quick_args(script, tmp_path / "parts", num_steps=k + m, resume=checkpoint))

    assert first == whole[:k]
    assert resumed == whole  # the history travels in the checkpoint: all k + m steps come back
    whole_dir = only_run_dir(tmp_path / "whole")
    assert_same_weights(final_weights(whole_dir, script), final_weights(run_dir, script))
    whole_scalars, resumed_scalars = logged_scalars(whole_dir), logged_scalars(run_dir)
    assert [step for step, _ in whole_scalars["charts/score"]] == list(range(1, k + m + 1))
    assert resumed_scalars == whole_scalars


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_with_the_other_scripts_checkpoint(script, tmp_path):
    other = "ppo" if script == "grpo" else "grpo"
    SCRIPTS[other].main(quick_args(other, tmp_path / "other", num_steps=1, save_every=1))
    checkpoint = os.path.join(only_run_dir(tmp_path / "other"), "checkpoint")
    with pytest.raises(errors.UsageError, match=rf"checkpoint of {other}\.py, not {script}\.py"):
        SCRIPTS[script].main(quick_args(script, tmp_path / "mine", resume=checkpoint))


@pytest.fixture(scope="module")
def grpo_checkpoint(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("checkpointed")
    grpo.main(quick_args("grpo", output_dir, num_steps=1, save_every=1))
    return os.path.join(only_run_dir(output_dir), "checkpoint")


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("learning_rate", 1e-3, "--learning-rate"),
        ("seed", 2, "--seed"),
        ("beta", 0.2, "--beta"),
        ("loss_agg", "token-mean", "--loss-agg"),
        ("group_size", 2, "--group-size"),
    ],
)
def test_resume_with_other_args_names_the_flag(grpo_checkpoint, tmp_path, monkeypatch, field, value, flag):
    monkeypatch.setattr(
        models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model before checking the checkpoint")
    )
    in_place = os.path.dirname(
        os.path.dirname(grpo_checkpoint)
    )  # the checkpoint's own --output-dir (tmp_path: a branch)
    with pytest.raises(errors.UsageError, match=f"was run with {flag} "):
        grpo.main(quick_args("grpo", in_place, resume=grpo_checkpoint, **{field: value}))


def test_resume_may_change_what_does_not_change_the_trajectory(grpo_checkpoint, tmp_path):
    args = resolved_args(
        "grpo", tmp_path, num_steps=5, save_every=3, sample_every=7, eval_every=9, dump_dir=str(tmp_path / "d")
    )
    assert checkpoints.load_checkpoint(grpo_checkpoint, "grpo", args)["step"] == 1


def test_resume_from_a_missing_folder(tmp_path):
    with pytest.raises(errors.UsageError, match="not a checkpoint"):
        grpo.main(quick_args("grpo", tmp_path, resume=str(tmp_path / "no-such-checkpoint")))


def test_resume_from_a_corrupt_state(grpo_checkpoint, tmp_path):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(grpo_checkpoint, corrupt)
    (corrupt / "state.safetensors").write_bytes(os.urandom(1000))
    with pytest.raises(errors.UsageError, match="state.safetensors cannot be read.*corrupt"):
        grpo.main(quick_args("grpo", tmp_path, resume=str(corrupt)))


def checkpoint_step(folder):
    return checkpoints.read_state(folder)[0]["step"]


@pytest.mark.parametrize("fail_in", ["save_pretrained", "write_state"])
def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    """A crash half-way through writing checkpoint 2 leaves checkpoint 1 complete and loadable."""
    args = quick_args("grpo", tmp_path, num_steps=3, save_every=1)
    saves = []
    if fail_in == "write_state":
        real_save = checkpoints.write_state

        def save(path, state):
            saves.append(path)
            if len(saves) == 2:
                raise OSError("disk full")
            return real_save(path, state)

        monkeypatch.setattr(checkpoints, "write_state", save)
    else:
        from transformers import PreTrainedModel

        real_save_pretrained = PreTrainedModel.save_pretrained

        def save_pretrained(self, folder, *a, **k):
            if "checkpoint" not in str(folder):  # building the tiny model into the cache, when this test runs first
                return real_save_pretrained(self, folder, *a, **k)
            saves.append(folder)
            if len(saves) == 2:
                real_save_pretrained(self, folder, *a, **k)  # the weights are written, then it fails
                raise OSError("disk full")
            return real_save_pretrained(self, folder, *a, **k)

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    with pytest.raises(
        errors.UsageError,
        match=r"could not write the checkpoint of step 2 .*\(disk full\); the last good checkpoint is",
    ) as error:
        grpo.main(args)
    monkeypatch.undo()

    checkpoint = os.path.join(only_run_dir(tmp_path), "checkpoint")
    assert str(error.value).endswith(
        f"the last good checkpoint is {checkpoint}: free some disk space, then resume from it"
    )
    assert not os.path.exists(f"{checkpoint}.tmp")  # the half-written save is removed, freeing its space
    assert len(saves) == 2 and checkpoint_step(checkpoint) == 1
    assert checkpoints.load_checkpoint(checkpoint, "grpo", args)["step"] == 1
    policy = models.load_causal_lm(os.path.join(checkpoint, "policy"), torch.device("cpu"))
    assert sum(p.numel() for p in policy.parameters()) > 0
    # and the run resumes from it, to the end
    assert len(grpo.main(quick_args("grpo", tmp_path, num_steps=3, save_every=1, resume=checkpoint))) == 3


@pytest.mark.exact
def test_the_critic_has_no_dropout():
    """A dropout left on in the critic (a config key, or a head's module) would make its values depend on its
    train/eval mode, and a resumed run (fresh model, eval mode) would differ: train mode computes what eval does."""
    critic = ppo.load_critic(TINY_MODEL, torch.device("cpu"))
    assert all(m.p == 0 for m in critic.modules() if isinstance(m, torch.nn.Dropout))
    torch.nn.init.normal_(critic.value_head.weight)
    input_ids, attention_mask = torch.tensor([[0, 5, 6, 7, 8, 1]]), torch.tensor([[0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        trained = [critic.train()(input_ids, attention_mask) for _ in range(2)]
        evaluated = critic.eval()(input_ids, attention_mask)
    assert torch.equal(trained[0], trained[1]) and torch.equal(trained[0], evaluated)


@pytest.mark.exact
def test_sharing_each_groups_prompt_changes_no_score(tmp_path, monkeypatch):
    """Each group's prompt computed once (prompt_cache.py, in generation and every forward) against every row's
    computed alone: same seed, float32, the same completions and scores at every step; the losses agree to float32
    rounding (the matmuls add in another order)."""
    from machinery import prompt_cache

    runs = {}
    for name in ("shared", "plain"):
        if name == "plain":
            monkeypatch.setattr(prompt_cache, "prompt_runs", lambda ids, mask: (torch.arange(len(ids)),) * 2)
        grpo.main(quick_args("grpo", tmp_path / name, num_steps=4, group_size=4, dtype="float32"))
        runs[name] = logged_scalars(only_run_dir(tmp_path / name))
    shared, plain = runs["shared"], runs["plain"]
    assert [s for s, _ in shared["charts/score"]] == [1, 2, 3, 4]
    for tag in ("charts/score", "charts/completion_length", "charts/reward_std"):
        assert shared[tag] == plain[tag], tag
    for tag in ("losses/policy_loss", "losses/kl_ref", "losses/entropy", "losses/grad_norm"):
        assert [v for _, v in shared[tag]] == pytest.approx([v for _, v in plain[tag]], rel=1e-4, abs=1e-6), tag
