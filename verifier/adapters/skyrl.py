"""SkyRL 0.4.0's own advantage, KL, controller and loss code as a verify.py adapter (GRPO and PPO).

    pip install --no-deps --target .skyrl-site --python-version 3.12 --only-binary=:all: --ignore-requires-python \\
        -r requirements/skyrl.txt                      # a folder of its own (its wheel says Python >= 3.12)
    python verify.py DUMP --against skyrl              # found in .skyrl-site, or the folder $SKYRL_SITE names

What is called, unchanged (read in .skyrl-site/skyrl/backends/skyrl_train/utils/ppo_utils.py):
  advantages, returns  compute_advantages_and_returns, the trainer's call (trainer.py), through its
                       AdvantageEstimatorRegistry: "grpo" (grpo_norm_by_std False for --scale-rewards none),
                       "gae", and "reinforce++" for ppo.py without a critic (--vf-coef 0 --lam 1), with its
                       masked_whiten
  rewards              compute_approx_kl, subtracted from the score as the trainer's apply_reward_kl_penalty does
                       (trainer.py: rewards - kl * kl_loss_coef)
  kl                   compute_approx_kl (k1, k2, k3)
  kl_coef              AdaptiveKLController.update, fed the summed KL of each completion as ppo.py feeds its
                       controller; --set controller_kl=mean feeds it as the trainer does (a known difference)
  losses               PolicyLossRegistry's "regular" (ppo_policy_loss) or "gspo" (gspo_policy_loss) on advantages
                       scaled by apply_loss_reduction_to_advantages_minibatch (token_mean, sequence_mean,
                       seq_mean_token_sum_norm), then the worker's assembly (workers/worker.py,
                       _forward_backward_micro): policy_loss + kl_loss_coef * masked_mean(compute_approx_kl(k3),
                       dim=-1).mean() * microbatch_weight (the micro-batch's share of its minibatch's sequences);
                       PPO: - entropy_loss_coef * masked_mean(entropy, loss_mask) * microbatch_weight (its
                       chunked_entropy_from_logits) + vf_coef * ppo_critic_loss * microbatch_weight
                       (tests/test_verify_skyrl.py runs SkyRL's own workers on each micro-batch: the same loss)
  log-probs            torch_utils.logprobs_from_logits on logits / temperature, with the position ids of
                       HFModelWrapper.forward (attention_mask.cumsum(-1) - 1, 1 on padding)

SkyRL's ppo_utils imports ray (its registries sync through a ray actor once ray is initialised: never here),
jaxtyping (annotations), loguru (warnings) and skyrl.train.config (AlgorithmConfig, an annotation; its module
imports omegaconf and skyrl_gym's environments): each is an empty stand-in while the module loads, and the config
SkyRL's functions read is a namespace of exactly the fields they read. Its package __init__ files are not run.
Nothing of SkyRL is copied here. The position-id line of HFModelWrapper.forward is written out: its module needs
flash-attn and peft. The critic's values come from this project's critic; the PPO loss is policy + vf_coef *
critic loss (SkyRL trains its critic apart, unscaled). There is no `update`: SkyRL's optimizer is its strategy's.
"""

import os
import sys
import types

import numpy as np
import torch

from verifier import peer_site

