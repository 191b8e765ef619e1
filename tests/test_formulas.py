"""The reference formulas (common.py, grpo.py, ppo.py) against hand-worked numbers or slow explicit loops."""

import math

import pytest
import torch

import common
import grpo
import ppo
from machinery import generation

# ---------------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------------


def test_kl_estimate_matches_hand_formulas():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref_logp = torch.tensor([-1.5, -1.0, -0.5])
    log_r = [-0.5, 1.0, 0.0]  # ref_logp - logp
    k1 = [0.5, -1.0, 0.0]
    k2 = [0.125, 0.5, 0.0]
    k3 = [math.exp(x) - 1 - x for x in log_r]  # [0.10653, 0.71828, 0]
    torch.testing.assert_close(ppo.kl_estimate(logp, ref_logp, "k1"), torch.tensor(k1))
    torch.testing.assert_close(ppo.kl_estimate(logp, ref_logp, "k2"), torch.tensor(k2))
    torch.testing.assert_close(ppo.kl_estimate(logp, ref_logp, "k3"), torch.tensor(k3))
    with pytest.raises(ValueError, match="kind must be 'k1', 'k2' or 'k3', not 'k4'"):
        ppo.kl_estimate(logp, ref_logp, "k4")


def test_k2_and_k3_are_never_negative():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(10_000, generator=g) * 5
    ref_logp = torch.randn(10_000, generator=g) * 5
    assert (ppo.kl_estimate(logp, ref_logp, "k2") >= 0).all()
    assert (ppo.kl_estimate(logp, ref_logp, "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    """Tokens sampled from p: the means of k1 and k3 approach the exact KL(p || q); k1 is negative on some tokens."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.2, 0.3, 0.2, 0.2, 0.1])
    pairs = list(zip(p.tolist(), q.tolist()))
    exact = sum(pi * math.log(pi / qi) for pi, qi in pairs)  # 0.2299
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, ref_logp = p.log()[tokens], q.log()[tokens]
    k1 = ppo.kl_estimate(logp, ref_logp, "k1")
    k3 = ppo.kl_estimate(logp, ref_logp, "k3")
    for k in (k1, k3):
        std_error = (k.std() / math.sqrt(len(k))).item()  # about 0.002 for k1, 0.0006 for k3
        assert abs(k.mean().item() - exact) < 5 * std_error
    assert (k1 < 0).any()  # per token k1 can be negative (q > p there); only its mean is the KL
    # k2 is biased: its mean is E_p[(log q/p)^2 / 2] = 0.2686 here, far from the KL by many standard errors.
    k2 = ppo.kl_estimate(logp, ref_logp, "k2")
    k2_expectation = sum(pi * 0.5 * math.log(qi / pi) ** 2 for pi, qi in pairs)
    std_error = (k2.std() / math.sqrt(len(k2))).item()
    assert abs(k2.mean().item() - k2_expectation) < 5 * std_error
    assert abs(k2.mean().item() - exact) > 20 * std_error


# ---------------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------------


@pytest.mark.exact
def test_masked_mean_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert common.masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    torch.testing.assert_close(common.masked_mean(x, mask, dim=1), torch.tensor([2.0, 4.0, 0.0]))  # empty row -> 0
    assert common.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def slow_whiten(x, mask, shift_mean, eps=1e-8):
    real = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(real) / len(real)
    var = sum((v - mean) ** 2 for v in real) / len(real)
    out = [
        ((v - mean) / math.sqrt(var + eps) + (0 if shift_mean else mean)) if m else 0.0
        for v, m in zip(x.flatten().tolist(), mask.flatten().tolist())
    ]
    return torch.tensor(out).view(x.shape)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_a_loop_over_real_positions(shift_mean):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3 + 2
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0]])
    torch.testing.assert_close(common.masked_whiten(x, mask, shift_mean=shift_mean), slow_whiten(x, mask, shift_mean))
    # Whatever sits at masked positions does not change the result.
    noisy = torch.where(mask.bool(), x, torch.full_like(x, 1e6))
    torch.testing.assert_close(
        common.masked_whiten(noisy, mask, shift_mean=shift_mean), slow_whiten(x, mask, shift_mean)
    )


