"""SkyRL 0.4.0 through verify.py (verifier/adapters/skyrl.py): its GRPO agrees on every row once the dump takes
its settings, its PPO differs where it aggregates the value loss per sequence (named, and accepted within its
bound on the loss), and a bug planted in a copy of its advantage, KL or loss code fails that row. Skips where
SkyRL is not installed apart (requirements/skyrl.txt)."""

import os

import pytest
import torch
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, make_dump, planted_site, rows, run, site, write_adapter

import verify
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


NEEDS_CORE = pytest.mark.skipif(
    not os.path.exists(os.path.join(os.path.dirname(verify.__file__), "verifier", "expect.py")),
    reason="exact expectations under --accept come with issue 49's verify core (verifier/expect.py)",
)
# The adapter with its known differences undeclared: the rows they do not touch are compared as they are.
UNDECLARED = """
from verifier.calls import FUNCTIONS, load_adapter
_peer = load_adapter("skyrl")
globals().update({name: getattr(_peer, name) for name in FUNCTIONS if hasattr(_peer, name)})
differences = _peer.differences
def known_differences(args, options):
    return {}
"""
# Several completions a prompt, gamma != lambda, asymmetric clip bounds: what a swap or a count of prompts would hide.
SKYRL_PPO = dict(PPO_RECIPE, num_steps=3, samples_per_prompt=2, prompts_per_step=8, lam=0.9, clip_high=0.08)


@pytest.fixture(scope="module")
def skyrl_ppo(tmp_path_factory):
    site("skyrl", REQUIREMENTS)
    return make_dump(tmp_path_factory.mktemp("skyrl"), "ppo", **SKYRL_PPO)


def _close(actual, expected, rtol, mask=None):
    actual, expected = actual.float(), expected.float()
    if mask is not None:
        actual, expected = actual * mask, expected * mask
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item() <= rtol


def test_skyrl_ppo_known_differences_are_its_exact_expectations(skyrl_ppo, skyrl_site):
    """Each declared difference (unbiased whitening, the controller fed per-token means over the completions, the
    value loss per sequence and the entropy a micro-batch's token mean) is SkyRL's value at the rows' tolerances
    (advantages and gradient rel 1e-5, kl_coef rel 1e-6, loss abs 1e-6), while this project's differs: 2 completions
    a prompt, so a controller counting prompts would be off by a factor 2 in its step."""
    peer, ours = verify.load_adapter("skyrl"), verify.load_adapter("self")
    args, steps, _, _ = load_dump(skyrl_ppo)
    declared = peer.known_differences(args, {})
    assert {"advantages", "kl_coef", "loss", "gradient"} <= set(declared), declared
    apart = []
    for step, d in steps.items():
        whole = whole_batch(d, args)
        b = inputs("gae", whole, args)
        mask = b["completion_mask"]
        assert _close(peer.gae(b, args)[0], declared["advantages"]["expect"](b, args), 1e-5, mask)
        assert not _close(peer.gae(b, args)[0], ours.gae(b, args)[0], 1e-3, mask)
        if "kl_coef" in whole:
            b = inputs("kl_coef", whole, args)
            assert _close(peer.kl_coef(b, args), declared["kl_coef"]["expect"](b, args), 1e-6)
        micro = inputs("loss", micro_batch(d), args)
        torch.testing.assert_close(peer.loss(micro, args), declared["loss"]["expect"](micro, args), rtol=0, atol=1e-6)
        apart.append(abs(peer.loss(micro, args) - ours.loss(micro, args)).item())
    assert max(apart) > 1e-5, apart  # completions of unequal lengths in a micro-batch: the weights tell


def _gradients(peer, dump):
    """The gradients of the peer's train_loss and of its declared expectation on a micro-batch of step 1."""
    ours = verify.load_adapter("self")
    args, steps, _, _ = load_dump(dump)
    policy, critic = ours.initial_models(args)
    micro = inputs("train_loss", micro_batch(steps[1]), args)
    grads = []
    for fn in (peer.train_loss, peer.known_differences(args, {})["gradient"]["expect"]):
        policy.zero_grad(), critic.zero_grad()
        fn(policy, micro, args, critic).backward()
        grads.append(
            torch.cat([p.grad.flatten() for m in (policy, critic) for p in m.parameters() if p.grad is not None])
        )
    return grads


def test_skyrl_gradient_is_its_expectation(skyrl_ppo, skyrl_site):
    """The gradient of SkyRL's workers' loss (its wrapper, its CriticModel.forward on this project's critic) is the
    gradient of the declared expectation, policy and critic alike, at rel 1e-5."""
    grads = _gradients(verify.load_adapter("skyrl"), skyrl_ppo)
    assert _close(grads[0], grads[1], 1e-5), (grads[0] - grads[1]).abs().max()


