"""grpo.py: the group advantage, when the reference model is loaded, and that training improves the reward."""

import math
import statistics
import types

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
from machinery import models


def slow_group_advantages(rewards, group_size, scale, eps=1e-4):
    rewards = rewards.tolist()
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    out = []
    for group in groups:
        mean = sum(group) / len(group)
        if scale == "group":
            std = statistics.stdev(group)  # sample std (n - 1), as torch.std
        elif scale == "batch":
            std = statistics.stdev(rewards)
        else:
            std, eps = 1.0, 0.0
        out += [(r - mean) / (std + eps) for r in group]
    return torch.tensor(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_a_loop(scale):
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 1.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.2, 0.8])  # 3 groups of 4
    expected = slow_group_advantages(rewards, 4, scale)
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, scale), expected)


def test_group_advantages_hand_values():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])  # mean 0.75, sample std 0.5
    advantages = grpo.group_advantages(rewards, 4, "group")
    torch.testing.assert_close(advantages, torch.tensor([-0.75, 0.25, 0.25, 0.25]) / (0.5 + 1e-4))


@pytest.mark.exact
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gets_exactly_zero_advantage(scale):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0, 0.5])
    advantages = grpo.group_advantages(rewards, 3, scale)
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert torch.isfinite(advantages).all()
    all_equal = grpo.group_advantages(torch.full((6,), 0.4), 3, scale)  # even the batch std is 0
    assert torch.equal(all_equal, torch.zeros(6))


def quick_args(tmp_path, **overrides):
    args = dict(
        seed=1,
        num_steps=2,
        prompts_per_step=2,
        group_size=3,
        max_new_tokens=4,
        sample_every=0,
        output_dir=str(tmp_path),
    )
    args.update(overrides)
    return grpo.Args(**args)


@pytest.mark.parametrize("beta, loads", [(0.0, 1), (0.1, 2)])
def test_reference_model_is_loaded_only_when_beta_is_positive(tmp_path, monkeypatch, beta, loads):
    calls = []
    load = models.load_pretrained  # every model load goes through it (load_causal_lm calls it)
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: calls.append(a) or load(*a, **k))
    rewards = grpo.main(quick_args(tmp_path, beta=beta))
    assert len(calls) == loads
    assert len(rewards) == 2


def test_variants_run(tmp_path):
    """GSPO ratios, several iterations per batch (old log-probs), micro-batches (4 + 2) and the KL term, all at once.

    The run returns each step's mean reward (that of the dumped rewards); the dumped second iteration trains
    a policy the first one moved (new log-probs differ from the old ones); and GSPO's surrogate is one number
    per completion, the clipped -A * exp(mean log-ratio), on every real token. Guards a history that is not
    the rewards, an old policy that moves with the new one, and a token-level ratio under --importance-level
    sequence. (test_reference_step.py checks every number of such runs against an independent reference.)
    """
    beta = 0.1
    args = quick_args(
        tmp_path,
        beta=beta,
        bias_corrected_kl=False,
        num_iterations=2,
        importance_level="sequence",
        micro_batch_size=4,
        loss_agg="token-mean",
        scale_rewards="batch",
        clip_high=0.28,
        learning_rate=1e-2,
        dump_dir=str(tmp_path / "dump"),
    )
    rewards = grpo.main(args)
    assert len(rewards) == 2
    for step, reward in zip((1, 2), rewards):
        d = load_file(str(tmp_path / "dump" / f"step{step:06d}.safetensors"))
        assert reward == pytest.approx(d["rewards"].mean().item(), abs=1e-6)
        mask = d["completion_mask"].bool()
        new, old, ref, adv = d["new_logp"], d["old_logp"], d["ref_logp"], d["advantages"]
        assert (new - old)[mask].abs().max() > 1e-4
        log_r = ref - new
        surrogate = d["per_token_loss"] - beta * (log_r.exp() - 1 - log_r) * mask
        for row in range(len(mask)):
            real = mask[row]
            ratio = math.exp(sum((new[row] - old[row])[real].tolist()) / int(real.sum()))
            a = adv[row].item()
            expected = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
            torch.testing.assert_close(
                surrogate[row][real], torch.full((int(real.sum()),), expected), rtol=0, atol=1e-5
            )


