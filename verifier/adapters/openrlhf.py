"""OpenRLHF 0.11.2's own advantage, reward, KL, log-prob and training-step code as a verify.py adapter (GRPO, PPO).

    pip install --no-deps --target .openrlhf-site -r requirements/openrlhf.txt    # a folder of its own
    python verify.py DUMP --against openrlhf         # found in .openrlhf-site, or the folder $OPENRLHF_SITE names

What is called, unchanged (read in .openrlhf-site/openrlhf):
  advantages, returns  trainer/ppo_utils/experience_maker.py RemoteExperienceMaker.compute_advantages_and_returns
                       (GRPO: group_norm, or dr_grpo without the std; PPO: gae, with its whitening)
  rewards, kl          models/utils.py compute_reward (score at the last action-mask position) and compute_approx_kl
  losses               trainer/ray/ppo_actor.py ActorPPOTrainer.training_step (policy loss + kl_ctl * KL as a token
                       mean - entropy_coef * entropy) and ppo_critic.py CriticPPOTrainer.training_step (value loss),
                       on a stand-in `self` whose strategy keeps the loss it is handed to backpropagate
  kl_coef              trainer/ppo_utils/kl_controller.py AdaptiveKLController.update, fed the summed KL of each
                       completion as ppo.py feeds its own; --set controller_kl=mean as ppo_trainer.py feeds it
  log-probs            models/actor.py Actor.forward around the model (the gradient row's log-probs too)

OpenRLHF's package __init__ files import deepspeed, ray, vLLM and flash-attn; the modules above are loaded one by
one instead, with what they import for their engines stubbed while they load. Nothing of OpenRLHF is copied here.
The critic's values come from this project's critic (OpenRLHF's is its engine's model); the PPO loss is the actor's
+ vf_coef * the critic's (OpenRLHF steps its critic apart, on its loss unscaled). There is no `update`: OpenRLHF's
optimizer is DeepSpeed's engine, not a function.
"""

import functools
import types

import torch

import grpo
import ppo
from verifier import openrlhf_site
from verifier.expect import floored_whiten, ours, with_args

(utils, loss_module, actor_module, experience_maker, kl_controller, loss_utils, experience, ppo_actor, ppo_critic) = (
    openrlhf_site.load()
)
OPTIONS = {"controller_kl": "summed"}  # what AdaptiveKLController is fed: ppo.py's (summed) or OpenRLHF's (mean)


def _group(args):
    return args["group_size"] if args["script"] == "grpo" else args["samples_per_prompt"]


def known_differences(args, options):
    """{quantity: the difference, where it is in OpenRLHF, and what OpenRLHF must give by design (an expectation
    computed with this project's code, compared at the row's tolerance)}: what --accept takes."""
    out = {}
    if args["script"] == "grpo" and args["scale_rewards"] == "group" and args["adv_eps"] != 1e-9:
        out["advantages"] = dict(
            why=f"group_norm divides by std + 1e-9, grpo.py by std + --adv-eps {args['adv_eps']:g} (a dump with "
            "--adv-eps 1e-9 matches)",
            where="trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns",
            expect=with_args(ours().group_advantages, adv_eps=1e-9),
        )
    if args["script"] == "ppo":
        out["advantages"] = dict(
            why="OpenRLHF whitens GAE's advantages by rsqrt(max(var, 1e-8)), ppo.py by rsqrt(var + --adv-eps): they "
            "differ by about adv_eps / var, visible where the advantages' variance is small",
            where="trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns (masked whitening)",
            expect=_floored_whitening,
        )
    if args["script"] == "ppo" and args["target_kl"] is not None and options["controller_kl"] == "mean":
        out["kl_coef"] = dict(
            why="OpenRLHF feeds AdaptiveKLController the mean over completions of each one's per-token mean KL, "
            "ppo.py the summed KL per completion (Ziegler et al. 2019)",
            where="trainer/ppo_trainer.py, status['kl'] into kl_controller.py's update",
            expect=_mean_kl_controller,
        )
    if args["script"] == "grpo" and args["beta"] > 0 and args["loss_agg"] != "token-mean":
        why = (
            "OpenRLHF adds its GRPO KL term as a token mean whatever --actor.loss_agg_mode says (its loss_batch_info "
            f"carries no token_level_loss), grpo.py aggregates it by --loss-agg {args['loss_agg']} like the policy "
            "loss; the per-token loss agrees (a dump with --loss-agg token-mean, OpenRLHF's default, matches)"
        )
        where = "trainer/ray/ppo_actor.py, training_step: aggregate_loss(kl, action_mask, **loss_batch_info)"
        out["loss"] = dict(why=why, where=where, expect=_kl_token_mean_loss)
        out["gradient"] = dict(why=why, where=where, expect=_kl_token_mean_train_loss)
    return out


