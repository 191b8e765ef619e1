"""OpenRLHF 0.11.2's own advantage, reward, KL, log-prob and loss code as a verify.py adapter (GRPO and PPO).

    pip install --no-deps --target .openrlhf-site -r requirements/openrlhf.txt    # a folder of its own
    python verify.py DUMP --against openrlhf         # found in .openrlhf-site, or the folder $OPENRLHF_SITE names

What is called, unchanged (read in .openrlhf-site/openrlhf):
  advantages, returns  RemoteExperienceMaker.compute_advantages_and_returns (trainer/ppo_utils/experience_maker.py):
                       GRPO: estimator group_norm (or dr_grpo without the std), PPO: gae, with its whitening
  rewards              models/utils.py compute_reward (score at the last action-mask position, - kl_coef * kl)
  kl                   models/utils.py compute_approx_kl (k1, k2, k3)
  losses               models/loss.py PolicyLoss and ValueLoss, reduced by their aggregate_loss; GRPO adds
                       beta * aggregate_loss(compute_approx_kl(k3)) as its actor does (trainer/ray/ppo_actor.py)
  kl_coef              trainer/ppo_utils/kl_controller.py AdaptiveKLController.update, fed the summed KL of each
                       completion as ppo.py feeds its controller; --set controller_kl=mean feeds it as OpenRLHF's
                       ppo_trainer.py does (a known difference: --accept kl_coef)
  log-probs            models/actor.py Actor.forward around the model: its position ids, its shift, its
                       temperature and log_probs_from_logits (the gradient row's log-probs too)

OpenRLHF's package __init__ files import deepspeed, ray, vLLM and flash-attn; the modules above are loaded one
by one instead, with `deepspeed` (imported, unused, by models/utils.py), ray's launcher (imported by the
experience maker) and flash-attn (imported by models/ring_attn_utils.py, for packed samples only) stubbed while
they load. Nothing of OpenRLHF is copied here. The critic's values come from this project's critic (OpenRLHF's is
its engine's model); the PPO loss is policy + vf_coef * value loss (OpenRLHF trains its critic apart: its own
loss, unscaled). There is no `update`: OpenRLHF's optimizer is DeepSpeed's, not a function.
"""

import contextlib
import functools
import importlib
import os
import sys
import types

import torch

CHECKOUT_SITE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".openrlhf-site"
)
FLASH_ATTN = {  # what models/ring_attn_utils.py imports of flash-attn (used for packed samples only)
    "flash_attn": (),
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils": (),
    "flash_attn.utils.distributed": ("all_gather",),
}
PACKAGES = [
    "openrlhf",
    "openrlhf.models",
    "openrlhf.utils",
    "openrlhf.trainer",
    "openrlhf.trainer.ppo_utils",
    "openrlhf.trainer.ray",
]


@contextlib.contextmanager
def _stubbed(names):
    """Empty modules for `names` while OpenRLHF's files load, then sys.modules as it was for them."""
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    try:
        yield {name: sys.modules[name] for name in names}
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load():
    """OpenRLHF's modules, from $OPENRLHF_SITE when set, else the first of sys.path or .openrlhf-site holding it."""
    chosen = os.environ.get("OPENRLHF_SITE")
    candidates = [chosen] if chosen else [*sys.path, CHECKOUT_SITE]
    root = next((p for p in candidates if os.path.isfile(os.path.join(p, "openrlhf", "models", "loss.py"))), None)
    if root is None:
        raise ImportError(
            f"no openrlhf in {chosen if chosen else f'PYTHONPATH or {CHECKOUT_SITE}'}: pip install --no-deps "
            "--target .openrlhf-site -r requirements/openrlhf.txt"
        )
    for name in PACKAGES:  # namespace packages: their __init__ files (deepspeed, ray, vLLM) are not run
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split("."))]
            sys.modules[name] = package
    with _stubbed(["deepspeed", "ray", "openrlhf.trainer.ray.launcher", *FLASH_ATTN]) as stubs:
        stubs["openrlhf.trainer.ray.launcher"].RayActorGroup = object
        for name, attributes in FLASH_ATTN.items():
            for attribute in attributes:
                setattr(stubs[name], attribute, None)
        modules = [
            importlib.import_module(f"openrlhf.{m}")
            for m in (
                "models.utils",
                "models.loss",
                "models.actor",
                "trainer.ppo_utils.experience_maker",
                "trainer.ppo_utils.kl_controller",
            )
        ]
    return modules


utils, loss_module, actor_module, experience_maker, kl_controller = _load()
OPTIONS = {"controller_kl": "summed"}  # what AdaptiveKLController is fed: ppo.py's (summed) or OpenRLHF's (mean)


def _group(args):
    return args["group_size"] if args["script"] == "grpo" else args["samples_per_prompt"]


