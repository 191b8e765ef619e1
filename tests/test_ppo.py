"""ppo.py's formulas against hand-worked values and separately written loops."""

import os

import pytest
import torch
from safetensors.torch import load_file

import common
import ppo
from machinery import generation, models, scoring
from machinery.tiny_model import TINY_MODEL


def gae_by_loops(rewards, values, lengths, gamma, lam):
    """GAE written out per sequence over its real tokens only, the way the paper states it."""
    advantages = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        for t in range(n):
            total = 0.0
            for k in range(t, n):
                next_value = values[b, k + 1].item() if k + 1 < n else 0.0
                delta = rewards[b, k].item() + gamma * next_value - values[b, k].item()
                total += (gamma * lam) ** (k - t) * delta
            advantages[b, t] = total
    mask = (torch.arange(rewards.shape[1])[None, :] < torch.tensor(lengths)[:, None]).float()
    return advantages, (advantages + values) * mask


def test_gae_hand_worked_gamma_one():
    # One sequence of 3 tokens, score 1 at the end, values 0.5, 0.25, 0.75; gamma 1, lam 0.95.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    mask = torch.ones(1, 3)
    # deltas: 0 + 0.25 - 0.5 = -0.25; 0 + 0.75 - 0.25 = 0.5; 1 + 0 - 0.75 = 0.25
    # A2 = 0.25; A1 = 0.5 + 0.95 * 0.25 = 0.7375; A0 = -0.25 + 0.95 * 0.7375 = 0.450625
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.450625, 0.7375, 0.25]]))
    torch.testing.assert_close(returns, torch.tensor([[0.950625, 0.9875, 1.0]]))


def test_gae_lam_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.3, 0.6, 0.2]])
    advantages, returns = ppo.compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.9, 0.8, 1.0]]))  # undiscounted reward-to-go
    torch.testing.assert_close(advantages, returns - values)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.95), (0.99, 0.0), (0.5, 1.0)])
def test_gae_matches_loops_with_ragged_lengths(gamma, lam):
    torch.manual_seed(0)
    lengths = [5, 2, 4, 1]
    rewards, values = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = rewards * mask
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = gae_by_loops(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)


def test_gae_never_bootstraps_from_padding():
    """Garbage values and rewards after the end must not change anything before it."""
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    clean = ppo.compute_gae(rewards, torch.tensor([[0.2, 0.4, 0.0, 0.0]]), mask, 1.0, 0.95)
    dirty = ppo.compute_gae(rewards, torch.tensor([[0.2, 0.4, 99.0, -99.0]]), mask, 1.0, 0.95)
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b)
    assert (clean[0][:, 2:] == 0).all() and (clean[1][:, 2:] == 0).all()


@pytest.mark.parametrize(
    "mask, position",
    [
        ([1, 1, 1, 0, 0], 2),  # right padding: a completion that ended with EOS at position 2
        ([1, 1, 1, 1, 1], 4),  # no EOS: the last generated token
        ([0, 0, 1, 1, 0], 3),  # left and right padding
        ([1, 0, 0, 0, 0], 0),  # an immediate EOS
    ],
)
def test_score_lands_on_last_real_token(mask, position):
    placed = scoring.score_at_last_token(torch.tensor([2.5]), torch.tensor([mask]))
    expected = torch.zeros(1, 5)
    expected[0, position] = 2.5
    torch.testing.assert_close(placed, expected)


def test_score_lands_on_first_eos_when_pad_equals_eos():
    """pad = EOS: the completion's mask from mask_after_eos ends at the first EOS, and so does the score."""
    eos = 1
    completion_ids = torch.tensor([[5, 6, eos, eos, eos], [5, eos, eos, eos, eos], [5, 6, 7, 8, 9]])
    mask = generation.mask_after_eos(completion_ids, [eos])
    placed = scoring.score_at_last_token(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert placed.nonzero().tolist() == [[0, 2], [1, 1], [2, 4]]
    assert placed.sum().item() == 6.0


def test_clipped_value_loss_hand_values():
    old = torch.tensor([0.0, 0.0, 0.0, 1.0])
    new = torch.tensor([0.5, 0.1, -0.5, 1.0])
    returns = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # c = 0.2: clipped values 0.2, 0.1, -0.2, 1.0
    # unclipped errors 0.25, 0.81, 2.25, 1.0; clipped errors 0.64, 0.81, 1.44, 1.0 -> max, halved
    loss = ppo.clipped_value_loss(new, old, returns, 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.405, 1.125, 0.5]))


