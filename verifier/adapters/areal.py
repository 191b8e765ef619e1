"""AReaL 1.0.4's own advantage, reward, KL and loss code as a verify.py adapter (GRPO and PPO).

    pip install --no-deps --target .areal-site -r requirements/areal.txt    # a folder of its own
    python verify.py DUMP --against areal           # found in .areal-site, or the folder $AREAL_SITE names

What is called, unchanged (loaded by verifier/areal_site.py, which says what stands in for what):
  advantages, returns,  PPOActor._compute_advantages (trainer/ppo/actor.py) on the batch laid out as AReaL lays it
  rewards               out (each prompt and completion right-padded, log-probs rolled by one): the score at the
                        last token, - kl_ctl * KLEstimator(k1, k2, k3) on every token, GAE (GRPO: gamma = lambda =
                        1 and no critic, so each token's advantage is the score) and its Normalization (adv_norm)
  kl                    utils/data.py KLEstimator
  log-probs             the engine's training path (engine/fsdp_engine.py, _compute_logprobs_entropy:
                        gather_logprobs_entropy on logits / temperature, the labels rolled by one) on the policy's
                        logits with utils/data.py's amend_position_ids
  loss, gradient        FSDPEngine._compute_logprobs_and_loss: the engine's log-probs, grpo_loss_fn (the actor's
                        loss function around ppo_actor_loss_fn) bound as PPOActor._ppo_update binds it, scaled by
                        the loss_weight_fn written in _ppo_update (the micro-batch's tokens) over the minibatch's;
                        PPO: + vf_coef * the same with trainer/ppo/critic.py's ppo_loss_fn on this project's
                        critic's values; loss: the dump's stored log-probs as the logits of two outcomes

AReaL has no KL term in the loss (kl_ctl puts it in the reward), one loss aggregation (the token mean), no entropy
bonus (grpo_loss_fn detaches the entropy: a dump with --ent-coef > 0 leaves the loss rows not compared) and no
adaptive KL controller. Its known differences are exact expectations (verifier/peer_expectations.py). Nothing is
written out (WRITTEN_OUT is empty). There is no `update`: AReaL's optimizer step is its engine's.
"""

import functools
import types

import torch

from verifier import peer_expectations as expected
from verifier import peer_site

areal_site = peer_site.fresh("verifier.areal_site")  # where $AREAL_SITE points now
actor, data, functional = areal_site.actor, areal_site.data, areal_site.functional

OPTIONS = {}


def _unsupported(args, loss=False):
    if loss and args["script"] == "grpo" and args["loss_agg"] != "token-mean":
        raise NotImplementedError(
            "AReaL's actor loss is a token mean over the minibatch (the engine weighs each micro-batch by its "
            "tokens): make the dump with --loss-agg token-mean"
        )
    if loss and args["script"] == "grpo" and args["beta"] > 0:
        raise NotImplementedError(
            "AReaL has no KL term in the loss: its kl_ctl puts the KL into the reward, before GAE; make the dump with "
            "--beta 0"
        )
    if loss and args["script"] == "ppo" and args["ent_coef"] > 0:
        raise NotImplementedError("AReaL's actor has no entropy bonus (grpo_loss_fn detaches it): use --ent-coef 0")


WRITTEN_OUT = []  # every piece from the model's logits to the backpropagated loss is AReaL's own
NORMALIZATION = "areal/trainer/ppo/actor.py, PPOActor._compute_advantages (utils/data.py, Normalization)"


def known_differences(args, options):
    """{quantity: the difference, where it is in AReaL, and what AReaL must give by design (verifier/
    peer_expectations.py)}: what --accept can take."""
    out = {}
    if args["script"] == "grpo" and args["scale_rewards"] != "none":
        out["advantages"] = dict(
            why="AReaL normalises the advantages over tokens (adv_norm on each token's return, masked by the loss "
            "mask): a group's mean and std weigh each completion by its length (the std unbiased over tokens), "
            "grpo.py's by one",
            where=NORMALIZATION,
            expect=expected.token_weighted_group_advantages,
        )
    if args["script"] == "ppo":
        out["advantages"] = dict(
            why="AReaL whitens GAE's advantages as (A - mean) / (std + 1e-5) with the unbiased std over the real "
            "tokens, ppo.py as (A - mean) * rsqrt(var + --adv-eps) with the population variance",
            where=NORMALIZATION + ", std_unbiased=True, eps=1e-5",
            expect=expected.advantages_only(expected.unbiased_normalized),
        )
    return out