def known_differences(args, options):
    """{quantity: the difference, where it is in OpenRLHF, and how large it can be}: what --accept can take."""
    out = {}
    if args["script"] == "grpo" and args["scale_rewards"] == "group" and args["adv_eps"] != 1e-9:
        out["advantages"] = dict(
            why=f"group_norm divides by std + 1e-9, grpo.py by std + --adv-eps {args['adv_eps']:g} (a dump with "
            "--adv-eps 1e-9 matches); the relative difference is about adv_eps / the group's std",
            where="trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns",
            bound=("rel", max(100 * args["adv_eps"], 1e-5)),  # every group whose rewards differ: std > 100 * eps
        )
    if args["script"] == "ppo" and args["target_kl"] is not None and options["controller_kl"] == "mean":
        n = args["prompts_per_step"] * args["samples_per_prompt"]
        out["kl_coef"] = dict(
            why="OpenRLHF feeds AdaptiveKLController the mean over completions of each one's per-token mean KL, "
            "ppo.py the summed KL per completion (Ziegler et al. 2019); both errors are clipped to +-0.2, so the "
            "coefficients differ by at most 0.4 * N / kl_horizon (a controller bug smaller than that passes: "
            "check it with the default --set controller_kl=summed)",
            where="trainer/ppo_trainer.py, status['kl'] into kl_controller.py's update",
            bound=("rel", 0.4 * n / args["kl_horizon"]),
        )
    return out


def differences(args, options):
    out = [spec["why"] for spec in known_differences(args, options).values()]
    if args["script"] == "ppo" and args["target_kl"] is not None and options["controller_kl"] == "summed":
        out.append(
            "kl_coef: OpenRLHF's controller is fed the summed KL per completion, as ppo.py feeds its own; OpenRLHF's "
            "ppo_trainer.py feeds it the mean per-token KL (--set controller_kl=mean, then --accept kl_coef)"
        )
    if args["script"] == "ppo":
        if args["missing_eos_penalty"] > 0:
            out.append(
                "OpenRLHF has no subtractive missing-EOS penalty (its stop-properly penalty scales or replaces "
                "the score): the adapter subtracts --missing-eos-penalty from the score it passes to "
                "compute_reward"
            )
        out.append(
            "whitening: OpenRLHF takes rsqrt(max(var, 1e-8)), ppo.py rsqrt(var + --adv-eps): the same to 1e-8 / var"
        )
    out.append("OpenRLHF clamps the log-ratio to [-20, 20] and its KL estimates to [-10, 10]: only extreme ratios")
    return out


def _unsupported(args):
    if args["script"] != "grpo":
        return
    if args["importance_level"] == "sequence":
        raise NotImplementedError("OpenRLHF's GSPO forces a per-sample loss mean: not wired here")
    if args["beta"] > 0 and args["bias_corrected_kl"]:
        raise NotImplementedError(
            "OpenRLHF has no ratio-weighted k3 (--bias-corrected-kl; its unbiased_gradient "
            "is another estimator): make the dump with --no-bias-corrected-kl"
        )
    if args["loss_agg"] == "seq-mean-token-sum-norm":
        raise NotImplementedError("OpenRLHF aggregates by token mean or sample mean only")


def _maker(args, kl_coef):
    """A stand-in for RemoteExperienceMaker's `self`: only the fields compute_advantages_and_returns reads."""
    if args["script"] == "grpo":
        if args["scale_rewards"] == "batch":
            raise NotImplementedError("OpenRLHF's GRPO divides by the group's std or by nothing, never the batch's")
        estimator, gamma, lam = ("group_norm" if args["scale_rewards"] == "group" else "dr_grpo"), 1.0, 1.0
    else:
        estimator, gamma, lam = "gae", args["gamma"], args["lam"]
    config = types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(estimator=estimator, gamma=gamma, lambd=lam, no_std_norm=False)
        ),
        rollout=types.SimpleNamespace(n_samples_per_prompt=_group(args)),
        reward=types.SimpleNamespace(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None),
    )
    maker = types.SimpleNamespace(
        strategy=types.SimpleNamespace(args=config),
        advantage_estimator=estimator,
        kl_ctl=types.SimpleNamespace(value=kl_coef),
    )
    cls = experience_maker.RemoteExperienceMaker
    maker.get_advantages_and_returns = functools.partial(cls.get_advantages_and_returns, maker)
    maker.get_cumulative_returns = functools.partial(cls.get_cumulative_returns, maker)
    return maker


def _advantages(batch, args, scores, kl, kl_coef, token_rewards=None):
    """compute_advantages_and_returns on one experience; `token_rewards` replaces compute_reward's result."""
    mask = batch["completion_mask"]
    experience = types.SimpleNamespace(
        rewards=scores.clone(),
        index=list(range(len(mask))),
        kl=kl,
        action_mask=mask,
        values=batch.get("values"),
        info={},
    )
    compute_reward = experience_maker.compute_reward
    if token_rewards is not None:
        experience_maker.compute_reward = lambda *a, **k: token_rewards
    try:
        experience_maker.RemoteExperienceMaker.compute_advantages_and_returns(_maker(args, kl_coef), [experience])
    finally:
        experience_maker.compute_reward = compute_reward
    return experience.advantages, experience.returns


def group_advantages(batch, args):
    mask = batch["completion_mask"]
    return _advantages(batch, args, batch["rewards"], torch.zeros(mask.shape), 0.0)[0]  # [N, T]


