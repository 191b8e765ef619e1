"""AReaL 1.0.4's own advantage, reward, KL and loss code as a verify.py adapter (GRPO and PPO).

    pip install --no-deps --target .areal-site -r requirements/areal.txt    # a folder of its own
    python verify.py DUMP --against areal           # found in .areal-site, or the folder $AREAL_SITE names

What is called, unchanged (read in .areal-site/areal):
  advantages, returns,  PPOActor._compute_advantages (trainer/ppo/actor.py) on the batch laid out as AReaL lays it
  rewards               out (each prompt and completion right-padded, log-probs rolled by one): the score at the
                        last token, - kl_ctl * KLEstimator(k1, k2, k3) on every token, GAE (GRPO: gamma = lambda =
                        1 and no critic, so each token's advantage is the score) and its Normalization (adv_norm:
                        GRPO the group's mean and the group's or the batch's std, PPO the batch's mean and std)
  kl                    utils/data.py KLEstimator (functional.py's masked_normalization is called by no trainer path
                        of 1.0.4: adv_norm is utils/data.py's Normalization)
  losses                grpo_loss_fn (trainer/ppo/actor.py), the actor's loss function, around ppo_actor_loss_fn
                        (utils/functional/functional.py: token or GSPO's sequence ratio), scaled by the engine's
                        loss_weight_fn share (engine/fsdp_engine.py: local weight / total weight, the micro-batch's
                        tokens over the minibatch's); PPO: + vf_coef * ppo_critic_loss_fn, scaled the same way
  log-probs             the engine's (engine/fsdp_engine.py): the batch in AReaL's right-padded layout,
                        utils/data.py amend_position_ids, the labels rolled by one, utils/functional/vocab_parallel.py
                        gather_logprobs on logits / temperature (the gradient row's log-probs too)

AReaL's package __init__ files import its inference and training engines; the modules above are loaded one by
one instead. Stand-ins, while they load, for what they import and these calls never use: areal.api and
areal.api.cli_args (engine and config classes, annotations), areal.infra and the experimental controller (the
controller classes actor.py defines beside PPOActor), areal.utils.logging (colorlog), stats_tracker and perf_tracer
(logging of statistics: no-ops), seqpack (numba), einops and torchdata (imported by utils/data.py for its other
functions); areal.infra.platforms says is_npu_available, so vocab_parallel.py gathers eagerly rather than under
torch.compile (its NPU path: the same function, uncompiled). Nothing of AReaL is copied here. AReaL has no KL term
in the loss (kl_ctl puts it in the reward), one loss aggregation (the token mean), no entropy bonus (grpo_loss_fn
detaches the entropy: a dump with --ent-coef > 0 leaves the loss rows not compared) and no adaptive KL controller;
its critic's values come from this project's critic. There is no `update`: AReaL's optimizer is its engine's.
"""

import contextlib
import os
import sys
import types

import torch

from verifier import peer_site

PACKAGES = ["areal", "areal.utils", "areal.utils.functional", "areal.trainer", "areal.trainer.ppo"]
STUBS = [
    "areal.api",
    "areal.api.cli_args",
    "areal.infra",
    "areal.infra.platforms",
    "areal.infra.rpc",
    "areal.infra.rpc.serialization",
    "areal.experimental",
    "areal.experimental.training_service",
    "areal.experimental.training_service.controller",
    "areal.experimental.training_service.controller.controller",
    "areal.utils.logging",
    "areal.utils.stats_tracker",
    "areal.utils.perf_tracer",
    "areal.utils.seqpack",
    "einops",
    "torchdata",
    "torchdata.stateful_dataloader",
]


def _nothing(*args, **kwargs):
    """A logging call of AReaL's (stats_tracker): it records statistics, never the loss."""


def _identity_decorator(*args, **kwargs):
    return lambda fn: fn


@contextlib.contextmanager
def _scope(*args, **kwargs):
    yield


