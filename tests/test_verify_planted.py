"""The planted-bug matrix: each bug planted in a peer that otherwise agrees with this project (its own code with one
line changed, or OpenRLHF's with one line changed in a copy of its folder) fails the row of the formula it breaks
on verify.py's recommended dumps, and only there. The first ones are the round-one peers of issue 29; NEW are the
nine it added."""

import pytest
from verify_helpers import GRPO_RECIPE, make_dump, planted_site, planted_source, rows, run, write_adapter

# Round one: this project's functions with one formula replaced, only while the adapter runs.
PLANTED = """
import contextlib, torch, common, grpo, ppo
from verifier.calls import load_adapter
ours = load_adapter("self")

@contextlib.contextmanager
def planted():
    saved = [(module, name, getattr(module, name)) for module, name, _ in BUGS]
    for module, name, fn in BUGS:
        setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)

def _wrap(name):
    def fn(*args):
        with planted():
            return getattr(ours, name)(*args)
    return fn

for _name in ("group_advantages", "gae", "rewards", "kl", "per_token_loss", "loss", "train_loss", "kl_coef"):
    globals()[_name] = _wrap(_name)
"""
ROUND_ONE = {
    "value clip takes the min": (
        "ppo",
        "BUGS = [(ppo, 'clipped_value_loss', lambda v, old, ret, c: 0.5 * torch.min("
        "(v - ret) ** 2, (old + torch.clamp(v - old, -c, c) - ret) ** 2))]",
    ),
    "policy clip takes the min": (
        "ppo",
        "BUGS = [(ppo, 'clipped_policy_loss', lambda lr, a, lo, hi: torch.min("
        "-a * lr.exp(), -a * torch.clamp(lr.exp(), 1 - lo, 1 + hi)))]",
    ),
    "GRPO clip bound doubled": (
        "grpo",
        "BUGS = [(grpo, 'clipped_policy_loss', lambda lr, a, lo, hi: torch.max("
        "-a * lr.exp(), -a * torch.clamp(lr.exp(), 1 - lo, 1 + 2 * hi)))]",
    ),
    "PPO KL sign flipped": ("ppo", "BUGS = [(ppo, 'kl_estimate', lambda logp, ref, kind: ref - logp)]"),
    "GRPO KL sign flipped": (
        "grpo",
        "BUGS = []\ndef kl(batch, args):\n    lr = batch['new_logp'] - batch['ref_logp']\n    return lr.exp() - 1 - lr",
    ),
    "EOS penalty sign flipped": (
        "ppo",
        "BUGS = []\ndef rewards(batch, args):\n    return ours.rewards(batch, "
        "dict(args, missing_eos_penalty=-args['missing_eos_penalty']))",
    ),
    "score one past the EOS": (
        "ppo",
        """BUGS = []
def rewards(batch, args):
    mask, T = batch["completion_mask"], batch["completion_mask"].shape[1]
    has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)
    score = batch["scores"] - args["missing_eos_penalty"] * (~has_eos).float()
    past = mask.sum(1).long().clamp(max=T - 1)  # one position past the last real token
    kl = ppo.kl_estimate(batch["old_logp"], batch["ref_logp"], args["kl_estimator"]) * mask
    return torch.zeros_like(kl).scatter(1, past[:, None], score[:, None]) - batch["kl_coef"] * kl""",
    ),
    "controller error not clipped": (
        "ppo",
        "BUGS = [(ppo, 'adaptive_kl_coef', lambda c, kl, t, n, h: c * (1 + (kl / t - 1) * n / h))]",
    ),
}
ROUND_ONE_ROWS = {
    "value clip takes the min": ["per-token loss", "loss", "critic gradient"],  # the critic's row alone
    "policy clip takes the min": ["per-token loss", "loss", "gradient"],
    "GRPO clip bound doubled": ["per-token loss", "loss", "gradient"],
    "PPO KL sign flipped": ["rewards", "kl", "kl_coef"],
    "GRPO KL sign flipped": ["kl"],
    "EOS penalty sign flipped": ["rewards"],
    "score one past the EOS": ["rewards"],
    "controller error not clipped": ["kl_coef"],
}


def assert_caught(code, out, caught):
    results = rows(out)
    assert code == 1, out
    assert all(results[q].startswith("FAIL") for q in caught), out
    assert all(results[q].startswith(("pass", "skip")) for q in results if q not in caught), out


@pytest.mark.parametrize("bug", list(ROUND_ONE))
def test_a_round_one_bug_fails_its_rows(verify_dumps, capsys, tmp_path, bug):
    script, plant = ROUND_ONE[bug]
    code, out, _ = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, PLANTED + plant))
    assert_caught(code, out, ROUND_ONE_ROWS[bug])


LOG_PROBS = {  # round one too: the log-probs an adapter computes itself
    "position ids not corrected for left padding": """
import torch
def token_logprobs(model, batch, args):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1].float()
    logp = (logits / args["temperature"]).log_softmax(-1)
    return logp.gather(-1, batch["completion_ids"][..., None]).squeeze(-1) * batch["completion_mask"]
""",
    "log-probs without the temperature": """
from verifier.calls import load_adapter
ours = load_adapter("self")
def token_logprobs(model, batch, args):
    return ours.token_logprobs(model, batch, dict(args, temperature=1.0))
""",
}


