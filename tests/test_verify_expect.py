"""Issue 49's rules: a known difference is an exact expectation (a bug on top of it fails), the gradient and update
rows are each trained model's, the recommended dumps separate every pair a bug could confuse (each swap fails its
row there) and verify names each equal pair of any dump on the PASS line, and --tol has a ceiling."""

import pytest
from test_verify_planted import PLANTED
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, make_dump, rows, run, write_adapter

import grpo

EXPECTED = """
import torch
from verifier.calls import load_adapter
from verifier.expect import ours, with_args
mine = load_adapter("self")
ON_TOP = {on_top!r}

def group_advantages(batch, args):
    return mine.group_advantages(batch, dict(args, adv_eps=1e-6)) * (1 + ON_TOP)

per_token_loss, loss = mine.per_token_loss, mine.loss

def known_differences(args, options):
    why, where = "my std's eps is 1e-6", "mine.py, group_advantages"
    return {{"advantages": dict(why=why, where=where, expect=with_args(ours().group_advantages, adv_eps=1e-6))}}
"""


def test_a_bug_on_top_of_an_exact_known_difference_fails(verify_dumps, capsys, tmp_path):
    """The peer's eps is expected exactly: a relative slip of 1e-4 on top of it (far below any bound a margin would
    give) fails the row, naming its distance from the expectation."""
    clean = write_adapter(tmp_path, EXPECTED.format(on_top=0.0), "clean.py")
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", clean)
    assert code == 1 and "(the adapter declares a known difference here: --accept advantages)" in out, out
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", clean, "--accept", "advantages")
    assert code == 0 and rows(out)["advantages"].startswith("differs (known: my std's eps is 1e-6"), out
    assert "matches the declared expectation within the tolerance" in out, out
    slipped = write_adapter(tmp_path, EXPECTED.format(on_top=1e-4), "slipped.py")
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", slipped, "--accept", "advantages")
    assert code == 1 and rows(out)["advantages"].startswith("FAIL (neither this project's value nor the declared"), out


def test_a_bound_needs_its_derivation(verify_dumps, capsys, tmp_path):
    body = (
        "from verifier.calls import load_adapter\ngroup_advantages = load_adapter('self').group_advantages\n"
        "def known_differences(args, options):\n"
        "    return {'advantages': dict(why='x', where='y', bound=('rel', 1e-2))}\n"
    )
    code, _, err = run(capsys, verify_dumps["plain"], "--against", write_adapter(tmp_path, body))
    assert code == 3 and "has a bound without a derivation" in err and len(err.strip().splitlines()) == 1, err


PER_MODEL = """
import torch, ppo
from verifier.calls import load_adapter
from verifier.expect import ours
mine = load_adapter("self")
ENTROPY = {entropy}

def doubled_value_loss(model, batch, args, critic=None):
    return mine.train_loss(model, batch, dict(args, vf_coef=2 * args["vf_coef"]), critic)

def train_loss(model, batch, args, critic=None):
    return doubled_value_loss(model, batch, dict(args, ent_coef=ENTROPY * args["ent_coef"]), critic)

gae, per_token_loss, loss = mine.gae, mine.per_token_loss, mine.loss

def known_differences(args, options):
    why, where = "my value loss weighs twice", "mine.py, train_loss"
    return {{"critic gradient": dict(why=why, where=where, expect=doubled_value_loss)}}
"""


def test_the_critics_accepted_difference_cannot_mask_a_policy_bug(verify_dumps, capsys, tmp_path):
    """The critic's gradient differs by design (a doubled value loss, expected exactly); the policy's is its own row,
    so an entropy bonus of the wrong sign fails it however large the critic's difference."""
    clean = write_adapter(tmp_path, PER_MODEL.format(entropy=1), "clean.py")
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", clean, "--accept", "critic gradient")
    assert code == 0 and rows(out)["gradient"] == "pass", out
    assert rows(out)["critic gradient"].startswith("differs (known: my value loss weighs twice"), out
    flipped = write_adapter(tmp_path, PER_MODEL.format(entropy=-1), "flipped.py")
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", flipped, "--accept", "critic gradient")
    assert code == 1 and out.splitlines()[-1] == "FAIL: gradient", out