@pytest.mark.slow
def test_training_improves_reward(tmp_path):
    # The default run's settings, 200 of its 600 steps. Measured over seeds 1-10: first 10% 0.039-0.050 ->
    # last 10% 0.61-0.92 (seed 1: 0.045 -> 0.606); ~40 s on one core.
    # The settings are pinned, not the defaults, so retuned defaults cannot void the measured margin.
    num_steps = 200
    args = grpo.Args(
        seed=1,
        num_steps=num_steps,
        prompts_per_step=16,
        group_size=8,
        max_new_tokens=5,
        learning_rate=5e-4,
        beta=0.08,
        bias_corrected_kl=True,
        scale_rewards="batch",
        micro_batch_size=128,
        output_dir=str(tmp_path),
        sample_every=0,
    )
    rewards = grpo.main(args)
    assert len(rewards) == num_steps
    n = num_steps // 10
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    assert last > first + 0.4, f"reward first 10% {first:.3f} -> last 10% {last:.3f}"


@pytest.mark.parametrize("importance_level", ["token", "sequence"])
def test_the_bias_corrected_kl_gradient_is_unbiased_with_token_ratios_only(importance_level):
    """Exact expectations over every completion of a 2-token, 3-word policy whose positions are independent:
    E_old[grad of grpo_loss's k3 * ratio] is grad KL(policy || ref) with one ratio per token; with GSPO's sequence
    ratio on every token the score-function part of it is divided by the length, so it is not."""
    import itertools

    theta = torch.tensor([[0.3, -1.0, 0.5], [1.2, 0.0, -0.4]], requires_grad=True)  # [T, V] logits
    ref = torch.log_softmax(torch.tensor([[0.0, 0.5, -0.5], [-1.0, 0.2, 0.9]]), -1)
    args = grpo.Args(  # the real flags, their defaults but for these: a new field of a fork is there too
        importance_level=importance_level,
        bias_corrected_kl=True,
        beta=1.0,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="seq-mean-token-sum-norm",
        max_new_tokens=1,
    )
    logp = torch.log_softmax(theta, -1)
    expected = 0.0
    for y in itertools.product(range(3), repeat=2):
        new = logp[[0, 1], list(y)][None]  # [1, T]
        loss, _ = grpo.grpo_loss(
            new, new.detach(), ref[[0, 1], list(y)][None], torch.zeros(1), torch.ones(1, 2), 1, 2, args
        )
        expected = expected + new.detach().sum().exp() * loss  # weighted by the old policy's probability
    (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    if importance_level == "token":
        torch.testing.assert_close(grad, kl_grad)
    else:
        assert (grad - kl_grad).abs().max() > 0.01


def clip_case():
    """A micro-batch whose ratios leave the clip range both ways: row 0 (A > 0) at 1.5, 0.5; row 1 (A < 0) the
    same, the last token of each padding."""
    logratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]]).log()
    new_logp = torch.full((2, 3), -1.0)
    return new_logp + logratio, new_logp, torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_clipfrac_is_what_the_loss_says_it_clipped():
    """losses/clipfrac reads the loss's own `clipped` term: grpo_loss's is the PPO clip (row 0's 1.5 and row 1's
    0.5: 2 of 4 real tokens); a variant that keeps every gradient (CISPO) and says so logs 0, one without the term
    logs no clipfrac at all."""
    new_logp, old_logp, advantages, mask = clip_case()
    args = grpo.Args(beta=0.0)
    _, terms = grpo.grpo_loss(new_logp, old_logp, None, advantages, mask, 2, 4, args)
    assert terms["clipped"].tolist() == [[True, False, False], [False, True, False]]
    update = dict(terms, entropy=torch.zeros(2, 3))
    assert common.logged_losses([[update]])["clipfrac"] == pytest.approx(0.5)
    kept = dict(update, clipped=torch.zeros(2, 3, dtype=torch.bool))  # what a CISPO loss returns: nothing cut off
    assert common.logged_losses([[kept]])["clipfrac"] == 0.0
    assert "clipfrac" not in common.logged_losses([[{k: v for k, v in update.items() if k != "clipped"}]])


RATIOS = [0.6, 0.75, 0.85, 0.95, 1.05, 1.15, 1.25, 1.4]  # either side of 1 -+ 0.1 and 1 -+ 0.3, none on a bound


def asymmetric_clip_case():
    """Rows of RATIOS with A = +1 and A = -1, each with one token of padding: (new_logp, old_logp, advantages,
    mask), new_logp a leaf that takes a gradient."""
    old_logp = torch.full((2, len(RATIOS) + 1), -1.0)
    logratio = torch.tensor([*RATIOS, 1.0]).log().expand(2, -1)
    mask = torch.ones(2, len(RATIOS) + 1)
    mask[:, -1] = 0
    return (old_logp + logratio).requires_grad_(), old_logp, torch.tensor([1.0, -1.0]), mask


