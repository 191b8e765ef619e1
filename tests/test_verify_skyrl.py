"""SkyRL 0.4.0 through verify.py (verifier/adapters/skyrl.py): its GRPO agrees on every row once the dump takes
its settings, its PPO differs where it aggregates the value loss per sequence (named, and accepted within its
bound on the loss), and a bug planted in a copy of its advantage, KL or loss code fails that row. Skips where
SkyRL is not installed apart (requirements/skyrl.txt)."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, make_dump, planted_site, rows, run, site

import verify
from common import select_rows
from verifier.dump import inputs, load_dump, micro_batch, whole_batch

REQUIREMENTS = "requirements/skyrl.txt"
# verify.py's recommended GRPO dump with SkyRL's settings: the group's std with its eps (compute_grpo_outcome_
# advantage's default 1e-6, which its trainer never overrides) and the paper's k3 (SkyRL has no ratio-weighted one).
SKYRL_GRPO = dict(GRPO_RECIPE, scale_rewards="group", adv_eps=1e-6, bias_corrected_kl=False)
COMPARED = ["advantages", "log-probs", "kl", "per-token loss", "loss", "gradient"]


@pytest.fixture(scope="module")
def skyrl_grpo(tmp_path_factory):
    site("skyrl", REQUIREMENTS)
    return make_dump(tmp_path_factory.mktemp("skyrl"), "grpo", **SKYRL_GRPO)


@pytest.fixture
def skyrl_site(monkeypatch):
    monkeypatch.setenv("SKYRL_SITE", site("skyrl", REQUIREMENTS))


def test_skyrl_grpo_passes_every_row_with_its_settings(skyrl_grpo, skyrl_site, capsys):
    code, out, _ = run(capsys, skyrl_grpo, "--against", "skyrl")
    assert code == 0 and all(rows(out)[q] == "pass" for q in COMPARED), out


def test_skyrl_says_why_the_plain_recommended_grpo_dump_is_incomplete(verify_dumps, skyrl_site, capsys):
    """The batch's std and the ratio-weighted k3 have no SkyRL counterpart: skipped, each with the flag to set."""
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", "skyrl")
    results = rows(out)
    assert code == 4 and results["advantages"].startswith("skip: SkyRL's GRPO divides by the group's std"), out
    assert results["loss"].startswith("skip: SkyRL has no ratio-weighted k3"), out


def test_skyrl_ppo_names_its_value_loss_and_entropy_weights(verify_dumps, skyrl_site, capsys):
    """The recommended PPO dump (--ent-coef 0.01, micro-batches of 4 in minibatches of 8): rewards, returns, the
    controller, KL and the per-token loss (its entropy term too) agree; the whitening and SkyRL's micro-batch weights
    (the value loss per sequence, the entropy a micro-batch's token mean) are named known differences, and the
    gradient fails unless its own is accepted: a real difference, never a plain pass."""
    accepted = ["--accept", "advantages", "--accept", "loss"]
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "skyrl", *accepted)
    results = rows(out)
    assert code == 1 and out.splitlines()[-1] == "FAIL: gradient", out
    assert all(results[q] == "pass" for q in ["rewards", "returns", "kl_coef", "kl", "per-token loss"]), out
    assert results["advantages"].startswith("differs (known: SkyRL whitens GAE's advantages"), out
    assert results["loss"].startswith("differs (known: SkyRL weighs a term by each micro-batch's share"), out
    assert "ppo_critic_loss averages" in results["loss"] and "entropy loss" in results["loss"], out
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "skyrl", *accepted, "--accept", "gradient")
    assert code == 0 and rows(out)["gradient"].startswith("differs (known: the same weights on the gradient"), out