def _stub(module):
    """What each stand-in offers: names that are annotations, base classes or logging."""
    name = module.__name__
    if name == "areal.utils.logging":
        module.getLogger = lambda *a, **k: types.SimpleNamespace(info=_nothing, warning=_nothing, debug=_nothing)
    elif name == "areal.utils.stats_tracker":
        module.__getattr__ = lambda attribute: _nothing
        module.scope_func_wrapper, module.scope = _identity_decorator, _scope
    elif name == "areal.utils.perf_tracer":
        module.trace_perf = _identity_decorator
    elif name == "areal.infra.platforms":
        # True: vocab_parallel.py's log-prob gather runs eagerly, not under torch.compile (a speed choice only)
        module.current_platform, module.is_npu_available = None, True
    else:  # classes and helpers imported by name and never called here
        module.__getattr__ = lambda attribute: type(attribute, (), {})


def _load():
    """AReaL's actor and functional modules, from $AREAL_SITE when set, else sys.path or .areal-site."""
    root = peer_site.find(
        "areal",
        os.path.join("trainer", "ppo", "actor.py"),
        "pip install --no-deps --target .areal-site -r requirements/areal.txt",
    )
    before = set(sys.modules)
    saved = {name: sys.modules.get(name) for name in PACKAGES}
    for name in PACKAGES:  # namespace packages: their __init__ files (engines, vLLM, ray) are not run
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    try:
        with peer_site.stubbed(STUBS, fill=_stub):
            functional = __import__("areal.utils.functional.functional", fromlist=["*"])
            sys.modules["areal.utils.functional"].__dict__.update(
                {k: v for k, v in vars(functional).items() if not k.startswith("__")}
            )  # what the package's __init__ re-exports (its vocab_parallel import needs the platforms)
            actor = __import__("areal.trainer.ppo.actor", fromlist=["*"])
            data = sys.modules["areal.utils.data"]
            vocab = __import__("areal.utils.functional.vocab_parallel", fromlist=["*"])
    finally:  # AReaL's modules stay loaded under this adapter's names; sys.modules is as it was
        for name in set(sys.modules) - before:
            if name.startswith("areal"):
                sys.modules.pop(name, None)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return actor, functional, data, vocab


actor, functional, data, vocab = _load()
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