# A bug confusing two settings, in an adapter that is otherwise this project: each fails its row on the recommended
# dump, where the two differ.
SWAPS = {
    "swapped clip bounds": (
        "grpo",
        "BUGS = [(grpo, 'clipped_policy_loss', (lambda f: lambda lr, a, lo, hi: f(lr, a, hi, lo))"
        "(grpo.clipped_policy_loss))]",
        ["per-token loss", "loss", "gradient"],
    ),
    "gamma and lambda swapped": (
        "ppo",
        "BUGS = []\ndef gae(batch, args):\n    return ours.gae(batch, dict(args, gamma=args['lam'], lam=args['gamma'])"
        ")",
        ["advantages", "returns"],
    ),
    "the controller's upper clip at 0.3": (
        "ppo",
        "BUGS = [(ppo, 'adaptive_kl_coef', lambda c, kl, t, n, h: c * (1 + min(max(kl / t - 1, -0.2), 0.3) * n / h))]",
        ["kl_coef"],
    ),
    "the critic stepped at the policy's rate": (
        "ppo",
        "BUGS = []\ndef update(model, batch, args, state, critic=None):\n"
        "    ours.update(model, batch, dict(args, critic_learning_rate=args['learning_rate']), state, critic)",
        ["critic update"],
    ),
    "the schedule a step late": (
        "grpo",
        "BUGS = []\ndef update(model, batch, args, state, critic=None):\n"
        "    if 'optimizer' not in state:\n"
        "        opt, _ = ours.optimizer(model, args, critic)\n"
        "        late = lambda s: min(1.0, s / (args['warmup_steps'] + 1))\n"
        "        state.update(optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, late))\n"
        "    ours.update(model, batch, args, state, critic)",
        ["update"],
    ),
}


@pytest.mark.parametrize("bug", list(SWAPS))
def test_a_confusion_of_two_settings_fails_on_the_recommended_dump(verify_dumps, capsys, tmp_path, bug):
    script, source, caught = SWAPS[bug]
    adapter = write_adapter(tmp_path, PLANTED + source + "\nupdate = globals().get('update', ours.update)\n")
    code, out, _ = run(capsys, verify_dumps[script], "--against", adapter)
    results = rows(out)
    assert code == 1 and all(results[q].startswith("FAIL") for q in caught), out
    assert all(results[q].startswith(("pass", "skip")) for q in results if q not in caught), out


def test_the_pass_line_names_each_equal_pair(verify_dumps, capsys):
    """The plain dump keeps the clip bounds equal and has no warmup: the PASS line says what would not show; the
    recommended dumps separate every pair and say none."""
    code, out, _ = run(capsys, verify_dumps["plain"])
    summary = out.splitlines()[-1]
    assert code == 0 and "--clip-low equals --clip-high: swapped clip bounds would not show" in summary, out
    assert "no --warmup-steps: the learning rate never moves, so a schedule a step late would not show" in summary
    for script in ("grpo", "ppo"):
        code, out, _ = run(capsys, verify_dumps[script])
        assert code == 0 and "equals" not in out and "no --warmup-steps" not in out, out
        assert "controller" not in out.splitlines()[-1], out  # both of its clips reached (PPO)


def test_tol_has_a_ceiling_and_a_loosened_tolerance_is_named(verify_dumps, capsys):
    code, _, err = run(capsys, verify_dumps["plain"], "--tol", "gradient=1")
    assert code == 2 and "beyond the ceiling rel 0.0001 (10x the default 1e-05)" in err, err
    assert len(err.strip().splitlines()) == 1, err
    code, out, _ = run(capsys, verify_dumps["plain"], "--tol", "gradient=1e-4", "--tol", "kl=1e-7")
    summary = out.splitlines()[-1]
    assert code == 0 and "tolerances loosened by --tol: gradient rel 1e-04 (default 1e-05)" in summary, out
    assert "kl rel" not in summary  # tightened: not named