def test_masked_whiten_without_shift_keeps_the_mean():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=g) * 4 + 7
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    out = common.masked_whiten(x, mask, shift_mean=False)
    assert common.masked_mean(out, mask).item() == pytest.approx(common.masked_mean(x, mask).item(), abs=1e-5)
    centred = common.masked_whiten(x, mask)
    assert common.masked_mean(centred, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert common.masked_mean(centred**2, mask).item() == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# Clipped surrogate, clip fraction, approx KL
# ---------------------------------------------------------------------------------------------------


def slow_clipped_loss(logratio, advantages, clip_low, clip_high):
    out = []
    for lr, a in zip(logratio.tolist(), advantages.tolist()):
        ratio = math.exp(lr)
        clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
        out.append(max(-a * ratio, -a * clipped))
    return torch.tensor(out)


def test_clipped_policy_loss_hand_values():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0])
    # clip_low 0.2, clip_high 0.28: the ratio is clipped to [0.8, 1.28].
    #   A=+1, r=1.5: max(-1.5, -1.28) = -1.28  (clipped: no gain beyond 1 + clip_high)
    #   A=-1, r=0.5: max( 0.5,  0.80) =  0.80  (clipped: no gain beyond 1 - clip_low)
    #   A=-1, r=1.5: max( 1.5,  1.28) =  1.50  (unclipped: the pessimistic term)
    #   A=+1, r=0.5: max(-0.5, -0.80) = -0.50  (unclipped)
    #   A=+2, r=1.1: inside the range: -2.2
    expected = torch.tensor([-1.28, 0.8, 1.5, -0.5, -2.2])
    torch.testing.assert_close(grpo.clipped_policy_loss(ratio.log(), adv, 0.2, 0.28), expected)


@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_clipped_policy_loss_matches_a_loop(clip_low, clip_high):
    g = torch.Generator().manual_seed(0)
    logratio = torch.randn(500, generator=g) * 0.5
    adv = torch.randn(500, generator=g)
    expected = slow_clipped_loss(logratio, adv, clip_low, clip_high)
    torch.testing.assert_close(grpo.clipped_policy_loss(logratio, adv, clip_low, clip_high), expected)


def test_clip_fraction_and_approx_kl_hand_values():
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5], [0.7, 1.3, 1.0, 0.1]])
    adv = torch.tensor([[1.0], [-1.0]])  # one advantage per row, broadcast over tokens
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    # clip_low 0.2, clip_high 0.28. Clipped: row 0 A>0 and r > 1.28 -> tokens 0 and 2;
    # row 1 A<0 and r < 0.8 -> token 0 (token 3 is masked). 3 of 7 real tokens.
    frac = common.clip_fraction(ratio.log(), adv, 0.2, 0.28, mask)
    assert frac.item() == pytest.approx(3 / 7)
    # approx_kl = mean over real tokens of (r - 1) - log r.
    real = [1.5, 0.5, 1.5, 0.5, 0.7, 1.3, 1.0]
    expected = sum(r - 1 - math.log(r) for r in real) / 7
    assert common.approx_kl(ratio.log(), mask).item() == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [70.0, 80.0, 90.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # lengths 3, 1, 0; 4 real tokens; max_new_tokens 4
HAND = {
    "seq-mean-token-mean": (2.0 + 4.0 + 0.0) / 3,  # each sequence's mean, then the mean over 3 sequences
    "token-mean": (1 + 2 + 3 + 4) / 4,  # every real token weighs the same
    "seq-mean-token-sum-norm": (1 + 2 + 3 + 4) / (3 * 4),  # sum / (sequences * max_new_tokens)
}


@pytest.mark.parametrize("agg", grpo.LOSS_AGGREGATIONS)
def test_aggregate_loss_hand_values(agg):
    assert grpo.aggregate_loss(LOSS, MASK, agg, 3, 4, 4).item() == pytest.approx(HAND[agg])
    # With the whole-batch totals, the shares of two micro-batches add up to the same number.
    first = grpo.aggregate_loss(LOSS[:1], MASK[:1], agg, 3, 4, 4)
    rest = grpo.aggregate_loss(LOSS[1:], MASK[1:], agg, 3, 4, 4)
    assert (first + rest).item() == pytest.approx(HAND[agg])


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match=r"agg must be one of .*seq-mean-token-mean.*, not 'mean'"):
        grpo.aggregate_loss(LOSS, MASK, "mean", 3, 4, 4)


# ---------------------------------------------------------------------------------------------------
# Masks and positions
# ---------------------------------------------------------------------------------------------------


@pytest.mark.exact
def test_mask_after_eos():
    EOS = 1
    ids = torch.tensor(
        [
            [5, 6, EOS, 7, 8],  # cut after the first EOS, inclusive
            [5, 6, 7, 8, 9],  # no EOS: keep every token
            [EOS, 5, 5, 5, 5],  # EOS first: keep only it
            [5, 6, 7, 8, EOS],  # EOS last
        ]
    )
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(generation.mask_after_eos(ids, [EOS]), expected)


@pytest.mark.exact
def test_mask_after_eos_with_several_eos_ids():
    ids = torch.tensor([[5, 2, 6, 1, 7], [5, 6, 1, 2, 7], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(generation.mask_after_eos(ids, [1, 2]), expected)


@pytest.mark.exact
def test_mask_after_eos_when_pad_is_eos():
    """Generation fills finished rows with the pad id; when pad == EOS only the first one is real."""
    EOS = PAD = 1
    ids = torch.tensor([[5, 6, EOS, PAD, PAD], [5, EOS, PAD, PAD, PAD], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(generation.mask_after_eos(ids, [EOS]), expected)


@pytest.mark.exact
def test_position_ids_from_mask_with_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(common.position_ids_from_mask(mask), expected)