def known_differences(args, options):
    """{quantity: the difference, where it is in AReaL, and how large it can be}: what --accept can take."""
    out = {}
    if args["script"] == "grpo":
        out["advantages"] = dict(
            why="AReaL normalises the advantages over tokens (adv_norm on each token's return, masked by the loss "
            "mask): a group's mean (and std) weigh each completion by its length, grpo.py's by one; the same when a "
            "group's completions are equally long, and grows with how unequal they are: the bound is the one measured "
            "on verify.py's recommended dump (rel 5e-02) with a margin; a dump whose groups differ more in length "
            "fails it, showing the size",
            where="areal/trainer/ppo/actor.py, PPOActor._compute_advantages (self.adv_norm(advantages, loss_mask))",
            bound=("rel", 0.1),
        )
    if args["script"] == "ppo":
        n = args["prompts_per_step"] * args["samples_per_prompt"]  # the fewest real tokens a batch can have
        out["advantages"] = dict(  # 1 - sqrt(1 - 1 / N) <= 1 - sqrt(1 - 1 / n); the eps terms for a std >= 1e-2
            why="AReaL whitens GAE's advantages as (A - mean) / (std + 1e-5) with the unbiased std, ppo.py as "
            "(A - mean) * rsqrt(var + --adv-eps) with the population variance: a factor sqrt(1 - 1 / N) over N real "
            "tokens (at least the n completions), 1e-5 / std and adv_eps / (2 var) (1e-3 and 5e3 adv_eps for a std "
            "of 1e-2)",
            where="areal/utils/data.py, Normalization (std_unbiased=True, eps=1e-5)",
            bound=("rel", 1 - (1 - 1 / n) ** 0.5 + 1e-3 + 5e3 * args["adv_eps"]),
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


def _losses(new_logp, batch, args, new_values=None):
    """grpo_loss_fn on the micro-batch, weighted as the engine weighs it (its tokens over the minibatch's); PPO adds
    vf_coef * the critic's ppo_critic_loss_fn, weighted the same way."""
    _unsupported(args, loss=True)
    mask = batch["completion_mask"].bool()
    old_logp = batch["old_logp"] if args["script"] == "ppo" or args["num_iterations"] > 1 else new_logp.detach()
    advantages = batch["advantages"]
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(new_logp)
    input_data = dict(logprobs=old_logp, advantages=advantages, loss_mask=mask, prox_logp=old_logp)
    loss = actor.grpo_loss_fn(
        new_logp,
        torch.zeros_like(new_logp),
        input_data,
        eps_clip=args["clip_low"],
        eps_clip_higher=args["clip_high"],
        c_clip=None,
        importance_sampling_level=args.get("importance_level", "token"),
    )
    share = mask.count_nonzero() / batch["num_tokens"]  # loss_weight_fn / total_loss_weight
    total = loss * share
    if args["script"] == "ppo" and args["vf_coef"] > 0:  # no critic: no value loss
        value_loss, _ = functional.ppo_critic_loss_fn(
            new_values.float(), batch["values"].float(), batch["returns"].float(), args["cliprange_value"], mask
        )
        total = total + args["vf_coef"] * value_loss * share
    return total


def per_token_loss(batch, args):
    """Each token's term: grpo_loss_fn's loss as a sum (num_tokens 1) differentiated by a positive weight on each
    token's advantage (the PPO-clip loss is homogeneous in it); PPO adds vf_coef * ppo_critic_loss_fn of each token
    alone (its mean over one token is the token's own term)."""
    _unsupported(args, loss=True)
    real = batch["completion_mask"]
    weight = torch.ones(real.shape, requires_grad=True)
    advantages = batch["advantages"] if args["script"] == "ppo" else batch["advantages"][:, None].expand_as(real)
    # the actor's loss alone
    policy_only = dict(args, script="grpo", beta=0.0, loss_agg="token-mean", scale_rewards="group")
    policy_only["num_iterations"] = 2 if args["script"] == "ppo" else args["num_iterations"]
    token_sum = _losses(batch["new_logp"], dict(batch, advantages=advantages * weight, num_tokens=1), policy_only)
    (per_token,) = torch.autograd.grad(token_sum, weight)  # d(sum_t m_t L_t(w_t A_t)) / d w_t = m_t L_t at w = 1
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
    return _losses(batch["new_logp"], batch, args, batch.get("new_values"))


def token_logprobs(model, batch, args):
    """The engine's log-probs on AReaL's layout (right-padded): amend_position_ids, the labels rolled by one and
    gather_logprobs on logits / temperature (engine/fsdp_engine.py), read back at each completion token."""
    where, attention_mask, _ = _layout(batch)
    width = attention_mask.shape[1]
    input_ids = _at(batch["prompt_ids"] * batch["prompt_mask"], _prompt_positions(batch), width)
    input_ids = input_ids + _at(batch["completion_ids"] * batch["completion_mask"], where, width)
    inputs = data.amend_position_ids(dict(input_ids=input_ids, attention_mask=attention_mask))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=inputs["position_ids"]).logits
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    logprobs = vocab.gather_logprobs(logits, labels, temperature=args["temperature"])
    return logprobs.gather(1, where - 1) * batch["completion_mask"]


def _prompt_positions(batch):
    """Where each prompt token goes in AReaL's layout: the real ones first, from position 0 (padding: 0, adding 0)."""
    mask = batch["prompt_mask"].long()
    order = torch.argsort(1 - mask, dim=1, stable=True)  # the real tokens first, in order
    positions = torch.empty_like(order)
    positions.scatter_(1, order, torch.arange(mask.shape[1]).expand_as(order).contiguous())
    return torch.where(mask.bool(), positions, 0)


def train_loss(model, batch, args, critic=None):
    new_logp = token_logprobs(model, batch, args)
    new_values = None
    if critic is not None:  # this project's critic: AReaL's is its engine's model
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        T = batch["completion_ids"].shape[1]
        new_values = critic(input_ids, attention_mask)[:, -T - 1 : -1] * batch["completion_mask"]
    return _losses(new_logp, batch, args, new_values)