def micro_statistics_loss(original):
    """A fork's compute_loss with a term built on the micro-batch's own statistics: each token's log-prob's squared
    distance from the mean log-prob of the micro-batch it is in (what KL-Cov's means and top-k are like)."""

    def compute_loss(outputs, batch, args):
        loss, terms = original(outputs, batch, args)
        mask, logp = batch["completion_mask"], outputs["new_logp"]
        centre = (logp.detach() * mask).sum() / mask.sum()  # over this call's tokens alone
        extra = 0.1 * (logp - centre) ** 2 * mask
        terms["per_token_loss"] = terms["per_token_loss"] + extra.detach()
        loss = loss + extra.sum() / batch["num_tokens"]
        terms["loss"] = loss.detach()
        return loss, terms

    return compute_loss


def test_a_fork_whose_loss_reads_its_micro_batch_passes_against_self(capsys, tmp_path, monkeypatch):
    """The loss rows call compute_loss once per micro-batch, as the loop did (issue 52): a loss on the micro-batch's
    statistics passes on a dump with several micro-batches; called on the whole batch at once it would not."""
    monkeypatch.setattr(grpo, "compute_loss", micro_statistics_loss(grpo.compute_loss))
    dump = make_dump(tmp_path, "grpo", **dict(GRPO_RECIPE, num_steps=2))
    code, out, _ = run(capsys, dump)
    results = rows(out)
    assert code == 0 and all(results[q].startswith("pass") for q in ("per-token loss", "loss", "gradient")), out


def test_micro_batch_conditions_are_judged_against_the_minibatch(verify_dumps, capsys, tmp_path):
    """Micro-batches as large as their minibatch (4 rows of a minibatch of 4, in a batch of 8): neither "a
    micro-batch smaller than its minibatch" (the loss rows) nor "more than one micro-batch an optimizer step" (the
    update) is met; the recommended PPO dump (micro-batches of 4 in minibatches of 8) meets both."""
    flags = dict(PPO_RECIPE, num_steps=2, prompts_per_step=8, num_minibatches=2, micro_batch_size=4)
    code, out, _ = run(capsys, make_dump(tmp_path, "ppo", **flags))
    results = rows(out)
    assert code == 0 and "never exercised: " in results["loss"], out
    assert "a micro-batch smaller than its minibatch" in results["loss"], out
    assert "more than one micro-batch an optimizer step" in results["update"], out
    code, out, _ = run(capsys, verify_dumps["ppo"])
    assert code == 0 and "micro-batch" not in out.splitlines()[-1], out


def test_the_whitening_expectations_against_an_independent_computation():
    """unbiased_whiten: torch's own unbiased std over the real positions; floored_whiten: the variance floored."""
    import torch

    from verifier.expect import floored_whiten, unbiased_whiten

    x = torch.tensor([[1.0, 2.0, 4.0], [3.0, 7.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    real = x[mask.bool()]
    unbiased = (x - real.mean()) / real.std(unbiased=True)
    assert torch.allclose(unbiased_whiten(x, mask, 0.0), unbiased * mask, atol=1e-6)
    population = (x - real.mean()) / real.std(unbiased=False)
    assert torch.allclose(floored_whiten(x, mask, 1e-8), population * mask, atol=1e-6)
    flat = torch.tensor([[1.0, 1.0 + 1e-6]])
    assert torch.allclose(floored_whiten(flat, torch.ones(1, 2), 1e-2), (flat - flat.mean()) * 10, atol=1e-9)


@pytest.mark.parametrize(
    "errors, lower, upper",
    [
        ((-1.0, 0.07), True, False),
        ((0.07, 0.85), False, True),
        ((-1.0, 0.07, 0.85), True, True),
        ((0.1,), False, False),
    ],
)
def test_each_clip_of_the_controller_is_exercised_on_its_own_side(errors, lower, upper):
    """A dump whose KL errors reach only the lower clip (-1) must not count the upper one as exercised: a wrong upper
    clip shows only past +0.2, so the PASS line names it as never exercised there; and the reverse."""
    from verifier.conditions import controller_conditions
    from verifier.report import Report

    report = Report({}, "ppo")
    for error in errors:
        controller_conditions(report, error)
    met = report.rows["kl_coef"]["conditions"]
    assert met["a KL error below -0.2 (the controller's lower clip)"] is lower
    assert met["a KL error above +0.2 (the controller's upper clip)"] is upper
    assert met["a KL error within +-0.2 of the target (not clipped)"] is any(abs(e) < 0.2 for e in errors)