@pytest.mark.exact
def test_value_clipping_stops_the_gradient_beyond_the_range():
    """A value that already moved past the clip range towards its target gets no more gradient (the clipped
    term is the larger loss); one that moved away from its target keeps the full gradient (pessimistic max)."""
    towards = torch.tensor([-0.5], requires_grad=True)
    ppo.clipped_value_loss(towards, torch.tensor([0.0]), torch.tensor([-1.0]), 0.2).sum().backward()
    assert towards.grad.item() == 0.0
    away = torch.tensor([0.5], requires_grad=True)
    ppo.clipped_value_loss(away, torch.tensor([0.0]), torch.tensor([-1.0]), 0.2).sum().backward()
    assert away.grad.item() == pytest.approx(1.5)  # d/dv 0.5 * (v + 1)^2 at v = 0.5


def test_kl_penalty_is_per_token_and_zero_when_policy_equals_reference():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    for kind in ("k1", "k2", "k3"):
        assert (ppo.kl_estimate(logp, logp, kind) == 0).all()
    ref = torch.log(torch.tensor([[0.25, 0.2, 0.45]]))
    kl = ppo.kl_estimate(logp, ref, "k1")
    assert kl.shape == (1, 3)
    torch.testing.assert_close(
        kl, torch.tensor([[torch.log(torch.tensor(2.0)).item(), 0.0, torch.log(torch.tensor(2.0)).item()]])
    )


def test_whitening_ignores_masked_positions():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    real = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    expected = (real - real.mean()) / torch.sqrt(real.var(unbiased=False) + 1e-8)
    out = common.masked_whiten(x, mask)
    torch.testing.assert_close(out[mask.bool()], expected)
    assert (out[~mask.bool()] == 0).all()


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert common.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert common.explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)


def test_adaptive_kl_coef_moves_towards_target():
    assert ppo.adaptive_kl_coef(0.1, kl=12.0, target_kl=6.0, n_completions=100, horizon=10000) == pytest.approx(
        0.1 * (1 + 0.2 * 0.01)
    )
    assert ppo.adaptive_kl_coef(0.1, kl=3.0, target_kl=6.0, n_completions=100, horizon=10000) == pytest.approx(
        0.1 * (1 - 0.2 * 0.01)
    )
    assert ppo.adaptive_kl_coef(0.1, kl=6.0, target_kl=6.0, n_completions=100, horizon=10000) == pytest.approx(0.1)


@pytest.mark.exact
def test_critic_starts_from_policy_weights(tmp_path):
    policy = models.load_causal_lm(TINY_MODEL, torch.device("cpu"))
    critic = ppo.load_critic(TINY_MODEL, torch.device("cpu"))
    backbone = dict(policy.get_decoder().named_parameters())
    critic_backbone = dict(critic.backbone.named_parameters())
    assert backbone.keys() == critic_backbone.keys()
    for name, param in backbone.items():
        assert torch.equal(param, critic_backbone[name]), name
        assert param.data_ptr() != critic_backbone[name].data_ptr()  # its own copy, not shared
    assert critic.value_head.weight.shape == (1, policy.config.hidden_size)


@pytest.mark.exact
def test_the_value_head_starts_at_zero():
    """lm-human-preferences zero-initialises the value head: every value of a fresh critic is 0, whatever the input."""
    critic = ppo.load_critic(TINY_MODEL, torch.device("cpu"))
    assert torch.equal(critic.value_head.weight, torch.zeros_like(critic.value_head.weight))
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 1], [4, 9, 10, 11, 12, 13]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        values = ppo.token_values(critic, input_ids, attention_mask, torch.ones(2, 3, dtype=torch.long))
    assert torch.equal(values, torch.zeros(2, 3))


