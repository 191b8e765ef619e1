"""verl 0.9.1's pure advantage, KL and loss functions (verl/trainer/ppo/core_algos.py) as a verify.py adapter.

    pip install --no-deps --target .verl-site -r requirements/verl.txt    # a folder of its own
    PYTHONPATH=.verl-site python verify.py DUMP --against verl    # verl's own imports need its folder

The functions are pure torch, but importing core_algos runs verl's package __init__ (its DataProto imports ray
and tensordict) and its config dataclasses (omegaconf, codetiming); a stub package in place of verl's __init__
still needs ray, through verl.utils. requirements/verl.txt lists verl and exactly what that import needs,
installed without their dependencies into .verl-site, so that verl's pins (transformers<5.11) never touch this
project's environment and nothing else of it is installed. Nothing of verl is copied here.

The losses are composed as verl's actor composes them (verl/workers/utils/losses.py: policy loss + kl_loss_coef
* agg_loss(kl_penalty(..., "low_var_kl")); critic: compute_value_loss). verl returns only aggregates: its
per-token loss is read as the gradient of its "token-sum" aggregate with respect to the mask. Log-probs use
verl's position ids (compute_position_id_with_mask) and logprobs_from_logits on logits / temperature, as
its actor does. There is no `update`: verl's optimizer is its engine's, not a function.
"""

import numpy as np
import torch

import ppo
from verifier.expect import unbiased_whiten

try:
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as verl_F
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.config import ActorConfig
except ImportError as e:
    raise ImportError(f"{e.msg}: verl is not importable (adapters/verl.py: PYTHONPATH=.verl-site)") from None

# verl's defaults: GRPO's eps 1e-6 (grpo.py: 1e-4); seq-mean-token-sum-norm divides by the padded width
# unless loss_scale_factor is set (grpo.py: max_new_tokens).
OPTIONS = {"epsilon": 1e-6, "loss_scale_factor": 0}
KL_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
options = dict(OPTIONS)


def setup(args, chosen, model):
    options.update(chosen)


def known_differences(args, chosen):
    """{quantity: the difference, where it is in verl, and what verl must give by design}: what --accept takes."""
    if args["script"] != "ppo":
        return {}
    return {
        "advantages": dict(
            why="verl whitens GAE's advantages with the unbiased variance (times N / (N - 1) over N real tokens) "
            "and eps 1e-8, ppo.py with the population variance and --adv-eps",
            where="verl/utils/torch_functional.py, masked_whiten (var * N / (N - 1))",
            expect=_unbiased_advantages,
        )
    }


def _unbiased_advantages(batch, args):
    """This project's GAE, whitened as verl whitens it: the expectation of the advantages row."""
    mask = batch["completion_mask"]
    advantages, _ = ppo.compute_gae(batch["rewards"], batch["values"], mask, args["gamma"], args["lam"])
    return unbiased_whiten(advantages, mask, 1e-8)


def written_out(args, chosen):
    """verl's pieces this adapter writes out itself (every PASS line names them): a bug there would not show."""
    return [
        "verl's engine's temperature scaling and log-prob gather (verl/workers/engine): the adapter divides the "
        "logits by the temperature itself before verl_F.logprobs_from_logits",
        "losses.ppo_loss's composition (verl/workers/utils/losses.py): the adapter adds verl's core_algos terms "
        "as ppo_loss does (tests/test_verify_assembly.py compares the two)",
    ]


def differences(args, chosen):
    out = []
    if args["script"] == "grpo" and args["scale_rewards"] == "group" and chosen["epsilon"] != 1e-4:
        out.append(
            f"GRPO advantages: verl divides by std + {chosen['epsilon']:g}, grpo.py by std + 1e-4 "
            "(--set epsilon=1e-4 matches)"
        )
    if args["script"] == "ppo":
        out.append(known_differences(args, chosen)["advantages"]["why"] + " (--accept advantages)")
        out.append("verl carries values across masked holes in GAE (dumps have none)")
    if args.get("loss_agg") == "seq-mean-token-sum-norm" and not chosen["loss_scale_factor"]:
        out.append(
            "seq-mean-token-sum-norm: verl divides by the padded width T, grpo.py by --max-new-tokens "
            f"({args['max_new_tokens']}): they agree only when a completion reaches it "
            f"(--set loss_scale_factor={args['max_new_tokens']} matches)"
        )
    if args.get("loss_agg", "").startswith("seq-mean"):
        out.append(
            "seq-mean aggregations: verl averages over non-empty sequences, grpo.py over all (the same "
            "unless a completion has no token)"
        )
    out.append(
        "verl's dual-clip (clip_ratio_c 3, for negative advantages) and its k3 clamp to [-10, 10] act "
        "only on extreme ratios"
    )
    return out