@pytest.mark.parametrize("bug", list(LOG_PROBS))
def test_a_log_prob_bug_fails_the_log_probs_row(verify_dumps, capsys, tmp_path, bug):
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", write_adapter(tmp_path, LOG_PROBS[bug]))
    assert_caught(code, out, ["log-probs"])


# NEW: one source line of grpo.py or ppo.py changed in the peer (verify_helpers.planted_source).
NEW = {
    "PPO whitening over padding": (
        "ppo",
        "return common.masked_whiten(advantages, mask, eps=args.adv_eps, mean=mean), returns",
        "return common.masked_whiten(advantages, torch.ones_like(mask), eps=args.adv_eps, mean=mean) * mask, returns",
        ["advantages"],
    ),
    "KL penalty on the last token only": (
        "ppo",
        'rewards = -batch["kl_coef"] * kl + (batch["token_scores"] - penalty)',
        'rewards = -batch["kl_coef"] * kl * scoring.score_at_last_token(torch.ones(len(mask)), mask) + (batch['
        '"token_scores"] - penalty)',
        ["rewards"],
    ),
    "inverse-ratio k3": (
        "grpo",
        "log_r = ref_logp - new_logp",
        "log_r = new_logp - ref_logp",
        ["kl", "per-token loss", "loss", "gradient"],
    ),
    "clip on the wrong side for negative advantages": (
        "grpo",
        "pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)",
        "pg_loss2 = -advantages * torch.where(advantages < 0, torch.clamp(ratio, max=1 + clip_high), "
        "torch.clamp(ratio, 1 - clip_low, 1 + clip_high))",
        ["per-token loss", "loss", "gradient"],
    ),
    "loss over the wrong dimension": (
        "grpo",
        "return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs",
        "return ((loss * mask).sum(0) / mask.sum(0).clamp(min=1)).sum() / total_seqs",
        ["loss", "gradient"],
    ),
    "gamma dropped from GAE": (
        "ppo",
        "delta = rewards[:, t] + gamma * next_value - values[:, t]",
        "delta = rewards[:, t] + next_value - values[:, t]",
        ["advantages", "returns"],
    ),
}


@pytest.mark.parametrize("bug", list(NEW))
def test_a_new_bug_fails_its_rows(verify_dumps, capsys, tmp_path, bug):
    script, find, replace, caught = NEW[bug]
    adapter = write_adapter(tmp_path, planted_source(script, find, replace))
    code, out, _ = run(capsys, verify_dumps[script], "--against", adapter)
    assert_caught(code, out, caught)


def test_weight_decay_forgotten_fails_the_update_row(verify_dumps, capsys, tmp_path):
    adapter = write_adapter(
        tmp_path,
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "def update(model, batch, args, state):\n    ours.update(model, batch, dict(args, weight_decay=0.0), state)\n",
    )
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", adapter)
    assert_caught(code, out, ["update"])


# NEW and round one in OpenRLHF itself: a line of its code changed in a copy of its folder ($OPENRLHF_SITE).
OPENRLHF = {
    "OpenRLHF's group_norm without eps": (
        "trainer/ppo_utils/experience_maker.py",
        "(rewards.std(-1, keepdim=True) + 1e-9)",
        "rewards.std(-1, keepdim=True)",
        "grpo",
        ["advantages"],
    ),
    "OpenRLHF's KL controller with the sign flipped": (
        "trainer/ppo_utils/kl_controller.py",
        "np.clip(current / target - 1, -0.2, 0.2)",
        "np.clip(1 - current / target, -0.2, 0.2)",
        "ppo",
        ["kl_coef"],
    ),
    "OpenRLHF's step normaliser without its / gas (issue 49)": (
        "utils/loss_utils.py",
        '"batch_num_tokens": num_tokens / gas, "global_batch_size": num_samples / gas}',
        '"batch_num_tokens": num_tokens, "global_batch_size": num_samples}',
        "ppo",
        ["per-token loss", "loss", "gradient", "critic gradient"],
    ),
    "OpenRLHF's actor shifted by one token (round one)": (
        "models/actor.py",
        "log_probs = log_probs[:, :-1]",
        "log_probs = log_probs[:, 1:]",
        "ppo",
        ["log-probs", "gradient"],
    ),
}


@pytest.mark.parametrize(
    "bug", [pytest.param(bug, marks=[pytest.mark.slow] if OPENRLHF[bug][3] == "grpo" else []) for bug in OPENRLHF]
)  # the GRPO one makes a dump of OpenRLHF's settings: slow
def test_a_bug_planted_in_openrlhf_fails_its_rows(verify_dumps, capsys, tmp_path, monkeypatch, bug):
    file, find, replace, script, caught = OPENRLHF[bug]
    monkeypatch.setenv("OPENRLHF_SITE", planted_site(tmp_path, file, find, replace))
    dump = verify_dumps[script]
    if script == "grpo":  # OpenRLHF's GRPO: the group's std with its eps, the paper's k3, its token-mean loss
        flags = dict(scale_rewards="group", adv_eps=1e-9, bias_corrected_kl=False, loss_agg="token-mean")
        dump = make_dump(tmp_path, "grpo", **dict(GRPO_RECIPE, **flags))
    accept = ["--accept", "advantages"] if script == "ppo" else []  # its whitening's variance floor, expected
    code, out, _ = run(capsys, dump, "--against", "openrlhf", *accept)
    assert_caught(code, out, caught)
    if script == "grpo":
        assert rows(out)["advantages"].startswith("FAIL (NaN)"), out  # a group of equal rewards: 0 / 0