def test_token_values_align_with_token_logprobs():
    """V(s_t) is read at the position that predicts token t, like the log-prob of token t."""
    critic = ppo.load_critic(TINY_MODEL, torch.device("cpu")).eval()
    torch.nn.init.normal_(critic.value_head.weight)  # a zero head would give 0 everywhere and prove nothing
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 1]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1]])
    with torch.no_grad():
        values = ppo.token_values(critic, input_ids, attention_mask, completion_mask)
        all_values = critic(input_ids, attention_mask)
    torch.testing.assert_close(values, all_values[:, 3:5])


@pytest.mark.slow
def test_ppo_end_to_end_score_rises(tmp_path):
    scores = ppo.main(ppo.Args(seed=1, num_steps=150, output_dir=str(tmp_path), sample_every=0))
    first, last = sum(scores[:15]) / 15, sum(scores[-15:]) / 15
    assert last > first + 0.2, (first, last)


@pytest.mark.exact
def test_the_kl_controller_is_fed_the_summed_k1_whatever_the_estimator(tmp_path):
    """With --kl-estimator k2 the penalty uses k2, but --target-kl names the KL itself: the controller gets k1's sum.

    Step 2's batch does not depend on the target (step 1's KL is 0, so its update is the same), so a first run
    finds the sums of k1 and k2 at step 2 and the second sets the target between them: the two would move the
    coefficient in opposite directions."""

    def run(target_kl, num_steps, name):
        ppo.main(
            ppo.Args(
                num_steps=num_steps,
                prompts_per_step=16,
                kl_coef=0.1,
                kl_estimator="k2",
                target_kl=target_kl,
                kl_horizon=16,
                learning_rate=1e-2,
                sample_every=0,
                output_dir=str(tmp_path / name / "r"),
                dump_dir=str(tmp_path / name / "dump"),
            )
        )
        return [load_file(tmp_path / name / "dump" / f"step{k:06d}.safetensors") for k in range(1, num_steps + 1)]

    step2 = run(1.0, 2, "probe")[1]
    log_r = (step2["ref_logp"] - step2["old_logp"]) * step2["completion_mask"]
    k1, k2 = (-log_r).sum(1).mean().item(), (0.5 * log_r**2).sum(1).mean().item()
    target = (k1 + k2) / 2
    assert abs(k1 - k2) > 0.05 * target, (k1, k2)  # far enough apart for the clip at +-0.2 not to hide it
    _, again, step3 = run(target, 3, "run")
    assert torch.equal(again["old_logp"], step2["old_logp"])
    expected = ppo.adaptive_kl_coef(step2["kl_coef"].item(), k1, target, 16, 16)
    assert step3["kl_coef"].item() == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(ppo.adaptive_kl_coef(step2["kl_coef"].item(), k2, target, 16, 16), rel=1e-3)


def test_the_entropy_bonus_is_in_the_loss_and_its_gradient():
    """loss_t gains -ent_coef * H_t on real tokens, so d loss / d H_t = -ent_coef / the minibatch's real tokens."""
    g = torch.Generator().manual_seed(0)
    n, T = 3, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).float()
    new_logp, entropy = torch.randn(n, T, generator=g).requires_grad_(), torch.rand(n, T, generator=g).requires_grad_()
    rest = [torch.randn(n, T, generator=g) for _ in range(5)]  # old_logp, advantages, new_values, old_values, returns
    args = ppo.Args(clip_low=0.2, clip_high=0.2, cliprange_value=0.2, vf_coef=0.1, ent_coef=0.0)  # the real flags
    loss0, terms0 = ppo.ppo_loss(new_logp, rest[0], rest[1], rest[2], rest[3], rest[4], mask, 10, args, entropy)
    args.ent_coef = 0.3
    loss, terms = ppo.ppo_loss(new_logp, rest[0], rest[1], rest[2], rest[3], rest[4], mask, 10, args, entropy)
    torch.testing.assert_close(terms["per_token_loss"], terms0["per_token_loss"] - 0.3 * entropy.detach() * mask)
    (grad,) = torch.autograd.grad(loss, entropy)
    torch.testing.assert_close(grad, -0.3 / 10 * mask)