@pytest.mark.parametrize("lam", [0.9, 1.0])
def test_skyrl_reinforce_pp_only_where_lam_is_one(skyrl_site, tmp_path, lam):
    """ppo.py --vf-coef 0 is REINFORCE++ only with --lam 1: at lam 0.9 the adapter takes SkyRL's GAE (the returns
    discount by gamma * lambda, not by gamma alone), at 1 its "reinforce++"; both give this project's returns."""
    flags = {k: v for k, v in PPO_RECIPE.items() if k not in ("critic_learning_rate", "cliprange_value")}
    dump = make_dump(tmp_path, "ppo", **dict(flags, num_steps=1, vf_coef=0.0, lam=lam))
    peer, ours = verify.load_adapter("skyrl"), verify.load_adapter("self")
    args, steps, _, _ = load_dump(dump)
    b = inputs("gae", whole_batch(steps[1], args), args)
    torch.testing.assert_close(peer.gae(b, args)[1] * b["completion_mask"], ours.gae(b, args)[1], rtol=0, atol=1e-6)


@NEEDS_CORE
def test_skyrl_ppo_passes_with_its_differences_accepted(skyrl_ppo, skyrl_site, capsys):
    accepted = [a for q in ("advantages", "kl_coef", "loss", "gradient", "critic gradient") for a in ("--accept", q)]
    code, out, _ = run(capsys, skyrl_ppo, "--against", "skyrl", *accepted)
    assert code == 0 and rows(out)["advantages"].startswith("differs (known: SkyRL whitens"), out


