"""Bugs in the branches a training loop takes beyond one formula (a loss accumulated over micro-batches, an entropy
bonus, the optimizer's step) fail their rows on verify.py's recommended dumps; on a dump that never takes the
branch, the PASS line names it ("never exercised") and the rows it did not compare: no plain PASS."""

import pytest
from verify_helpers import make_dump, planted_source, rows, run, write_adapter

UPDATE = "update = ours.update\n"  # the planted peer's optimizer steps its own (planted) loss
BUGS = {  # name: (script, the line of grpo.py or ppo.py, the bug, the rows it must fail)
    "GRPO loss normalised per micro-batch": (
        "grpo",
        "return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs",
        "return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / len(mask)",
        ["loss", "gradient", "update"],  # the loss row calls the loss once per micro-batch, as the loop does
    ),
    "PPO micro-batch losses summed, each a mean of its own tokens": (
        "ppo",
        "loss = per_token_loss.sum() / max(minibatch_tokens, 1)",
        "loss = per_token_loss.sum() / max(int(mask.sum()), 1)",
        ["loss", "gradient", "critic gradient", "update", "critic update"],
    ),
    "PPO entropy bonus with the wrong sign": (
        "ppo",
        "per_token_loss = (pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy) * mask",
        "per_token_loss = (pg_loss + args.vf_coef * v_loss + args.ent_coef * entropy) * mask",
        ["per-token loss", "loss", "gradient", "update"],
    ),
}


def assert_caught(code, out, caught):
    results = rows(out)
    assert code == 1, out
    assert all(results[q].startswith("FAIL") for q in caught), out
    assert all(results[q].startswith(("pass", "skip")) for q in results if q not in caught), out


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_loop_bug_fails_its_rows_on_the_recommended_dump(verify_dumps, capsys, tmp_path, bug):
    script, find, replace, caught = BUGS[bug]
    adapter = write_adapter(tmp_path, planted_source(script, find, replace) + UPDATE)
    code, out, _ = run(capsys, verify_dumps[script], "--against", adapter)
    assert_caught(code, out, caught)


NEVER_STEPS = """
from verifier.calls import load_adapter
ours = load_adapter("self")
group_advantages, gae, per_token_loss = ours.group_advantages, ours.gae, ours.per_token_loss

def update(model, batch, args, state, critic=None):
    if "optimizer" not in state:
        state["optimizer"], state["scheduler"] = ours.optimizer(model, args, critic)
        state["optimizer"].step = lambda *a, **k: None  # the step forgotten: gradients computed, never applied
    ours.update(model, batch, args, state, critic)
"""


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_an_optimizer_that_never_steps_fails_the_update(verify_dumps, capsys, tmp_path, script):
    code, out, _ = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, NEVER_STEPS))
    assert code == 1 and rows(out)["update"].startswith("FAIL at step 1,2"), out


@pytest.fixture(scope="module")
def one_pass_dumps(tmp_path_factory):
    """Dumps that leave the branches out: GRPO's whole batch in one micro-batch, PPO without an entropy bonus."""
    folder = tmp_path_factory.mktemp("one-pass")
    small = dict(seed=3, prompts_per_step=3, max_new_tokens=4, num_steps=2)
    return {
        "grpo": make_dump(folder, "grpo", **small, group_size=4, num_iterations=2),  # 12 completions, micro 128
        "ppo": make_dump(folder, "ppo", **small, samples_per_prompt=4, num_minibatches=2, micro_batch_size=6),
    }


@pytest.mark.parametrize(
    "bug, never",
    [
        ("GRPO loss normalised per micro-batch", "more than one micro-batch (--micro-batch-size below the batch)"),
        ("PPO entropy bonus with the wrong sign", "an entropy bonus (--ent-coef > 0)"),
    ],
)
def test_a_dump_without_the_branch_names_it_in_the_pass_line(one_pass_dumps, capsys, tmp_path, bug, never):
    script, find, replace, _ = BUGS[bug]
    adapter = write_adapter(tmp_path, planted_source(script, find, replace) + UPDATE)
    code, out, _ = run(capsys, one_pass_dumps[script], "--against", adapter)
    summary = out.splitlines()[-1]
    assert code == 0 and summary.startswith("PASS") and "; never exercised by this dump: " in summary, out
    assert never in summary.split("; never exercised by this dump: ")[1], summary


def test_the_pass_line_names_what_it_did_not_compare(verify_dumps, capsys, tmp_path):
    """The adapter of docs/verify.md: two rows compared, every other row of the adapter's named with why."""
    body = (
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "group_advantages, per_token_loss = ours.group_advantages, ours.per_token_loss\n"
    )
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", write_adapter(tmp_path, body))
    summary = out.splitlines()[-1]
    assert code == 0 and summary.startswith("PASS: 2 of the adapter's rows within their tolerances"), out
    for q, why in [("gradient", "adapter has no train_loss()"), ("update", "adapter has no update()")]:
        assert f"{q} ({why})" in summary.split("not compared: ")[1], summary
    assert "rewards" not in summary and "replay" not in summary, summary  # GRPO has none; not the adapter's
