"""What SkyRL and AReaL must give by design where they differ from this project (their known differences, declared
by verifier/adapters/skyrl.py and verifier/adapters/areal.py): each a small pure function of the dump, written from
the formula the peer documents, never by calling the peer. verify.py compares the peer with it at the row's normal
tolerance, so a bug on top of a known difference fails. Where a formula needs what this project computes the same
way (GAE's returns, the policy's clipped surrogate), it asks this project's adapter (verifier/adapters/self.py)."""

import types

import torch

from verifier.expect import ours


def _flags(args, **changes):
    return types.SimpleNamespace(**dict(args, **changes))


# Advantages.


def group_std_advantages(batch, args, eps=1e-6):
    """SkyRL's GRPO: (r - the group's mean) / (the group's unbiased std + eps), eps its default 1e-6, on every
    completion token (SkyRL's advantages are per token)."""
    r = batch["rewards"].double().view(-1, args["group_size"])
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1, 1)
    return (advantages * batch["completion_mask"]).float()


def token_weighted_group_advantages(batch, args):
    """AReaL's GRPO: the statistics over tokens (each completion's score on each of its L_i tokens), the group's
    mean sum L_i r_i / sum L_i, and the group's or the batch's unbiased std (sum L_i (r_i - mean)^2 / (sum L_i - 1))
    plus --adv-eps, or no scaling (--scale-rewards none); on every completion token."""
    mask = batch["completion_mask"].double()
    n = args["group_size"]
    r, L = batch["rewards"].double().view(-1, n), mask.sum(1).view(-1, n)
    mean = (L * r).sum(1, keepdim=True) / L.sum(1, keepdim=True)
    square = L * (r - mean) ** 2
    if args["scale_rewards"] == "group":
        std = (square.sum(1, keepdim=True) / (L.sum(1, keepdim=True) - 1)).sqrt()
        std = torch.ones_like(std) if n == 1 else std  # AReaL's: a group of one has std 1
    elif args["scale_rewards"] == "batch":
        std = (square.sum() / (L.sum() - 1)).sqrt()
    advantages = (r - mean) if args["scale_rewards"] == "none" else (r - mean) / (std + args["adv_eps"])
    return (advantages.reshape(-1, 1) * mask).float()


def _unwhitened(batch, args):
    """GAE's advantages before whitening, returns - values, with this project's returns (which both peers match)."""
    _, returns = ours().gae(batch, args)
    return returns.double() - batch["values"].double(), batch["completion_mask"].double()


def unbiased_whitened(batch, args):
    """SkyRL's masked_whiten: (A - mean) * rsqrt(var * N / (N - 1) + 1e-8) over the N real tokens; the returns."""
    A, m = _unwhitened(batch, args)
    mean = (A * m).sum() / m.sum()
    var = ((A - mean) ** 2 * m).sum() / (m.sum() - 1)
    return ((A - mean) * torch.rsqrt(var + 1e-8) * m).float(), ours().gae(batch, args)[1]


def unbiased_normalized(batch, args):
    """AReaL's Normalization of PPO's advantages: (A - mean) / (the unbiased std + 1e-5) over the real tokens."""
    A, m = _unwhitened(batch, args)
    mean = (A * m).sum() / m.sum()
    std = (((A - mean) ** 2 * m).sum() / (m.sum() - 1)).sqrt()
    return ((A - mean) / (std + 1e-5) * m).float(), ours().gae(batch, args)[1]


def advantages_only(fn):
    return lambda batch, args: fn(batch, args)[0]


def returns_only(fn):
    return lambda batch, args: fn(batch, args)[1]


# The KL controller.


def kl_coef_fed_token_means(batch, args):
    """SkyRL's trainer: AdaptiveKLController fed the mean over the N completions of each one's per-token mean KL
    (its --kl-estimator), n_steps N: coef * (1 + clip(kl / target - 1, -0.2, 0.2) * N / horizon)."""
    m = batch["completion_mask"].double()
    log_r = batch["ref_logp"].double() - batch["old_logp"].double()
    kind = args["kl_estimator"]
    kl = -log_r if kind == "k1" else 0.5 * log_r**2 if kind == "k2" else log_r.exp() - 1 - log_r
    current = ((kl * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    error = (current / args["target_kl"] - 1).clamp(-0.2, 0.2)
    return (batch["kl_coef"].double() * (1 + error * len(m) / args["kl_horizon"])).float()


# Losses: one micro-batch, with `out` the models' outputs (stored, or from the models with autograd).


def _policy_only(out, batch, args):
    """This project's loss with its KL, entropy and value terms off: the clipped surrogate aggregated as the peer
    aggregates it (both agree on it)."""
    algorithm = ours().ALGORITHMS[args["script"]]
    off = dict(beta=0.0) if args["script"] == "grpo" else dict(ent_coef=0.0, vf_coef=0.0)
    return algorithm.compute_loss(out, batch, _flags(args, **off))[0]


def _sequence_mean(values, mask):
    return ((values * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()  # summed over the micro-batch's sequences


def skyrl_loss_of(out, batch, args):
    """SkyRL's workers: the policy loss, + beta * k3 averaged per sequence then over the batch's sequences (GRPO),
    - ent_coef * the micro-batch's token mean of the entropy * n / num_seqs, + vf_coef * the value loss averaged per
    sequence then over the minibatch's sequences (PPO)."""
    mask, num_seqs = batch["completion_mask"], batch["num_seqs"]
    loss = _policy_only(out, batch, args)
    if args["script"] == "grpo" and args["beta"] > 0:
        log_r = batch["ref_logp"] - out["new_logp"]
        loss = loss + args["beta"] * _sequence_mean(log_r.exp() - 1 - log_r, mask) / num_seqs
    if args["script"] == "ppo" and args["ent_coef"] > 0:
        token_mean = (out["entropy"] * mask).sum() / mask.sum().clamp(min=1)
        loss = loss - args["ent_coef"] * token_mean * len(mask) / num_seqs
    if args["script"] == "ppo" and args["vf_coef"] > 0:
        v, old, R, c = out["new_values"], batch["values"], batch["returns"], args["cliprange_value"]
        value = 0.5 * torch.max((v - R) ** 2, (old + (v - old).clamp(-c, c) - R) ** 2)
        loss = loss + args["vf_coef"] * _sequence_mean(value, mask) / num_seqs
    return loss


def stored(batch):
    return {k: batch[k] for k in ("new_logp", "entropy", "new_values") if k in batch}


def skyrl_loss(batch, args):
    return skyrl_loss_of(stored(batch), batch, args)


def skyrl_train_loss(model, batch, args, critic=None):
    return skyrl_loss_of(ours().outputs(model, batch, args, critic), batch, args)