@pytest.mark.parametrize("clip_low, clip_high, expected", [(0.3, 0.1, 4), (0.1, 0.3, 4), (0.3, 0.3, 2)])
def test_clipped_is_where_the_clip_cut_the_gradient_under_asymmetric_bounds(clip_low, clip_high, expected):
    """grpo_loss's `clipped` (and so losses/clipfrac) is, token for token, where the surrogate's gradient is 0:
    above 1 + clip_high with A > 0, below 1 - clip_low with A < 0. The bounds differ (--clip-high is DAPO's),
    one way and the other, so a mask given one bound twice, or the two swapped, is told apart."""
    new_logp, old_logp, advantages, mask = asymmetric_clip_case()
    args = grpo.Args(beta=0.0, clip_low=clip_low, clip_high=clip_high)
    loss, terms = grpo.grpo_loss(new_logp, old_logp, None, advantages, mask, 2, int(mask.sum()), args)
    loss.backward()
    real = mask.bool()
    cut = new_logp.grad == 0
    assert terms["clipped"][real].tolist() == cut[real].tolist()
    by_hand = [[r > 1 + clip_high for r in RATIOS], [r < 1 - clip_low for r in RATIOS]]
    assert terms["clipped"][:, :-1].tolist() == by_hand and sum(map(sum, by_hand)) == expected
    update = dict(terms, entropy=torch.zeros_like(mask))
    assert common.logged_losses([[update]])["clipfrac"] == pytest.approx(expected / 16)


def test_verifys_notes_read_what_the_loss_clipped():
    """verify's "exercised" notes on a loss row: a token the loss clipped (its ratio below or above 1), and a ratio
    out of the clip range the loss left alone, from the loss's `clipped` term, not a second PPO-clip test."""
    from verifier.conditions import loss_conditions
    from verifier.report import Report

    new_logp, old_logp, advantages, mask = clip_case()
    batch = dict(completion_mask=mask)
    args = dict(clip_low=0.2, clip_high=0.2, beta=0.0)

    def conditions(clipped):
        terms = dict(logratio=new_logp - old_logp, advantages=advantages[:, None], clipped=clipped)
        report = Report({})
        loss_conditions(report, ["loss"], types.SimpleNamespace(_loss=lambda batch, args: (None, terms)), batch, args)
        return report.rows["loss"]["conditions"]

    ppo_clip = conditions(torch.tensor([[True, False, False], [False, True, False]]))
    assert (
        ppo_clip["a token the loss clipped, its ratio below 1"]
        and ppo_clip["a token the loss clipped, its ratio above 1"]
    )
    assert ppo_clip["a ratio out of the clip range that the loss did not clip"]  # row 0's 0.5 with A > 0
    cispo = conditions(torch.zeros(2, 3, dtype=torch.bool))
    assert not cispo["a token the loss clipped, its ratio below 1"]
    assert not cispo["a token the loss clipped, its ratio above 1"]


def test_a_forks_new_loss_terms_reach_the_logs_by_their_names(tmp_path, monkeypatch):
    """A fork adding a KL-Cov-like penalty ([n, T]) and the count of tokens it hit (no dimension) in compute_loss
    only: both reach TensorBoard under losses/, the penalty as a token mean over the update's micro-batches and the
    count summed over them, with no edit outside grpo.py."""
    import glob

    from test_loop_wiring import logged_scalars

    plain, seen = grpo.compute_loss, []

    def compute_loss(outputs, batch, args):
        loss, terms = plain(outputs, batch, args)
        mask = batch["completion_mask"]
        hit = (outputs["new_logp"].detach() < -2.5) & mask.bool()  # the tokens the penalty hits
        penalty = 0.1 * hit.float() * outputs["new_logp"].detach() ** 2
        seen.append(((penalty * mask).sum().item(), mask.sum().item(), hit.sum().item()))
        return loss, dict(terms, kl_cov=penalty, kl_cov_tokens=hit.sum())

    monkeypatch.setattr(grpo, "compute_loss", compute_loss)
    flags = dict(seed=1, num_steps=1, prompts_per_step=4, group_size=4, micro_batch_size=5, sample_every=0)
    grpo.main(grpo.Args(**flags, output_dir=str(tmp_path)))
    scalars = logged_scalars(glob.glob(str(tmp_path / "*"))[0])
    assert len(seen) == 4  # 16 completions in micro-batches of 5, 5, 5, 1
    penalty, tokens, hits = (sum(values) for values in zip(*seen))
    assert scalars["losses/kl_cov"][1] == pytest.approx(penalty / tokens, rel=1e-5)
    assert scalars["losses/kl_cov_tokens"][1] == hits and hits > 0
    assert "losses/policy_loss" in scalars and "losses/loss" not in scalars and "losses/mask" not in scalars