PACKAGES = ["skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.utils"]
STUBS = ["ray", "jaxtyping", "loguru", "omegaconf", "skyrl.train", "skyrl.train.config"]
REDUCTIONS = {  # grpo.py --loss-agg: SkyRL's loss_reduction
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


class _Annotation:
    """jaxtyping's Float / Integer: subscripted in annotations only."""

    def __class_getitem__(cls, item):
        return cls


def _load():
    """SkyRL's ppo_utils and torch_utils, from $SKYRL_SITE when set, else sys.path or .skyrl-site."""
    root = peer_site.find(
        "skyrl",
        os.path.join("backends", "skyrl_train", "utils", "ppo_utils.py"),
        "pip install --no-deps --target .skyrl-site --python-version 3.12 --only-binary=:all: --ignore-requires-python "
        "-r requirements/skyrl.txt",
    )
    saved = {name: sys.modules.get(name) for name in PACKAGES}
    for name in PACKAGES:  # namespace packages: their __init__ files (the tinker backend) are not run
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    names = [
        "skyrl.backends.skyrl_train.utils." + m for m in ("ppo_utils", "torch_utils", "off_policy_correction_utils")
    ]
    try:
        with peer_site.stubbed(STUBS) as stubs:
            stubs["ray"].remote = lambda cls: cls  # RegistryActor: a class ray would host, never started
            stubs["ray"].is_initialized = lambda: False
            stubs["jaxtyping"].Float = stubs["jaxtyping"].Integer = _Annotation
            stubs["loguru"].logger = types.SimpleNamespace(info=print, warning=print, error=print)
            stubs["omegaconf"].DictConfig = object
            stubs["skyrl.train.config"].AlgorithmConfig = object
            ppo_utils = __import__(names[0], fromlist=["*"])
            torch_utils = sys.modules[names[1]]
    finally:  # SkyRL's modules stay loaded under this adapter's names; sys.modules is as it was
        for name in names:
            sys.modules.pop(name, None)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    ppo_utils.repopulate_all_registries()
    return ppo_utils, torch_utils


ppo_utils, torch_utils = _load()
OPTIONS = {"controller_kl": "summed"}  # what AdaptiveKLController is fed: ppo.py's (summed) or SkyRL's trainer's
EPSILON = 1e-6  # compute_grpo_outcome_advantage's default: the trainer passes none
options = dict(OPTIONS)


def setup(args, chosen, model):
    if chosen["controller_kl"] not in ("summed", "mean"):
        raise NotImplementedError(f"--set controller_kl={chosen['controller_kl']}: summed or mean")
    options.update(chosen)


def known_differences(args, chosen):
    """{quantity: the difference, where it is in SkyRL, and how large it can be}: what --accept can take."""
    out = {}
    if args["script"] == "grpo" and args["scale_rewards"] == "group" and args["adv_eps"] != EPSILON:
        out["advantages"] = dict(
            why=f"compute_grpo_outcome_advantage divides by std + 1e-6 (the trainer passes no epsilon), grpo.py by "
            f"std + --adv-eps {args['adv_eps']:g} (a dump with --adv-eps 1e-6 matches); the relative difference is "
            "about adv_eps / the group's std",
            where="skyrl/backends/skyrl_train/utils/ppo_utils.py, compute_grpo_outcome_advantage",
            bound=("rel", max(100 * args["adv_eps"], 1e-5)),
        )
    if args["script"] == "ppo":
        n = args["prompts_per_step"] * args["samples_per_prompt"]  # the fewest real tokens a batch can have
        out["advantages"] = dict(
            why="SkyRL whitens GAE's advantages with the unbiased variance (times N / (N - 1) over N real tokens), "
            "ppo.py with the population variance: they differ by a factor sqrt(1 - 1 / N), under 1 / N",
            where="skyrl/backends/skyrl_train/utils/ppo_utils.py, masked_whiten (masked_var, unbiased=True)",
            bound=("rel", 1 / n),
        )
        terms = [
            ("vf_coef", "its ppo_critic_loss averages the value loss per sequence (masked_mean(loss, dim=-1).mean())"),
            ("ent_coef", "its entropy loss is the micro-batch's token mean (masked_mean(entropy, loss_mask))"),
        ]
        terms = [text for flag, text in terms if args[flag] > 0]
        where = "skyrl/backends/skyrl_train/workers/worker.py, _forward_backward_micro; utils/ppo_utils.py"
        if terms:  # measured (recommended PPO dump; REINFORCE++): loss rel 2.1e-04, 1.2e-03; gradient 1.7e-02, 3.2e-05
            why = (
                f"SkyRL weighs a term by each micro-batch's share of sequences (microbatch_weight), ppo.py every token "
                f"of the minibatch alike: {'; '.join(terms)}; the same per-token terms (the per-token loss row), "
                "weighted otherwise wherever completions differ in length"
            )
            out["loss"] = dict(why=why, where=where, bound=("rel", args["vf_coef"] + args["ent_coef"]))
            out["gradient"] = dict(
                why="the same weights on the gradient: measured rel 1.7e-02 on verify.py's recommended PPO dump, "
                "3.2e-05 without a critic (the entropy's alone); the bound is that with a margin, and a dump whose "
                "completions differ more in length fails it, showing the size",
                where=where,
                bound=("rel", 5e-2 if args["vf_coef"] > 0 else 1e-3),
            )
        if args["target_kl"] is not None and chosen["controller_kl"] == "mean":
            out["kl_coef"] = dict(
                why="SkyRL's trainer feeds AdaptiveKLController the mean over completions of each one's per-token "
                "mean KL, ppo.py the summed KL per completion; both errors are clipped to +-0.2, so the "
                "coefficients differ by at most 0.4 * N / kl_horizon",
                where="skyrl/train/trainer.py, apply_reward_kl_penalty (update(current=avg_kl))",
                bound=("rel", 0.4 * n / args["kl_horizon"]),
            )
    return out


def differences(args, chosen):
    out = [f"{q}: {spec['why']} (--accept {q})" for q, spec in known_differences(args, chosen).items()]
    if args["script"] == "grpo" and args["beta"] > 0 and args["loss_agg"] != "seq-mean-token-mean":
        out.append(
            f"the KL loss: SkyRL's worker averages it per sequence, then over sequences (masked_mean(kl, dim=-1)"
            f".mean()), whatever loss_reduction; grpo.py aggregates it with the policy loss by --loss-agg "
            f"{args['loss_agg']}: the loss and gradient differ wherever completions differ in length "
            "(workers/worker.py, _forward_backward_micro)"
        )
    if args["script"] == "ppo":
        if args["missing_eos_penalty"] > 0:
            out.append(
                "SkyRL has no missing-EOS penalty of this form: the adapter subtracts --missing-eos-penalty from the "
                "score it passes to apply_reward_kl_penalty's formula"
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
    """apply_reward_kl_penalty's formula: the score at its token, minus kl_loss_coef * compute_approx_kl."""
    mask = batch["completion_mask"]
    has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)
    last = mask.cumsum(1).argmax(1)  # the last real token of each completion
    penalty = torch.zeros(mask.shape).index_put_(
        (torch.arange(len(mask)), last), args["missing_eos_penalty"] * ~has_eos
    )
    kl = ppo_utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], mask, args["kl_estimator"])
    return (batch["token_scores"] - penalty) - kl * max(0, batch["kl_coef"].item())