def differences(args, options):
    out = [f"{q}: {spec['why']} (--accept {q})" for q, spec in known_differences(args, options).items()]
    if args["script"] == "ppo":
        out.append(
            "AReaL bootstraps GAE from the last value of a completion that fills the padded width (its test for a "
            "missing EOS); ppo.py ends every completion at its last real token"
        )
    out.append("AReaL clamps its KL estimates to [-10, 10]: only extreme ratios")
    return out


def _layout(batch):
    """The batch as AReaL's _compute_advantages reads it: each prompt's and completion's real tokens, right-padded
    to one width; `where[i, j]` is the position of completion token j of row i (its log-prob sits one before)."""
    prompt_len = batch["prompt_mask"].sum(1).long()
    n, T = batch["completion_mask"].shape
    width = int(prompt_len.max()) + T
    where = prompt_len[:, None] + torch.arange(T)  # [N, T]
    length = prompt_len + batch["completion_mask"].sum(1).long()
    attention_mask = (torch.arange(width) < length[:, None]).float()
    loss_mask = _at(batch["completion_mask"].float(), where, width)  # 1 on completion tokens
    return where, attention_mask, loss_mask


def _at(values, where, width):
    """[N, T] values -> AReaL's layout [N, width], at the positions `where`."""
    return torch.zeros(len(where), width, dtype=values.dtype).scatter_add_(1, where, values)


def _advantages(batch, args):
    """PPOActor._compute_advantages on the batch, with a stand-in `self` of the fields it reads; returns AReaL's
    data dict and `where` to read it back."""
    mask = batch["completion_mask"]
    where, attention_mask, loss_mask = _layout(batch)
    grpo = args["script"] == "grpo"
    if grpo:
        level = {"group": "group", "batch": "batch", "none": None}[args["scale_rewards"]]
        norm = types.SimpleNamespace(
            mean_level="group",
            mean_leave1out=False,
            std_level=level,
            std_unbiased=True,
            group_size=args["group_size"],
            eps=args["adv_eps"],
        )
        score, kl_ctl, estimator, gamma, lam = batch["rewards"], 0.0, "k1", 1.0, 1.0
        old_logp = ref_logp = torch.zeros(mask.shape)
    else:
        norm = types.SimpleNamespace(
            mean_level="batch", mean_leave1out=False, std_level="batch", std_unbiased=True, group_size=1, eps=1e-5
        )
        has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)
        if (batch["token_scores"] != 0).sum(1).gt(1).any():
            raise NotImplementedError("AReaL's reward is one score per completion, not a dense reward")
        score = batch["token_scores"].sum(1) - args["missing_eos_penalty"] * (~has_eos).float()
        kl_ctl, estimator, gamma, lam = batch["kl_coef"].item(), args["kl_estimator"], args["gamma"], args["lam"]
        old_logp, ref_logp = batch["old_logp"], batch["ref_logp"]
    config = types.SimpleNamespace(
        overlong_reward_penalty=False, use_decoupled_loss=False, recompute_logprob=False, max_new_tokens=None
    )
    me = types.SimpleNamespace(
        config=config,
        reward_bias=0.0,
        reward_scaling=1.0,
        reward_clip=float("inf"),
        reward_norm=None,
        kl_ctl=kl_ctl,
        kl_estimator=data.KLEstimator(estimator),
        adv_norm=data.Normalization(norm),
        discount=gamma,
        gae_lambda=lam,
        mask_no_eos_with_zero=False,
    )
    width = attention_mask.shape[1]
    d = dict(
        input_ids=torch.zeros(attention_mask.shape, dtype=torch.long),
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rewards=score.float().clone(),
        logprobs=_at(old_logp.float(), where, width),  # at each token's own position: the actor rolls them by one
        ref_logp=_at(ref_logp.float(), where - 1, width),  # at the position that predicts the token, as the loss mask
    )
    if not grpo:
        d["values"] = _at(batch["values"].float(), where - 1, width)
    out = actor.PPOActor._compute_advantages(me, d)
    return out, where - 1