def gae(batch, args):
    mask = batch["completion_mask"]
    return _advantages(batch, args, torch.zeros(len(mask)), torch.zeros(mask.shape), 0.0, batch["rewards"])


def rewards(batch, args):
    mask = batch["completion_mask"]
    outcome = batch["token_scores"].sum(1)
    if (batch["token_scores"] != 0).sum(1).gt(1).any():
        raise NotImplementedError("OpenRLHF's compute_reward takes one score per completion, not a dense reward")
    has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)
    score = outcome - args["missing_eos_penalty"] * (~has_eos).float()  # see differences()
    kl = utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], kl_estimator=args["kl_estimator"])
    return utils.compute_reward(score, batch["kl_coef"].item(), kl, action_mask=mask)


def setup(args, options, model):
    if options["controller_kl"] not in ("summed", "mean"):
        raise NotImplementedError(f"--set controller_kl={options['controller_kl']}: summed or mean")
    state["options"] = options


state = {}


def kl_coef(batch, args):
    """AdaptiveKLController.update fed the summed k1 KL of each completion (ppo.py's), or the per-token mean of the
    penalty's KL as ppo_trainer.py feeds it (--set controller_kl=mean)."""
    if state["options"]["controller_kl"] == "summed":
        kl = utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], kl_estimator="k1")
        per_completion = (kl * batch["completion_mask"]).sum(-1)
    else:
        kl = utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], kl_estimator=args["kl_estimator"])
        per_completion = utils.masked_mean(kl, batch["completion_mask"], dim=-1)  # experience_maker: info["kl"]
    controller = kl_controller.AdaptiveKLController(batch["kl_coef"].item(), args["target_kl"], args["kl_horizon"])
    controller.update(per_completion.mean().item(), len(per_completion))
    return torch.tensor(controller.value)


def kl(batch, args):
    _unsupported(args)
    if args["script"] == "ppo":
        return utils.compute_approx_kl(batch["old_logp"], batch["ref_logp"], kl_estimator=args["kl_estimator"])
    return utils.compute_approx_kl(batch["new_logp"], batch["ref_logp"], kl_estimator="k3")


def token_logprobs(model, batch, args):
    """Actor.forward around the model (Actor takes a module as its pretrain_or_model)."""
    actor = actor_module.Actor(model, temperature=args["temperature"])
    actor.packing_samples = False  # Actor.__init__ sets it only when it loads the model itself, from a path
    sequences = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return actor(sequences, action_mask=batch["completion_mask"], attention_mask=attention_mask)


def _losses(new_logp, batch, args, mask, new_values=None, denominators=None):
    """The actor's loss (+ beta * KL loss for GRPO, + vf_coef * value loss for PPO), reduced as OpenRLHF does."""
    _unsupported(args)
    token_level = args["script"] == "ppo" or args["loss_agg"] == "token-mean"
    reduce = denominators or dict(batch_num_tokens=batch["num_tokens"], global_batch_size=batch["num_seqs"])
    policy_loss = loss_module.PolicyLoss(args["clip_low"], args["clip_high"], token_level_loss=token_level)
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    advantages = batch["advantages"]
    if args["script"] == "grpo":
        advantages = advantages[:, None].expand_as(new_logp)
    total = policy_loss(new_logp, old_logp, advantages, action_mask=mask, **reduce)[0]
    if args["script"] == "grpo" and args["beta"] > 0:
        k3 = utils.compute_approx_kl(new_logp, batch["ref_logp"], log_probs_old=old_logp, kl_estimator="k3")
        total = total + args["beta"] * loss_module.aggregate_loss(k3, mask, token_level, **reduce)
    if args["script"] == "ppo":
        value_loss = loss_module.ValueLoss(clip_eps=args["cliprange_value"], token_level_loss=True)
        total = total + args["vf_coef"] * value_loss(new_values, batch["values"], batch["returns"], mask, **reduce)
    return total


def per_token_loss(batch, args):
    """d(sum_t m_t L_t) / d m_t = L_t: the token-level reduction's gradient with respect to the mask."""
    mask = batch["completion_mask"].float().requires_grad_(True)
    token_sum = _losses(
        batch["new_logp"],
        dict(batch, num_tokens=1),
        dict(args, loss_agg="token-mean"),
        mask,
        batch.get("new_values"),
        dict(batch_num_tokens=1),
    )
    (per_token,) = torch.autograd.grad(token_sum, mask)
    return per_token


def loss(batch, args):
    return _losses(batch["new_logp"], batch, args, batch["completion_mask"], batch.get("new_values"))


def train_loss(model, batch, args, critic=None):
    new_logp = token_logprobs(model, batch, args)
    new_values = None
    if critic is not None:  # this project's critic: OpenRLHF's is its engine's model
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        T = batch["completion_ids"].shape[1]
        new_values = critic(input_ids, attention_mask)[:, -T - 1 : -1] * batch["completion_mask"]
    return _losses(new_logp, batch, args, batch["completion_mask"], new_values)