BUGS = {  # file under skyrl/, the line, the bug, the dump, the rows it fails (known differences undeclared)
    "GRPO advantage without eps": ("(id2std[index[i]] + epsilon)", "id2std[index[i]]", "grpo", ["advantages"]),
    "k3 without its -1": ("kld = (ratio - kl - 1).contiguous()", "kld = (ratio - kl).contiguous()", "grpo", ["kl"]),
    "GAE without lambda": (
        "lastgaelam = delta + gamma * lambd * lastgaelam",
        "lastgaelam = delta + gamma * lastgaelam",
        "ppo",
        ["returns"],
    ),
    "wrapper: temperature not applied": (
        "logits_BSV.div_(temperature)",
        "logits_BSV.div_(1.0)",
        "grpo",
        ["log-probs", "gradient"],
    ),
    "wrapper: position ids off by one": (
        "position_ids = attention_mask.long().cumsum(-1) - 1\n        position_ids.masked_fill_(attention_mask == 0, 1)"
        "\n\n        sequences_fwd",
        "position_ids = attention_mask.long().cumsum(-1)\n        position_ids.masked_fill_(attention_mask == 0, 1)"
        "\n\n        sequences_fwd",
        "grpo",
        ["log-probs", "gradient"],
    ),
    "worker: KL loss a token mean": (
        "kl_loss = masked_mean(kl_loss, loss_mask, dim=-1).mean()",
        "kl_loss = masked_mean(kl_loss, loss_mask)",
        "grpo",
        ["loss", "gradient"],
    ),
    "worker: micro-batch weight dropped": (
        "(kl_loss_term - entropy_loss_term) * microbatch_weight",
        "(kl_loss_term - entropy_loss_term)",
        "grpo",
        ["gradient"],  # the loss row too where verify splits it into the loop's micro-batches
    ),
    "worker: entropy sign": (
        "(kl_loss_term - entropy_loss_term) * microbatch_weight",
        "(kl_loss_term + entropy_loss_term) * microbatch_weight",
        "ppo",
        ["loss", "gradient"],
    ),
    "entropy in bits": (
        "chunk_entropy = -(chunk_probs * chunk_logprob).sum(-1)",
        "chunk_entropy = -(chunk_probs * chunk_logprob).sum(-1) / 0.6931471805599453",  # / ln 2
        "ppo",
        ["gradient"],
    ),
    "trainer: KL penalty added": (
        "rewards = rewards - kl * max(0, kl_loss_coef)",
        "rewards = rewards + kl * max(0, kl_loss_coef)",
        "ppo",
        ["rewards"],
    ),
    "whitening's Bessel correction twice": (
        "variance = variance * bessel_correction",
        "variance = variance * bessel_correction**2",
        "ppo",
        ["advantages"],
    ),
}
FILES = {
    "wrapper": "workers/model_wrapper.py",
    "worker": "workers/worker.py",
    "entropy in bits": "utils/torch_utils.py",
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_planted_in_skyrl_fails_its_rows(skyrl_grpo, skyrl_ppo, capsys, tmp_path, monkeypatch, bug):
    """Each place the adapter reaches, one line changed in a copy of SkyRL: the row it breaks fails. The PPO rows
    with a known difference are checked against their expectation (the loss and gradient: the planted copy's
    value differs from it by more than the tolerance)."""
    find, replace, script, caught = BUGS[bug]
    where = bug.split(":")[0]
    file = (
        "train/trainer.py" if where == "trainer" else "backends/skyrl_train/" + FILES.get(where, "utils/ppo_utils.py")
    )
    monkeypatch.setenv("SKYRL_SITE", planted_site(tmp_path, file, find, replace, name="skyrl"))
    if script == "grpo":
        code, out, _ = run(capsys, skyrl_grpo, "--against", "skyrl")
        assert code == 1 and all(rows(out)[q].startswith("FAIL") for q in caught), out
        return
    peer = verify.load_adapter("skyrl")
    args, steps, _, _ = load_dump(skyrl_ppo)
    declared, d = peer.known_differences(args, {}), steps[2]
    whole = whole_batch(d, args)
    if "rewards" in caught or "returns" in caught:
        code, out, _ = run(capsys, skyrl_ppo, "--against", write_adapter(tmp_path, UNDECLARED))
        assert code == 1 and all(rows(out)[q].startswith("FAIL") for q in caught), out
    if "advantages" in caught:
        b = inputs("gae", whole, args)
        assert not _close(peer.gae(b, args)[0], declared["advantages"]["expect"](b, args), 1e-5, b["completion_mask"])
    if "loss" in caught:
        micro = inputs("loss", micro_batch(d), args)
        assert abs(peer.loss(micro, args) - declared["loss"]["expect"](micro, args)) > 1e-5
    if "gradient" in caught:
        grads = _gradients(peer, skyrl_ppo)
        assert not _close(grads[0], grads[1], 1e-5)


def test_peer_site_never_falls_back_to_the_checkout_when_told_a_folder(tmp_path, monkeypatch):
    """$SKYRL_SITE names a folder without SkyRL while the checkout's .skyrl-site has it: the error names that folder
    (the user's choice is not replaced by another copy of the peer), and the checkout's copy is found without it."""
    from verifier import peer_site

    marker = os.path.join("backends", "skyrl_train", "utils", "ppo_utils.py")
    checkout = site("skyrl", REQUIREMENTS)
    monkeypatch.delenv("SKYRL_SITE", raising=False)
    monkeypatch.setattr(peer_site, "ROOT", os.path.dirname(checkout))
    assert os.path.samefile(peer_site.find("skyrl", marker, "pip install ..."), checkout)
    monkeypatch.setenv("SKYRL_SITE", str(tmp_path))
    with pytest.raises(ImportError, match=f"no skyrl in {tmp_path}: pip install"):
        peer_site.find("skyrl", marker, "pip install ...")


@NEEDS_CORE
@pytest.mark.parametrize("bug", ["whitening's Bessel correction twice", "worker: entropy sign", "entropy in bits"])
def test_a_bug_under_an_accepted_difference_fails_its_row(skyrl_ppo, capsys, tmp_path, monkeypatch, bug):
    """Every SkyRL difference accepted: a bug on top of one still fails its row (the peer against the declared
    expectation at the row's normal tolerance), where a bound measured with a margin let it pass."""
    find, replace, _, caught = BUGS[bug]
    where = bug.split(":")[0]
    file = "backends/skyrl_train/" + FILES.get(where, "utils/ppo_utils.py")
    monkeypatch.setenv("SKYRL_SITE", planted_site(tmp_path, file, find, replace, name="skyrl"))
    accepted = [a for q in ("advantages", "kl_coef", "loss", "gradient", "critic gradient") for a in ("--accept", q)]
    code, out, _ = run(capsys, skyrl_ppo, "--against", "skyrl", *accepted)
    assert code == 1 and all(rows(out)[q].startswith("FAIL") for q in caught), out


def test_skyrl_grpo_known_differences_are_its_exact_expectations(skyrl_site, tmp_path):
    """GRPO with --adv-eps 1e-3 and --loss-agg token-mean: SkyRL's advantages are (r - mean) / (std + 1e-6), its
    loss and gradient those of a KL averaged per sequence (its worker's), each at the row's tolerance (advantages
    and gradient rel 1e-5, loss abs 1e-6) on every micro-batch, where this project's differ."""
    flags = dict(SKYRL_GRPO, num_steps=2, adv_eps=1e-3, loss_agg="token-mean", clip_high=0.08)
    dump = make_dump(tmp_path, "grpo", **flags)
    peer, ours = verify.load_adapter("skyrl"), verify.load_adapter("self")
    args, steps, _, _ = load_dump(dump)
    declared = peer.known_differences(args, {})
    assert set(declared) == {"advantages", "loss", "gradient"}, declared
    policy, _ = ours.initial_models(args)
    apart = []
    for d in steps.values():
        whole = whole_batch(d, args)
        b = inputs("group_advantages", whole, args)
        assert _close(peer.group_advantages(b, args), declared["advantages"]["expect"](b, args), 1e-5)
        mask = b["completion_mask"]
        apart.append(abs(peer.group_advantages(b, args) - ours.group_advantages(b, args)[:, None] * mask).max().item())
        size = args["micro_batch_size"]
        micro = {
            k: v[:size] if torch.is_tensor(v) and v.dim() > 0 and len(v) == len(whole["rewards"]) else v
            for k, v in whole.items()
        }
        b = inputs("loss", micro, args)
        torch.testing.assert_close(peer.loss(b, args), declared["loss"]["expect"](b, args), rtol=0, atol=1e-6)
        assert abs(peer.loss(b, args) - ours.loss(b, args)) > 1e-5
        grads = []
        for fn in (peer.train_loss, declared["gradient"]["expect"]):
            policy.zero_grad()
            fn(policy, inputs("train_loss", micro, args), args).backward()
            grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
        assert _close(grads[0], grads[1], 1e-5)
    assert max(apart) > 1e-4, apart  # the std eps shows