def _read(x, where, mask):
    return x.gather(1, where) * mask


def group_advantages(batch, args):
    out, where = _advantages(batch, args)
    return _read(out["advantages"], where, batch["completion_mask"])  # [N, T]


def gae(batch, args):
    out, where = _advantages(batch, args)
    mask = batch["completion_mask"]
    return _read(out["advantages"], where, mask), _read(out["returns"], where, mask)


def rewards(batch, args):
    out, where = _advantages(batch, args)
    return _read(out["tot_rewards"], where, batch["completion_mask"])


def kl(batch, args):
    if args["script"] == "ppo":
        return data.KLEstimator(args["kl_estimator"])(batch["old_logp"], batch["ref_logp"])
    raise NotImplementedError("AReaL's GRPO has no KL term in the loss: kl_ctl puts it into the reward")


def _actor_loss_fn(args):
    """grpo_loss_fn as PPOActor._ppo_update binds it (functools.partial) from the actor's config."""
    return functools.partial(
        actor.grpo_loss_fn,
        eps_clip=args["clip_low"],
        eps_clip_higher=args["clip_high"],
        c_clip=None,
        importance_sampling_level=args.get("importance_level", "token"),
    )


def _ids(batch):
    """The micro-batch's ids and attention mask in AReaL's layout (each sequence right-padded); `where` as _layout."""
    where, attention_mask, _ = _layout(batch)
    width = attention_mask.shape[1]
    input_ids = _at(batch["prompt_ids"] * batch["prompt_mask"], _prompt_positions(batch), width)
    input_ids = input_ids + _at(batch["completion_ids"] * batch["completion_mask"], where, width)
    return input_ids, attention_mask, where


def _losses(policy_logits, values, batch, args, old_logp, input_ids, where):
    """The engine's _compute_logprobs_and_loss on the micro-batch with the actor's grpo_loss_fn and its loss weight
    (the micro-batch's tokens over the minibatch's); PPO adds vf_coef * the same with the critic's ppo_loss_fn."""
    _unsupported(args, loss=True)
    mask = batch["completion_mask"].float()
    width = input_ids.shape[1]

    def at(x):  # each completion token's value where AReaL keeps it: at the position that predicts the token
        return _at(x.float() * mask, where - 1, width)

    advantages = batch["advantages"]
    advantages = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    inputs = dict(logprobs=at(old_logp), advantages=at(advantages), loss_mask=at(mask), prox_logp=at(old_logp))
    total = areal_site.engine_loss(args, policy_logits, input_ids, inputs, _actor_loss_fn(args), batch["num_tokens"])
    if args["script"] == "ppo" and args["vf_coef"] > 0:  # no critic: no value loss
        inputs = dict(values=at(batch["values"]), returns=at(batch["returns"]), loss_mask=at(mask))
        fn = functools.partial(areal_site.critic.ppo_loss_fn, eps_clip=args["cliprange_value"])
        critic_loss = areal_site.engine_loss(args, values[..., None], input_ids, inputs, fn, batch["num_tokens"], True)
        total = total + args["vf_coef"] * critic_loss
    return total


