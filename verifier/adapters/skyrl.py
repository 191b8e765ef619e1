"""SkyRL 0.4.0's own advantage, KL, controller and loss code as a verify.py adapter (GRPO and PPO).

    pip install --no-deps --target .skyrl-site --python-version 3.12 --only-binary=:all: --ignore-requires-python \\
        -r requirements/skyrl.txt                      # a folder of its own (its wheel says Python >= 3.12)
    python verify.py DUMP --against skyrl              # found in .skyrl-site, or the folder $SKYRL_SITE names

What is called, unchanged (loaded by verifier/skyrl_site.py, which says what stands in for what):
  advantages, returns  compute_advantages_and_returns (utils/ppo_utils.py), the trainer's call, through its
                       AdvantageEstimatorRegistry: "grpo" (grpo_norm_by_std False for --scale-rewards none),
                       "gae", and "reinforce++" for ppo.py without a critic at --lam 1, with its masked_whiten
  rewards, kl_coef     the trainer's apply_reward_kl_penalty (train/trainer.py) with its AdaptiveKLController:
                       compute_approx_kl subtracted from the score, the controller fed avg_kl over the completions
  kl                   compute_approx_kl (k1, k2, k3)
  log-probs            HFModelWrapper.forward (workers/model_wrapper.py) around the policy: its position ids,
                       logits / temperature, logprobs_from_logits and its shift
  loss, gradient       the trainer's _normalize_advantages (apply_loss_reduction_to_advantages_minibatch), then
                       the workers' own _forward_backward_micro (workers/worker.py): PolicyWorkerBase's (the
                       PolicyLossRegistry's "regular" or "gspo", its KL and entropy terms weighted by
                       microbatch_weight) on the wrapper's output (loss: a model returning the dump's stored
                       outputs), and for PPO vf_coef * CriticWorkerBase's, its model SkyRL's CriticModel.forward
                       on this project's critic

The loss SkyRL backpropagates is what its strategy's backward receives; its critic trains apart, unscaled, so the
PPO loss here is policy + vf_coef * critic loss. Its known differences are exact expectations
(verifier/peer_expectations.py). Nothing is written out (WRITTEN_OUT is empty). There is no `update`: SkyRL's
optimizer step is its FSDP strategy's.
"""

import types

import numpy as np
import torch

from verifier import peer_expectations as expected
from verifier import peer_site

skyrl_site = peer_site.fresh("verifier.skyrl_site")  # where $SKYRL_SITE points now
ppo_utils, worker = skyrl_site.ppo_utils, skyrl_site.worker