def _floored_whitening(batch, args):
    """This project's GAE advantages whitened as OpenRLHF whitens them: (x - mean) * rsqrt(max(var, 1e-8))."""
    mask = batch["completion_mask"]
    advantages, _ = ppo.compute_gae(batch["rewards"], batch["values"], mask, args["gamma"], args["lam"])
    return floored_whiten(advantages, mask, 1e-8)


def _kl_token_mean(outputs, batch, args):
    """grpo.py's loss with its KL term aggregated by token mean whatever --loss-agg (OpenRLHF's GRPO)."""
    loss, _ = grpo.compute_loss(outputs, batch, types.SimpleNamespace(**args))
    log_r = batch["ref_logp"] - outputs["new_logp"]
    kl, mask = args["beta"] * (torch.exp(log_r) - 1 - log_r), batch["completion_mask"]
    counts, agg = (batch["num_seqs"], batch["num_tokens"], args["max_new_tokens"]), grpo.aggregate_loss
    return loss - agg(kl, mask, args["loss_agg"], *counts) + agg(kl, mask, "token-mean", *counts)


def _kl_token_mean_loss(batch, args):
    return _kl_token_mean({"new_logp": batch["new_logp"]}, {k: v for k, v in batch.items() if k != "new_logp"}, args)


def _kl_token_mean_train_loss(model, batch, args, critic=None):
    return _kl_token_mean(ours().outputs(model, batch, args), batch, args)


def _mean_kl_controller(batch, args):
    """ppo.py's controller fed the mean over completions of each one's per-token mean KL (OpenRLHF's feed)."""
    mask, kl = batch["completion_mask"], ours().rewards_kl(batch, args)
    per_token = ((kl * mask).sum(1) / mask.sum(1).clamp(min=1)).mean().item()
    coef = ppo.adaptive_kl_coef(float(batch["kl_coef"]), per_token, args["target_kl"], len(mask), args["kl_horizon"])
    return torch.tensor(coef)


def written_out(args, options):
    """OpenRLHF's pieces this adapter writes out itself (every PASS line names them): a bug there would not show."""
    out = []
    if args["script"] == "ppo":
        out.append(
            "CriticModel.forward (models/model.py): this project's critic's values, sliced as OpenRLHF slices them"
        )
        if args["target_kl"] is not None:
            out.append("the trainer's feed into AdaptiveKLController (ppo_trainer.py): the adapter computes the KL")
    return out


def differences(args, options):
    out = list(dict.fromkeys(spec["why"] for spec in known_differences(args, options).values()))
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


class _Strategy:
    """The strategy training_step calls: its backward keeps the loss (verify backpropagates it), no step."""

    ring_attn_group = None

    gas = 1  # the step's micro-batches: DeepSpeed's engine scales each backward by 1 / gas

    def backward(self, loss, model, optimizer):
        self.loss = loss / self.gas

    def optimizer_step(self, *args, **kwargs):
        pass

    def get_grad_norm(self, model):
        return 0.0


class _Stored(torch.nn.Module):
    """An actor (or critic) that returns the dump's stored outputs, in OpenRLHF's (values, output) form."""

    def __init__(self, values, entropy=None):
        super().__init__()
        self.values, self.entropy = values, entropy

    def forward(self, *args, **kwargs):
        return self.values, types.SimpleNamespace(entropy=self.entropy)


class _Critic(torch.nn.Module):
    """This project's critic in the form OpenRLHF's critic trainer calls (OpenRLHF's is its engine's model)."""

    def __init__(self, critic):
        super().__init__()
        self.critic = critic

    def forward(self, sequences, action_mask=None, attention_mask=None, **kwargs):
        T = action_mask.shape[1]
        return self.critic(sequences, attention_mask)[:, -T - 1 : -1] * action_mask, None