def per_token_loss(batch, args):
    """Each token's term: grpo_loss_fn's loss as a sum (num_tokens 1) differentiated by a positive weight on each
    token's advantage (the PPO-clip loss is homogeneous in it); PPO adds vf_coef * ppo_critic_loss_fn of each token
    alone (its mean over one token is the token's own term)."""
    _unsupported(args, loss=True)
    real = batch["completion_mask"]
    weight = torch.ones(real.shape, requires_grad=True)
    advantages = batch["advantages"] if args["script"] == "ppo" else batch["advantages"][:, None].expand_as(real)
    new_logp = batch["new_logp"]
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    inputs = dict(logprobs=old_logp, advantages=advantages * weight, loss_mask=real.bool(), prox_logp=old_logp)
    token_mean = _actor_loss_fn(args)(new_logp, torch.zeros_like(new_logp), inputs)
    (per_token,) = torch.autograd.grad(token_mean * real.sum(), weight)  # d(sum_t m_t L_t(w_t A_t)) / d w_t at w = 1
    if args["script"] == "ppo" and args["vf_coef"] > 0:  # no critic: no value loss
        flat = [t.reshape(-1, 1).float() for t in (batch["new_values"], batch["values"], batch["returns"])]
        masks = real.reshape(-1, 1).bool().split(1)
        value = torch.stack(
            [
                functional.ppo_critic_loss_fn(v, o, r, args["cliprange_value"], m)[0] if m.any() else torch.tensor(0.0)
                for v, o, r, m in zip(*[f.split(1) for f in flat], masks)
            ]
        )
        per_token = per_token + args["vf_coef"] * value.view_as(real)
    return per_token * real


def loss(batch, args):
    """The engine's loss on the dump's stored outputs: the log-probs as the logits of two outcomes (the token and
    the rest: gather_logprobs_entropy at the temperature gives them back), the values as the critic's output."""
    input_ids, attention_mask, where = _ids(batch)
    width, logp = attention_mask.shape[1], batch["new_logp"].float()
    two = torch.stack([logp, torch.log(-torch.expm1(logp))], -1) * args["temperature"]  # [N, T, 2]
    logits = torch.zeros(len(logp), width, 2).scatter(1, (where - 1)[..., None].expand_as(two), two)
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else logp
    values = _at(batch["new_values"].float(), where - 1, width) if "new_values" in batch else None
    return _losses(logits, values, batch, args, old_logp, torch.zeros_like(input_ids), where)


def _logits(model, input_ids, attention_mask):
    """The policy's logits on AReaL's layout with utils/data.py's amend_position_ids, as the engine prepares them."""
    inputs = data.amend_position_ids(dict(input_ids=input_ids, attention_mask=attention_mask))
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=inputs["position_ids"]).logits


def token_logprobs(model, batch, args):
    """The engine's training-path log-probs (_compute_logprobs_entropy: gather_logprobs_entropy on logits /
    temperature, the labels rolled by one) on AReaL's layout, read back at each completion token."""
    input_ids, attention_mask, where = _ids(batch)
    with torch.no_grad():
        logits = _logits(model, input_ids, attention_mask)
        logprobs, _ = areal_site.engine_self(args)._compute_logprobs_entropy(logits, dict(input_ids=input_ids))
    return logprobs.gather(1, where - 1) * batch["completion_mask"]


def _prompt_positions(batch):
    """Where each prompt token goes in AReaL's layout: the real ones first, from position 0 (padding: 0, adding 0)."""
    mask = batch["prompt_mask"].long()
    order = torch.argsort(1 - mask, dim=1, stable=True)  # the real tokens first, in order
    positions = torch.empty_like(order)
    positions.scatter_(1, order, torch.arange(mask.shape[1]).expand_as(order).contiguous())
    return torch.where(mask.bool(), positions, 0)


def train_loss(model, batch, args, critic=None):
    """The engine's loss from the policy's logits (and this project's critic's values: AReaL's critic is its own
    engine's model) on AReaL's layout; GRPO at one iteration takes the old log-probs from a first forward."""
    input_ids, attention_mask, where = _ids(batch)
    old_logp = batch.get("old_logp")
    if args["script"] == "grpo" and args["num_iterations"] == 1:
        old_logp = token_logprobs(model, batch, args)
    values = critic(input_ids, attention_mask) if critic is not None else None
    logits = _logits(model, input_ids, attention_mask)
    return _losses(logits, values, batch, args, old_logp, input_ids, where)