def test_skyrl_reinforce_pp_agrees_with_ppo_without_a_critic(skyrl_site, capsys, tmp_path):
    """ppo.py --vf-coef 0 --lam 1 is REINFORCE++ (docs/fork.md): SkyRL's own "reinforce++" estimator recomputes its
    returns exactly, its advantages but for the whitening's variance; the per-token loss agrees, the loss and gradient
    differ by the entropy's micro-batch weights alone (named); a return to go without gamma fails both."""
    flags = {k: v for k, v in PPO_RECIPE.items() if k not in ("critic_learning_rate", "cliprange_value")}
    dump = make_dump(tmp_path, "ppo", **dict(flags, vf_coef=0.0, lam=1.0))
    accepted = ["--accept", "advantages", "--accept", "loss", "--accept", "gradient"]
    code, out, _ = run(capsys, dump, "--against", "skyrl", *accepted)
    results = rows(out)
    assert code == 0 and all(results[q].startswith("pass") for q in ["rewards", "returns", "per-token loss"]), out
    assert results["loss"].startswith("differs (known: SkyRL weighs") and "ppo_critic_loss" not in results["loss"]
    assert "entropy loss" in results["loss"] and results["gradient"].startswith("differs (known:"), out
    find = "running_return = token_level_rewards[:, t] + gamma * running_return"
    copy = planted_site(
        tmp_path, "backends/skyrl_train/utils/ppo_utils.py", find, find.replace("gamma * ", ""), "skyrl"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SKYRL_SITE", copy)
        code, out, _ = run(capsys, dump, "--against", "skyrl", *accepted)
    assert code == 1 and rows(out)["returns"].startswith("FAIL") and rows(out)["advantages"].startswith("FAIL"), out


BUGS = {  # file under skyrl/, the line, the bug, the dump, the rows it fails
    "GRPO advantage without eps": ("(id2std[index[i]] + epsilon)", "id2std[index[i]]", "grpo", ["advantages"]),
    "k3 without its -1": ("kld = (ratio - kl - 1).contiguous()", "kld = (ratio - kl).contiguous()", "grpo", ["kl"]),
    "PPO-clip taking the larger surrogate": (
        "loss = -torch.min(surr1, surr2)\n    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).mean()"
        ".detach().item()\n    clip_pg_losses1",
        "loss = -torch.max(surr1, surr2)\n    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).mean()"
        ".detach().item()\n    clip_pg_losses1",
        "grpo",
        ["per-token loss", "loss", "gradient"],
    ),
    "GAE without lambda": (
        "lastgaelam = delta + gamma * lambd * lastgaelam",
        "lastgaelam = delta + gamma * lastgaelam",
        "ppo",
        ["advantages", "returns"],
    ),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_planted_in_skyrl_fails_its_rows(skyrl_grpo, verify_dumps, capsys, tmp_path, monkeypatch, bug):
    find, replace, script, caught = BUGS[bug]
    copy = planted_site(tmp_path, "backends/skyrl_train/utils/ppo_utils.py", find, replace, name="skyrl")
    monkeypatch.setenv("SKYRL_SITE", copy)
    dump = skyrl_grpo if script == "grpo" else verify_dumps["ppo"]
    code, out, _ = run(capsys, dump, "--against", "skyrl")
    results = rows(out)
    assert code == 1 and all(results[q].startswith("FAIL") for q in caught), out


# The adapter composes SkyRL's loss as its worker does; here the worker's own _forward_backward_micro (workers/
# worker.py) runs on the same batch, loaded with permissive stand-ins for everything it imports but ppo_utils and
# torch_utils (ray, its distributed strategy, its config, the replay buffer): the loss it backpropagates is captured.
class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator: the function it decorates
        return type.__call__(cls)

    def __getitem__(cls, item):
        return cls


def _stub_class(name):
    return _Meta(name, (), {"__getattr__": lambda self, attribute: _stub_class(attribute)})


class _Anything(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "loguru", "omegaconf", "skyrl"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _skyrl_worker(adapter):
    saved, finder = dict(sys.modules), _StandIns()
    sys.meta_path.insert(0, finder)
    try:
        for name in [n for n in sys.modules if n.split(".")[0] == "skyrl"]:
            sys.modules.pop(name)
        sys.modules["skyrl.backends.skyrl_train.utils.ppo_utils"] = adapter.ppo_utils
        sys.modules["skyrl.backends.skyrl_train.utils.torch_utils"] = adapter.torch_utils
        path = os.path.join(site("skyrl", REQUIREMENTS), "skyrl", "backends", "skyrl_train", "workers", "worker.py")
        spec = importlib.util.spec_from_file_location("skyrl_worker", path)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
    finally:
        sys.meta_path.remove(finder)
        sys.modules.clear()
        sys.modules.update(saved)
    worker.compute_minibatch_rollout_logprob_diff_metrics = lambda *args: {}
    return worker


def _worker_loss(method, model_output, config, experience, weight, **fields):
    """The loss `method` (a worker's _forward_backward_micro) hands its strategy's backward."""
    captured = []
    me = types.SimpleNamespace(
        model=_Callable(model_output),
        cfg=types.SimpleNamespace(algorithm=config),
        strategy=types.SimpleNamespace(backward=lambda loss, model, optimizer: captured.append(loss)),
        mesh_rank=types.SimpleNamespace(dp_size=1),
        scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]),
        optimizer=None,
        **fields,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        method(me, experience, microbatch_weight=weight)
    return captured[0]


class _Callable:
    def __init__(self, output):
        self.output = output

    def train(self):
        pass

    def __call__(self, *args, **kwargs):
        return self.output


def _experience(batch, advantages, **more):
    sequences = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    return types.SimpleNamespace(
        sequences=sequences,
        attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        action_log_probs=batch["old_logp"],
        base_action_log_probs=batch.get("ref_logp"),
        advantages=advantages,
        num_actions=batch["completion_ids"].shape[1],
        loss_mask=batch["completion_mask"].float(),
        response_mask=batch["completion_mask"],
        rollout_logprobs=None,
        pixel_values=None,
        image_grid_thw=None,
        rollout_sample_support=None,
        to_device=lambda device: None,
        **more,
    )


def _at_positions(values, batch):
    """[n, T] values of the completion's tokens as the worker's model output holds them, [n, P + T]: the value of
    completion token t at the position that predicts it (the worker reads [:, -num_actions - 1 : -1])."""
    P = batch["prompt_ids"].shape[1]
    out = torch.zeros(len(values), P + values.shape[1])
    out[:, P - 1 : -1] = values
    return out


def test_the_adapters_loss_is_the_skyrl_workers_own(skyrl_grpo, verify_dumps, skyrl_site):
    """GRPO: each micro-batch of the recommended 32 (the KL loss in, weighted by microbatch_weight; the policy loss
    on advantages scaled over the whole batch, as the trainer scales a minibatch's), summing to the whole batch's
    loss. PPO: a micro-batch of 4 in its minibatch of 8 (the entropy loss in, --ent-coef 0.01; the critic's loss
    weighted by its share of sequences). On each micro-batch, with the whole batch's (minibatch's) counts as verify
    hands them to train_loss, the adapter's loss is what SkyRL's workers backpropagate."""
    adapter = verify.load_adapter("skyrl")
    worker = _skyrl_worker(adapter)
    policy_loss_fn = adapter.ppo_utils.PolicyLossRegistry.get("regular")
    args, steps, _, _ = load_dump(skyrl_grpo)
    whole = whole_batch(steps[2], args)
    N, size = len(whole["completion_mask"]), args["micro_batch_size"]
    assert N > size, "the recommended GRPO dump has more than one micro-batch"
    advantages = whole["advantages"][:, None].expand_as(whole["new_logp"])
    config = dict(vars(adapter._config(args)), use_entropy_loss=False, use_kl_loss=True, kl_loss_coef=args["beta"])
    config = types.SimpleNamespace(
        **config, kl_estimator_type="k3", temperature=1.0, enable_sample_support_replay=False
    )
    scaled = adapter.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        advantages, whole["completion_mask"].float(), config.loss_reduction, size, args["max_new_tokens"]
    )
    total = 0.0
    for start in range(0, N, size):
        rows = torch.arange(start, min(start + size, N))
        micro = inputs("loss", dict(select_rows(whole, rows), num_seqs=N, num_tokens=whole["num_tokens"]), args)
        theirs = _worker_loss(
            worker.PolicyWorkerBase._forward_backward_micro,
            (micro["new_logp"].clone().requires_grad_(True), {"entropy": _at_positions(micro["new_logp"], micro)}),
            config,
            _experience(micro, scaled[rows]),
            len(rows) / N,  # forward_backward's microbatch_weight: the micro-batch's share of sequences
            policy_loss_fn=policy_loss_fn,
        )
        ours = adapter.loss(micro, args)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
        total = total + ours
    whole_loss = adapter.loss(inputs("loss", whole, args), args)
    torch.testing.assert_close(total, whole_loss, rtol=0, atol=1e-6)

    args, steps, _, _ = load_dump(verify_dumps["ppo"])
    assert args["ent_coef"] > 0 and args["vf_coef"] > 0
    d = steps[2]
    micro = inputs("loss", micro_batch(d), args)
    minibatch = d["minibatch_index"].tolist()
    rows = [minibatch.index(i) for i in d["micro_index"].tolist()]
    assert 1 < len(minibatch) // len(rows), "the recommended PPO dump has more than one micro-batch a minibatch"
    config = dict(vars(adapter._config(args)), use_entropy_loss=True, entropy_loss_coef=args["ent_coef"])
    config = types.SimpleNamespace(**config, use_kl_loss=False, kl_loss_coef=0.0, temperature=1.0)
    config.enable_sample_support_replay = False
    scaled = adapter.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        d["advantages"][minibatch], d["completion_mask"][minibatch].float(), "token_mean", len(rows), 4
    )[rows]
    weight = len(rows) / len(minibatch)
    entropy = micro["entropy"].clone().requires_grad_(True)
    policy = _worker_loss(
        worker.PolicyWorkerBase._forward_backward_micro,
        (micro["new_logp"].clone().requires_grad_(True), {"entropy": _at_positions(entropy, micro)}),
        config,
        _experience(micro, scaled),
        weight,
        policy_loss_fn=policy_loss_fn,
    )
    critic = _worker_loss(
        worker.CriticWorkerBase._forward_backward_micro,
        (micro["new_values"].clone().requires_grad_(True), None),
        config,
        _experience(micro, scaled, values=micro["values"], returns=micro["returns"]),
        weight,
        critic_loss_fn=adapter.ppo_utils.ppo_critic_loss,
        _micro_batches_accumulated=0,
    )
    torch.testing.assert_close(adapter.loss(micro, args), policy + args["vf_coef"] * critic, rtol=0, atol=1e-7)
    without = adapter.loss(dict(micro, entropy=torch.zeros_like(micro["entropy"])), args)
    assert abs(adapter.loss(micro, args) - without) > 1e-4  # the entropy loss counts: a wrong sign would show