REDUCTIONS = {  # grpo.py --loss-agg: SkyRL's loss_reduction
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
EPSILON = 1e-6  # compute_grpo_outcome_advantage's default: the trainer passes none
WRITTEN_OUT = []  # every piece from the model's forward to the backpropagated loss is SkyRL's own
WORKER = "skyrl/backends/skyrl_train/workers/worker.py, _forward_backward_micro"


def known_differences(args, options):
    """{quantity: the difference, where it is in SkyRL, and what SkyRL must give by design (verifier/
    peer_expectations.py)}: what --accept can take."""
    out = {}
    if args["script"] == "grpo" and args["scale_rewards"] == "group" and args["adv_eps"] != EPSILON:
        out["advantages"] = dict(
            why=f"compute_grpo_outcome_advantage divides by std + 1e-6 (the trainer passes no epsilon), grpo.py by "
            f"std + --adv-eps {args['adv_eps']:g} (a dump with --adv-eps 1e-6 matches)",
            where="skyrl/backends/skyrl_train/utils/ppo_utils.py, compute_grpo_outcome_advantage",
            expect=expected.group_std_advantages,
        )
    losses = []
    if args["script"] == "grpo" and args["beta"] > 0 and args["loss_agg"] != "seq-mean-token-mean":
        losses.append(
            f"its KL loss is averaged per sequence, then over sequences, grpo.py's by --loss-agg {args['loss_agg']}"
        )
    if args["script"] == "ppo":
        whiten = expected.unbiased_whitened
        out["advantages"] = dict(
            why="SkyRL whitens GAE's advantages with the unbiased variance (times N / (N - 1) over N real tokens) "
            "and eps 1e-8 inside the root, ppo.py with the population variance and --adv-eps",
            where="skyrl/backends/skyrl_train/utils/ppo_utils.py, masked_whiten (masked_var, unbiased=True)",
            expect=expected.advantages_only(whiten),
        )
        if args["vf_coef"] > 0:
            losses.append("its ppo_critic_loss averages the value loss per sequence, then over sequences")
        if args["ent_coef"] > 0:
            losses.append("its entropy loss is the micro-batch's token mean, weighted by its share of sequences")
        if args["target_kl"] is not None:
            out["kl_coef"] = dict(
                why="SkyRL's trainer feeds AdaptiveKLController the mean over completions of each one's per-token "
                "mean KL (its kl_estimator_type), ppo.py the summed k1 KL per completion",
                where="skyrl/train/trainer.py, apply_reward_kl_penalty (update(current=avg_kl, n_steps=N))",
                expect=expected.kl_coef_fed_token_means,
            )
    if losses:
        why = f"SkyRL's worker weighs its terms otherwise than ppo.py and grpo.py: {'; '.join(losses)}"
        out["loss"] = dict(why=why, where=WORKER, expect=expected.skyrl_loss)
        out["gradient"] = dict(why=why, where=WORKER, expect=expected.skyrl_train_loss)
        if args["script"] == "ppo" and args["vf_coef"] > 0:
            out["critic gradient"] = dict(why=why, where=WORKER, expect=expected.skyrl_train_loss)
    return out


def differences(args, options):
    out = [f"{q}: {spec['why']} (--accept {q})" for q, spec in known_differences(args, options).items()]
    if args["script"] == "ppo" and args["missing_eos_penalty"] > 0:
        out.append(
            "SkyRL has no missing-EOS penalty of this form: the adapter subtracts --missing-eos-penalty from the "
            "score it passes to apply_reward_kl_penalty"
        )
    out.append(
        "SkyRL clamps the log-ratio to [-20, 20] (safe_exp_delta) and its k3 to [-10, 10]: only extreme ratios; "
        "its dual clip (policy_loss_type dual_clip) is not this project's"
    )
    return out


def _config(args, loss_type="regular"):
    """The fields of SkyRL's AlgorithmConfig that its loss functions read, set from the run's flags."""
    return types.SimpleNamespace(
        policy_loss_type=loss_type,
        eps_clip_low=args["clip_low"],
        eps_clip_high=args["clip_high"],
        clip_ratio_c=3.0,
        loss_reduction=REDUCTIONS.get(args.get("loss_agg"), "token_mean"),
        value_clip=args.get("cliprange_value"),
        off_policy_correction=types.SimpleNamespace(tis_ratio_type=None),
        max_seq_len=args["max_new_tokens"],
    )


def _no_bias_correction(args):
    if args["script"] == "grpo" and args["beta"] > 0 and args["bias_corrected_kl"]:
        raise NotImplementedError(
            "SkyRL has no ratio-weighted k3 (--bias-corrected-kl): make the dump with --no-bias-corrected-kl"
        )


def group_advantages(batch, args):
    if args["scale_rewards"] == "batch":
        raise NotImplementedError(
            "SkyRL's GRPO divides by the group's std or by nothing (grpo_norm_by_std); its advantage_batch_normalize "
            "whitens the token-level advantages, not the rewards: make the dump with --scale-rewards group or none"
        )
    mask = batch["completion_mask"]
    rewards = batch["rewards"][:, None] * (torch.arange(mask.shape[1]) == 0)  # [N, T]: SkyRL sums each row
    index = np.arange(len(mask)) // args["group_size"]  # the group (uid) of each completion
    advantages, _ = ppo_utils.compute_advantages_and_returns(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        adv_estimator="grpo",
        config=_config(args),
        grpo_norm_by_std=args["scale_rewards"] == "group",
    )
    return advantages


def gae(batch, args):
    """GAE; without a critic (--vf-coef 0) and with lambda 1, ppo.py's REINFORCE++ (docs/fork.md): SkyRL's own
    "reinforce++" estimator, the discounted return to go whitened over the batch."""
    reinforce_pp = args["vf_coef"] == 0 and args["lam"] == 1
    return ppo_utils.compute_advantages_and_returns(
        token_level_rewards=batch["rewards"],
        response_mask=batch["completion_mask"],
        index=None,
        adv_estimator="reinforce++" if reinforce_pp else "gae",
        config=_config(args),
        values=batch["values"],
        gamma=args["gamma"],
        lambd=args["lam"],
    )


def rewards(batch, args):
    """The trainer's apply_reward_kl_penalty on the score at its token (less --missing-eos-penalty, which SkyRL has
    not): the score minus kl_loss_coef * compute_approx_kl."""
    mask = batch["completion_mask"]
    has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)
    last = mask.cumsum(1).argmax(1)  # the last real token of each completion
    penalty = torch.zeros(mask.shape).index_put_(
        (torch.arange(len(mask)), last), args["missing_eos_penalty"] * ~has_eos
    )
    return skyrl_site.reward_kl_penalty(batch, args, batch["token_scores"] - penalty)[0]