def kl_coef(batch, args):
    """AdaptiveKLController.update fed the summed k1 KL of each completion (ppo.py's), or the per-token mean of the
    penalty's KL as SkyRL's trainer feeds it (--set controller_kl=mean)."""
    mask = batch["completion_mask"]
    if options["controller_kl"] == "summed":
        per_completion = ppo_utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], mask, "k1").sum(-1)
    else:
        kl = ppo_utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], mask, args["kl_estimator"])
        per_completion = torch_utils.masked_mean(kl, mask, dim=-1)  # the trainer's kl_mean
    controller = ppo_utils.AdaptiveKLController(batch["kl_coef"].item(), args["target_kl"], args["kl_horizon"])
    controller.update(current=per_completion.mean().item(), n_steps=len(per_completion))
    return torch.tensor(controller.value)


def kl(batch, args):
    _no_bias_correction(args)
    mask = batch["completion_mask"]
    if args["script"] == "ppo":
        return ppo_utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], mask, args["kl_estimator"])
    return ppo_utils.compute_approx_kl(batch["new_logp"], batch["ref_logp"], mask, "k3")


def token_logprobs(model, batch, args, entropy=False):
    """HFModelWrapper.forward's log-probs (with `entropy`: and its chunked_entropy_from_logits), as the worker reads."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    position_ids = attention_mask.long().cumsum(-1) - 1  # HFModelWrapper.forward's two lines
    position_ids.masked_fill_(attention_mask == 0, 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits / args["temperature"]
    log_probs = torch_utils.logprobs_from_logits(logits, torch.roll(input_ids, shifts=-1, dims=1))
    T = batch["completion_ids"].shape[1]
    log_probs = log_probs[:, -T - 1 : -1] * batch["completion_mask"]
    if not entropy:
        return log_probs
    H = torch_utils.chunked_entropy_from_logits(logits, requires_grad=True, attention_mask=attention_mask)
    return log_probs, H[:, -T - 1 : -1]


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


def _losses(new_logp, batch, args, mask, new_values=None, entropy=None):
    """The worker's loss on one micro-batch: the policy loss on reduction-scaled advantages (+ the KL loss for GRPO;
    - the entropy loss + vf_coef * the critic loss for PPO), each other term weighted by microbatch_weight."""
    _no_bias_correction(args)
    config = _config(args, "gspo" if args.get("importance_level") == "sequence" else "regular")
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    advantages = batch["advantages"]
    if args["script"] == "grpo":
        advantages = advantages[:, None].expand_as(new_logp)
    n, T = mask.shape
    whole = _minibatch_mask(mask.detach(), batch["num_seqs"], batch["num_tokens"])
    padded_advantages = torch.nn.functional.pad(advantages, (0, whole.shape[1] - T))
    padded_advantages = torch.cat([padded_advantages, torch.zeros(len(whole) - n, whole.shape[1])])
    scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        padded_advantages, whole, config.loss_reduction, n, args["max_new_tokens"]
    )[:n, :T]
    policy_loss = ppo_utils.PolicyLossRegistry.get(config.policy_loss_type)
    loss, _ = policy_loss(new_logp, old_logp, scaled, config, loss_mask=mask)
    microbatch_weight = n / batch["num_seqs"]
    if args["script"] == "grpo" and args["beta"] > 0:
        kl_loss = ppo_utils.compute_approx_kl(new_logp, batch["ref_logp"], loss_mask=mask, kl_estimator_type="k3")
        kl_loss = torch_utils.masked_mean(kl_loss, mask, dim=-1).mean()
        loss = loss + kl_loss * args["beta"] * microbatch_weight
    if args["script"] == "ppo" and args["ent_coef"] > 0:  # use_entropy_loss: the micro-batch's token mean
        loss = loss - torch_utils.masked_mean(entropy, mask) * args["ent_coef"] * microbatch_weight
    if args["script"] == "ppo" and args["vf_coef"] > 0:  # no critic: no value loss
        critic_loss, _ = ppo_utils.ppo_critic_loss(new_values, batch["values"], batch["returns"], config, mask)
        loss = loss + args["vf_coef"] * critic_loss * microbatch_weight
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


def loss(batch, args):
    mask = batch["completion_mask"]
    return _losses(batch["new_logp"], batch, args, mask, batch.get("new_values"), batch.get("entropy"))


def train_loss(model, batch, args, critic=None):
    out = token_logprobs(model, batch, args, entropy=args["script"] == "ppo" and args["ent_coef"] > 0)
    new_logp, entropy = out if isinstance(out, tuple) else (out, None)  # with the gradient: use_entropy_loss
    new_values = None
    if critic is not None:  # this project's critic: SkyRL's is its worker's model
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        T = batch["completion_ids"].shape[1]
        new_values = critic(input_ids, attention_mask)[:, -T - 1 : -1] * batch["completion_mask"]
    return _losses(new_logp, batch, args, batch["completion_mask"], new_values, entropy)