def _training_steps(args, batch, mask, actor, critic=None, token_level=None):
    """The loss OpenRLHF backpropagates for this batch: ActorPPOTrainer.training_step's (trainer/ray/ppo_actor.py:
    policy loss + kl_ctl * aggregate_loss(kl) - entropy_coef * aggregate_loss(entropy)) and, for PPO, vf_coef *
    CriticPPOTrainer.training_step's value loss (ppo_critic.py). Both run as OpenRLHF's code is, on a stand-in
    `self` that holds only what they read; `mask` is the action mask (a float with a gradient for per_token_loss)."""
    _unsupported(args)
    grpo = args["script"] == "grpo"
    if token_level is None:
        token_level = not grpo or args["loss_agg"] == "token-mean"  # OpenRLHF's --actor.loss_agg_mode
    strategy = _Strategy()
    config = types.SimpleNamespace(
        algo=types.SimpleNamespace(
            kl=types.SimpleNamespace(
                use_loss=grpo, init_coef=args.get("beta", 0.0), estimator="k3", unbiased_gradient=False
            )
        ),
        actor=types.SimpleNamespace(entropy_coef=(args.get("ent_coef") or None), aux_loss_coef=0.0),
        train=types.SimpleNamespace(dynamic_batch_enable=False),
    )
    trainer = types.SimpleNamespace(
        args=config,
        strategy=strategy,
        actor=actor,
        actor_optim=None,
        actor_loss_fn=loss_module.PolicyLoss(args["clip_low"], args["clip_high"], token_level_loss=token_level),
        aux_loss=False,
        ema_model=None,
        actor_scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]),
        replay_buffer=None,
    )
    new_logp = getattr(actor, "values", None)  # the stored log-probs, where there are
    old_logp = batch["old_logp"] if not grpo or args["num_iterations"] > 1 else None
    advantages = batch["advantages"][:, None].expand_as(mask) if grpo else batch["advantages"]
    step = experience.Experience(
        sequences=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        action_mask=mask,
        action_log_probs=old_logp,
        base_action_log_probs=batch.get("ref_logp"),
        advantages=advantages,
        values=batch.get("values"),
        returns=batch.get("returns"),
    )
    if old_logp is None:  # one iteration: the sampling policy is the current one (ratio 1)
        if new_logp is None:
            with torch.no_grad():
                new_logp = actor(step.sequences, mask.detach(), attention_mask=step.attention_mask)
        step.action_log_probs = new_logp.detach()
    # OpenRLHF's own step normaliser over the step's masks: the step's tokens laid row by row, then empty windows
    strategy.gas = gas = max(round(batch["num_seqs"] / len(mask)), 1)
    step_mask = torch.zeros(int(batch["num_seqs"]), -(-int(batch["num_tokens"]) // int(batch["num_seqs"])))
    token = torch.arange(int(batch["num_tokens"]))
    step_mask[token % len(step_mask), token // len(step_mask)] = 1
    masks = [step_mask] + [torch.zeros(1, 1)] * (gas - 1)  # empty windows: no token, no sequence
    info = loss_utils._optimizer_step_loss_norm(masks, None, 1, gas)
    kl_ctl = args.get("beta", 0.0) if grpo else 0.0  # PPO's KL is in the reward (compute_reward), not the loss
    ppo_actor.ActorPPOTrainer.training_step(trainer, step, kl_ctl, 0, dict(info))
    total = strategy.loss
    if critic is not None:
        trainer = types.SimpleNamespace(
            args=config,
            strategy=strategy,
            critic=critic,
            critic_optim=None,
            critic_loss_fn=loss_module.ValueLoss(args["cliprange_value"]),
            aux_loss=False,
            critic_scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]),
            replay_buffer=None,
        )
        ppo_critic.CriticPPOTrainer.training_step(trainer, step, 0, dict(info))
        total = total + args["vf_coef"] * strategy.loss  # OpenRLHF steps the critic apart, on its loss unscaled
    return total


def _stored(batch, args):
    entropy = batch.get("entropy")
    return _Stored(batch["new_logp"], entropy), (_Stored(batch["new_values"]) if args["script"] == "ppo" else None)


def per_token_loss(batch, args):
    """d(sum_t m_t L_t) / d m_t = L_t: the token-level reduction's gradient with respect to the mask."""
    mask = batch["completion_mask"].float().requires_grad_(True)
    actor, critic = _stored(batch, args)
    token_sum = _training_steps(args, dict(batch, num_tokens=1), mask, actor, critic, token_level=True)
    (per_token,) = torch.autograd.grad(token_sum, mask)
    return per_token


def loss(batch, args):
    return _training_steps(args, batch, batch["completion_mask"], *_stored(batch, args))


def train_loss(model, batch, args, critic=None):
    actor = actor_module.Actor(model, temperature=args["temperature"])
    actor.packing_samples = False  # Actor.__init__ sets it only when it loads the model itself, from a path
    return _training_steps(args, batch, batch["completion_mask"], actor, critic and _Critic(critic))