@pytest.mark.parametrize("ent_coef", [0.0, 0.1])
def test_the_loop_gives_the_loss_a_differentiable_entropy_only_when_it_is_used(tmp_path, monkeypatch, ent_coef):
    seen, ppo_loss = [], ppo.ppo_loss
    monkeypatch.setattr(ppo, "ppo_loss", lambda *a: seen.append(a[-1].requires_grad) or ppo_loss(*a))
    ppo.main(ppo.Args(num_steps=1, prompts_per_step=8, ent_coef=ent_coef, sample_every=0, output_dir=str(tmp_path)))
    assert seen and set(seen) == {ent_coef > 0}


def test_each_models_gradient_is_clipped_to_max_grad_norm(monkeypatch, tmp_path):
    """Before every optimizer step, the policy's and the critic's gradients each have a norm of at most
    --max-grad-norm (AdamW is nearly scale-free, so a missing clip barely shows in the weights: read the gradients)."""
    norms = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        norms.append(
            [
                torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in group["params"] if p.grad is not None])
                ).item()
                for group in self.param_groups
            ]
        )
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    ppo.main(
        ppo.Args(num_steps=1, prompts_per_step=8, max_grad_norm=1e-3, sample_every=0, output_dir=str(tmp_path / "runs"))
    )
    assert len(norms) == 4 and all(len(groups) == 2 for groups in norms)  # 2 epochs x 2 minibatches; policy, critic
    assert all(norm <= 1e-3 * (1 + 1e-4) for groups in norms for norm in groups), norms
    assert max(max(groups) for groups in norms) > 0.5e-3  # the clip acted: the raw gradients were larger


@pytest.mark.parametrize("clip_low, clip_high", [(0.3, 0.1), (0.1, 0.3)])
def test_ppo_loss_clipped_terms_under_asymmetric_bounds(clip_low, clip_high):
    """ppo_loss's `clipped` is where the surrogate's gradient is 0 (bounds that differ, one way and the other), and
    `value_clipped` where the new value moved more than --cliprange-value (0.25, not the default) from the
    rollout's value: measured from the returns instead, every token here would say otherwise."""
    ratios = torch.tensor([0.6, 0.75, 0.85, 0.95, 1.05, 1.15, 1.25, 1.4])
    old_logp = torch.full((2, 8), -1.0)
    new_logp = (old_logp + ratios.log()).requires_grad_()
    advantages = torch.tensor([[1.0], [-1.0]]).expand(2, 8)
    old_values = torch.zeros(2, 8)
    moved = torch.tensor([[0.3, -0.3, 0.1, -0.1, 0.5, -0.5, 0.2, -0.2]] * 2)  # new - old: past 0.25 at 0, 1, 4, 5
    new_values = (old_values + moved).requires_grad_()
    # The returns on the moved values, 0.4 off the others: measured from them, every token would say the opposite.
    returns = new_values.detach() + torch.tensor([[0.0, 0.0, 0.4, -0.4, 0.0, 0.0, 0.4, -0.4]] * 2)
    mask = torch.ones(2, 8)
    args = ppo.Args(clip_low=clip_low, clip_high=clip_high, cliprange_value=0.25, vf_coef=0.1, ent_coef=0.0)
    loss, terms = ppo.ppo_loss(
        new_logp, old_logp, advantages, new_values, old_values, returns, mask, 16, args, torch.zeros(2, 8)
    )
    loss.backward()
    assert terms["clipped"].tolist() == (new_logp.grad == 0).tolist()
    assert terms["clipped"].tolist() == [[r > 1 + clip_high for r in ratios], [r < 1 - clip_low for r in ratios]]
    expected = [[True, True, False, False, True, True, False, False]] * 2
    assert terms["value_clipped"].tolist() == expected
    assert ((new_values - returns).abs() > 0.25).tolist() == [[not x for x in row] for row in expected]
    logged = common.logged_losses([[terms]])
    assert logged["clipfrac_value"] == pytest.approx(0.5) and logged["clipfrac"] == pytest.approx(4 / 16)