def _config(args, batch):
    """verl's actor config for this run, with the batch's global denominators (as its ppo_loss sets them)."""
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=args.get("group_size", 1),
        use_dynamic_bsz=True,
        clip_ratio_low=args["clip_low"],
        clip_ratio_high=args["clip_high"],
    )
    config.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=batch["num_tokens"],
        global_batch_size=batch["num_seqs"],
        loss_scale_factor=options["loss_scale_factor"] or None,
    )
    return config


def _no_bias_correction(args):
    if args["script"] == "grpo" and args["beta"] > 0 and args.get("bias_corrected_kl"):
        raise NotImplementedError("verl has no ratio-weighted k3 (--bias-corrected-kl); its k3+ is another one")


def group_advantages(batch, args):
    if args["scale_rewards"] == "batch":
        raise NotImplementedError("verl's GRPO divides by the group's std or by nothing, never the batch's")
    mask = batch["completion_mask"]
    rewards = batch["rewards"][:, None] * (torch.arange(mask.shape[1]) == 0)  # [N, T]: verl sums each row
    index = np.arange(len(mask)) // args["group_size"]  # the group of each completion
    scale = args["scale_rewards"] != "none"
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        rewards, mask, index, epsilon=options["epsilon"], norm_adv_by_std_in_grpo=scale
    )
    return advantages


def gae(batch, args):
    return core_algos.compute_gae_advantage_return(
        batch["rewards"], batch["values"], batch["completion_mask"], args["gamma"], args["lam"]
    )


def token_logprobs(model, batch, args, entropy=False):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=False,
        position_ids=compute_position_id_with_mask(attention_mask),
    ).logits
    logits = logits[:, -T - 1 : -1].float() / args["temperature"]
    logp = verl_F.logprobs_from_logits(logits, batch["completion_ids"]) * batch["completion_mask"]
    return (logp, verl_F.entropy_from_logits(logits)) if entropy else logp


def kl(batch, args):
    _no_bias_correction(args)
    if args["script"] == "ppo":
        return core_algos.kl_penalty(batch["old_logp"], batch["ref_logp"], KL_TYPES[args["kl_estimator"]])
    return core_algos.kl_penalty(batch["new_logp"], batch["ref_logp"], "low_var_kl")


def _losses(new_logp, batch, args, agg, mask, new_values=None, entropy=None):
    """verl's policy loss (+ beta * KL loss for GRPO; - ent_coef * entropy + vf_coef * value loss for PPO), aggregated
    by `agg`, composed as verl/workers/utils/losses.py's ppo_loss composes them (tests/test_verify_assembly.py)."""
    _no_bias_correction(args)
    config = _config(args, batch)
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    policy_loss = (
        core_algos.compute_policy_loss_gspo
        if args.get("importance_level") == "sequence"
        else core_algos.compute_policy_loss_vanilla
    )
    advantages = batch["advantages"]
    if args["script"] == "grpo":
        advantages = advantages[:, None].expand_as(mask)
    loss, _ = policy_loss(old_logp, new_logp, advantages, mask, agg, config)
    if args["script"] == "grpo" and args["beta"] > 0:
        kld = core_algos.kl_penalty(new_logp, batch["ref_logp"], "low_var_kl")
        loss = loss + args["beta"] * core_algos.agg_loss(kld, mask, agg, **config.global_batch_info)
    if args["script"] == "ppo" and args["ent_coef"] > 0:
        entropy_loss = core_algos.agg_loss(entropy, mask, agg, **config.global_batch_info)
        loss = loss - args["ent_coef"] * entropy_loss
    if args["script"] == "ppo":
        v_loss, _ = core_algos.compute_value_loss(
            new_values,
            batch["returns"],
            batch["values"],
            mask,
            args["cliprange_value"],
            agg,
            **config.global_batch_info,
        )
        loss = loss + args["vf_coef"] * v_loss
    return loss


def per_token_loss(batch, args):
    mask = batch["completion_mask"].float().requires_grad_(True)
    token_sum = _losses(
        batch["new_logp"], batch, args, "token-sum", mask, batch.get("new_values"), batch.get("entropy")
    )
    (per_token,) = torch.autograd.grad(token_sum, mask)  # d(sum_t m_t L_t) / d m_t = L_t
    return per_token


def _agg(args):
    return "token-mean" if args["script"] == "ppo" else args["loss_agg"]


def loss(batch, args):
    mask = batch["completion_mask"]
    return _losses(batch["new_logp"], batch, args, _agg(args), mask, batch.get("new_values"), batch.get("entropy"))


def train_loss(model, batch, args, critic=None):
    new_logp, entropy = token_logprobs(model, batch, args, entropy=True)
    new_values = None
    if critic is not None:  # the values come from this project's critic: verl's is its engine's model
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        T = batch["completion_ids"].shape[1]
        new_values = critic(input_ids, attention_mask)[:, -T - 1 : -1] * batch["completion_mask"]
    return _losses(new_logp, batch, args, _agg(args), batch["completion_mask"], new_values, entropy)