def kl_coef(batch, args):
    """The coefficient after the trainer's apply_reward_kl_penalty has updated its AdaptiveKLController with the
    batch (fed the mean over completions of each one's per-token mean KL, n_steps the completions)."""
    return torch.tensor(skyrl_site.reward_kl_penalty(batch, args, batch["token_scores"])[1])


def kl(batch, args):
    _no_bias_correction(args)
    mask = batch["completion_mask"]
    if args["script"] == "ppo":
        return ppo_utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], mask, args["kl_estimator"])
    return ppo_utils.compute_approx_kl(batch["new_logp"], batch["ref_logp"], mask, "k3")


def _sequences(batch):
    return torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1), torch.cat(
        [batch["prompt_mask"], batch["completion_mask"]], 1
    )


def token_logprobs(model, batch, args):
    """HFModelWrapper.forward's action log-probs (its position ids, logits / temperature, its shift)."""
    sequences, attention_mask = _sequences(batch)
    mask = batch["completion_mask"]
    with torch.no_grad():
        out = skyrl_site.wrapped(model)(sequences, mask.shape[1], attention_mask, temperature=args["temperature"])
    return out * mask


def _minibatch_mask(mask, num_seqs, num_tokens):
    """The micro-batch's mask, with rows standing in for the rest of its minibatch: apply_loss_reduction_to_
    advantages_minibatch reads only the minibatch's sequence count and token count (and, per row, its own)."""
    rest_seqs, rest_tokens = num_seqs - len(mask), int(num_tokens - mask.sum().item())
    if rest_seqs <= 0:
        return mask.float()
    width = max(mask.shape[1], -(-rest_tokens // rest_seqs))
    rest = torch.zeros(rest_seqs, width)
    rest.view(-1)[: max(rest_tokens, 0)] = 1.0
    padded = torch.nn.functional.pad(mask.float(), (0, width - mask.shape[1]))
    return torch.cat([padded, rest])


def _experience(batch, advantages, old_logp):
    """The worker's Experience of one micro-batch (the fields _forward_backward_micro reads)."""
    sequences, attention_mask = _sequences(batch)
    return types.SimpleNamespace(
        sequences=sequences,
        attention_mask=attention_mask,
        action_log_probs=old_logp,
        base_action_log_probs=batch.get("ref_logp"),
        advantages=advantages,
        num_actions=batch["completion_ids"].shape[1],
        loss_mask=batch["completion_mask"].float(),
        response_mask=batch["completion_mask"],
        rollout_logprobs=None,
        pixel_values=None,
        image_grid_thw=None,
        rollout_sample_support=None,
        values=batch.get("values"),
        returns=batch.get("returns"),
        to_device=lambda device: None,
    )


def _scaled(batch, args, config):
    """The advantages as the trainer's _normalize_advantages scales them over the minibatch (its
    apply_loss_reduction_to_advantages_minibatch), read back at the micro-batch's rows."""
    mask = batch["completion_mask"]
    advantages = batch["advantages"]
    if args["script"] == "grpo":
        advantages = advantages[:, None].expand(mask.shape)
    n, T = mask.shape
    whole = _minibatch_mask(mask, batch["num_seqs"], batch["num_tokens"])
    padded = torch.nn.functional.pad(advantages.float(), (0, whole.shape[1] - T))
    padded = torch.cat([padded, torch.zeros(len(whole) - n, whole.shape[1])])
    return skyrl_site.normalized_advantages(padded, whole, config, n)[:n, :T]


def _losses(policy, batch, args, old_logp, critic=None):
    """What SkyRL's workers backpropagate on the micro-batch: PolicyWorkerBase._forward_backward_micro (the policy
    loss on the scaled advantages, + the KL loss for GRPO, - the entropy loss for PPO, those weighted by
    microbatch_weight) with `policy` its model; PPO adds vf_coef * CriticWorkerBase._forward_backward_micro's loss
    with `critic` its model (SkyRL trains its critic apart: its loss unscaled)."""
    _no_bias_correction(args)
    loss_type = "gspo" if args.get("importance_level") == "sequence" else "regular"
    config = _config(args, loss_type)
    ppo = args["script"] == "ppo"
    config.__dict__.update(
        temperature=args["temperature"],
        use_entropy_loss=ppo and args["ent_coef"] > 0,
        entropy_loss_coef=args["ent_coef"] if ppo else 0.0,
        use_kl_loss=not ppo and args["beta"] > 0,
        kl_loss_coef=0.0 if ppo else args["beta"],
        kl_estimator_type="k3",
        enable_sample_support_replay=False,
    )
    experience = _experience(batch, _scaled(batch, args, config), old_logp)
    weight = len(batch["completion_mask"]) / batch["num_seqs"]  # forward_backward's microbatch_weight
    loss = skyrl_site.backpropagated(
        worker.PolicyWorkerBase._forward_backward_micro,
        policy,
        config,
        experience,
        weight,
        policy_loss_fn=ppo_utils.PolicyLossRegistry.get(loss_type),
    )
    if ppo and args["vf_coef"] > 0:  # no critic: no value loss
        critic_loss = skyrl_site.backpropagated(
            worker.CriticWorkerBase._forward_backward_micro,
            critic,
            config,
            experience,
            weight,
            critic_loss_fn=ppo_utils.ppo_critic_loss,
            _micro_batches_accumulated=0,
        )
        loss = loss + args["vf_coef"] * critic_loss
    return loss


def per_token_loss(batch, args):
    """Each token's term, by SkyRL's functions: the policy loss's sum reduction (reduce_loss) differentiated by a
    positive weight on each token's advantage (the loss is homogeneous in it, as SkyRL's reductions use), plus
    beta * compute_approx_kl (GRPO), or vf_coef * ppo_critic_loss of the token alone and - ent_coef * its entropy
    (PPO)."""
    _no_bias_correction(args)
    config = _config(args, "gspo" if args.get("importance_level") == "sequence" else "regular")
    new_logp, real = batch["new_logp"], batch["completion_mask"]
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp
    advantages = batch["advantages"]
    if args["script"] == "grpo":
        advantages = advantages[:, None].expand_as(new_logp)
    weight = torch.ones(real.shape, requires_grad=True)
    policy_loss = ppo_utils.PolicyLossRegistry.get(config.policy_loss_type)
    token_sum, _ = policy_loss(new_logp, old_logp, advantages * weight, config, loss_mask=real)
    (per_token,) = torch.autograd.grad(token_sum, weight)  # d(sum_t m_t L_t(w_t A_t)) / d w_t = m_t L_t at w = 1
    if args["script"] == "grpo" and args["beta"] > 0:
        per_token = per_token + args["beta"] * ppo_utils.compute_approx_kl(new_logp, batch["ref_logp"], real, "k3")
    if args["script"] == "ppo" and args["vf_coef"] > 0:  # no critic: no value loss
        flat = [t.reshape(-1, 1) for t in (batch["new_values"], batch["values"], batch["returns"], real)]
        value = torch.stack(
            [ppo_utils.ppo_critic_loss(v, o, r, config, m)[0] for v, o, r, m in zip(*[f.split(1) for f in flat])]
        )  # one token at a time: its masked_mean over one token is the token's own term
        per_token = per_token + args["vf_coef"] * value.view_as(real) * real
    if args["script"] == "ppo" and args["ent_coef"] > 0:  # entropy_loss_coef * each token's entropy
        per_token = per_token - args["ent_coef"] * batch["entropy"] * real
    return per_token


def _at_positions(values, batch):
    """[n, T] values of the completion's tokens as a model's output holds them, [n, P + T]: each at the position
    that predicts its token (the worker reads [:, -num_actions - 1 : -1])."""
    out = torch.zeros(len(values), batch["prompt_ids"].shape[1] + values.shape[1])
    out[:, -values.shape[1] - 1 : -1] = values
    return out


def loss(batch, args):
    """The workers' loss with models that return the dump's stored outputs (log-probs, entropy, values)."""
    new_logp = batch["new_logp"]
    entropy = batch.get("entropy", torch.zeros_like(new_logp))
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    policy = skyrl_site.Stored(new_logp, {"entropy": _at_positions(entropy, batch)})
    return _losses(policy, batch, args, old_logp, skyrl_site.Stored(batch.get("new_values"), None))


def train_loss(model, batch, args, critic=None):
    """The workers' loss with SkyRL's HFModelWrapper around the policy and its CriticModel.forward on this
    project's critic (SkyRL's is its own worker's model); GRPO at one iteration takes the old log-probs from a
    first forward of the wrapper, as SkyRL's trainer does before its update."""
    policy = skyrl_site.wrapped(model)
    old_logp = batch.get("old_logp")
    if args["script"] == "grpo" and args["num_iterations"] == 1:
        old_logp = token_logprobs(model, batch, args)
    return _losses(policy, batch, args, old_logp, skyrl_site.critic_model(critic) if critic is not None else None)