# ---------------------------------------------------------------------------------------------------
# A fork's own state and loss terms (issue 52): measured once and carried by the checkpoint; logged by name.
# ---------------------------------------------------------------------------------------------------


def test_a_forks_setup_state_is_measured_once_carried_on_resume_and_its_loss_terms_logged(tmp_path, monkeypatch):
    """A fork that measures a gain once (setup_state) and adds a loss term with a count of the tokens it hit: the
    gain reaches every compute_loss batch and the dump, a resumed run gets it from the checkpoint without measuring
    again, and both new terms reach TensorBoard under losses/ with their values (token mean; summed count)."""
    import glob

    from safetensors.torch import load_file
    from test_loop_wiring import logged_scalars

    measured, seen, hits = [], [], {}
    plain_loss = ppo.compute_loss

    def setup_state(sample, models, args):
        assert set(models) == {"policy", "critic", "reference"} and sample()["scores"].shape == (8,)
        measured.append(1)
        return {"gain": torch.tensor(0.5 + len(measured))}  # 1.5 at the first measure, 2.5 at a second

    def compute_loss(outputs, batch, args):
        seen.append(float(batch["gain"]))
        loss, terms = plain_loss(outputs, batch, args)
        hit = (terms["pg_loss"] > 0) & batch["completion_mask"].bool()  # [n, T]
        bonus = batch["gain"] * hit.float()
        terms.update(bonus=bonus, bonus_tokens=hit.sum())
        hits.setdefault(len(hits), (bonus, batch["completion_mask"], hit.sum()))
        return loss, terms

    monkeypatch.setattr(ppo, "setup_state", setup_state)
    monkeypatch.setattr(ppo, "compute_loss", compute_loss)
    flags = dict(seed=1, prompts_per_step=8, num_minibatches=1, update_epochs=1, sample_every=0)
    ppo.main(ppo.Args(**flags, num_steps=1, save_every=1, output_dir=str(tmp_path / "runs")))
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    bonus, mask, count = hits[0]
    scalars = logged_scalars(run_dir)
    assert scalars["losses/bonus"][1] == pytest.approx(float((bonus * mask).sum() / mask.sum()), rel=1e-6)
    assert scalars["losses/bonus_tokens"][1] == float(count) and "losses/policy_loss" in scalars
    assert measured == [1] and set(seen) == {1.5}
    dumps_dir = tmp_path / "dumps"
    ppo.main(
        ppo.Args(
            **flags,
            num_steps=2,
            resume=os.path.join(run_dir, "checkpoint"),
            dump_dir=str(dumps_dir),
            output_dir=str(tmp_path / "runs2"),
        )
    )
    assert measured == [1] and set(seen) == {1.5}  # not measured again: the checkpoint's value
    assert float(load_file(str(dumps_dir / "step000002.safetensors"))["gain"]) == 1.5


def test_a_setup_state_name_the_batch_uses_is_refused_in_one_line():
    from machinery import batches
    from machinery.errors import UsageError

    sampled = dict(completion_mask=torch.ones(2, 3), scores=torch.ones(2), margin=torch.ones(2))
    assert batches.batch_inputs(sampled, {"gain": torch.tensor(2.0)})["gain"] == 2.0
    for name in ("kl_coef", "margin", "advantages"):  # a batch name, an example's field, a computed one
        with pytest.raises(UsageError, match=f"setup_state's '{name}' is a name the batch uses for its own: rename it"):
            batches.batch_inputs(sampled, {name: torch.tensor(2.0)})
