"""AReaL 1.0.4 through verify.py (verifier/adapters/areal.py): its actor loss agrees once the dump takes its settings
(no KL in the loss, the token mean, no entropy bonus), its log-probs and gradient on its right-padded layout agree,
its PPO rewards, returns, KL and loss agree, its advantages differ by named differences accepted within their bounds,
and a bug planted in a copy of its advantage, log-prob or loss code fails that row. Skips where AReaL is not
installed apart (requirements/areal.txt)."""

import pytest
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, make_dump, planted_site, rows, run, site

REQUIREMENTS = "requirements/areal.txt"
# verify.py's recommended GRPO dump with AReaL's settings: its KL goes into the reward (kl_ctl), never the loss,
# and its actor's loss is a token mean. The batch's std stays: AReaL's adv_norm has it (std_level batch).
AREAL_GRPO = dict(GRPO_RECIPE, beta=0.0, loss_agg="token-mean")
# verify.py's recommended PPO dump without the entropy bonus AReaL's actor does not have (grpo_loss_fn detaches it).
AREAL_PPO = dict(PPO_RECIPE, ent_coef=0.0)
LOSS_ROWS = ["per-token loss", "loss", "gradient"]


@pytest.fixture(scope="module")
def areal_grpo(tmp_path_factory):
    site("areal", REQUIREMENTS)
    return make_dump(tmp_path_factory.mktemp("areal"), "grpo", **AREAL_GRPO)


@pytest.fixture(scope="module")
def areal_ppo(tmp_path_factory):
    site("areal", REQUIREMENTS)
    return make_dump(tmp_path_factory.mktemp("areal"), "ppo", **AREAL_PPO)


@pytest.fixture
def areal_site(monkeypatch):
    monkeypatch.setenv("AREAL_SITE", site("areal", REQUIREMENTS))


def test_areal_grpo_passes_with_its_token_weighted_advantages_accepted(areal_grpo, areal_site, capsys):
    """Micro-batches of 32 (the recommended dump's): the engine's token-share weights give this project's gradient;
    AReaL has no KL term in the loss, so the loss rows name it as never exercised rather than a plain pass."""
    code, out, _ = run(capsys, areal_grpo, "--against", "areal")
    results = rows(out)
    assert code == 1 and results["advantages"].startswith("FAIL") and "FAIL: advantages" in out, out
    code, out, _ = run(capsys, areal_grpo, "--against", "areal", "--accept", "advantages")
    results = rows(out)
    assert code == 0 and results["log-probs"] == "pass", out
    for q in LOSS_ROWS:
        assert results[q].startswith("pass; never exercised: a KL term (--beta > 0)"), out
        assert "micro-batch" not in results[q], out  # more than one micro-batch: exercised
    assert results["advantages"].startswith("differs (known: AReaL normalises the advantages over tokens"), out
    assert "never exercised by this dump: per-token loss (a KL term" in out.splitlines()[-1], out


def test_areal_ppo_agrees_but_for_its_whitening(areal_ppo, areal_site, capsys):
    """A PPO dump without the entropy bonus AReaL lacks: every row agrees (micro-batches of 4 in minibatches of 8,
    weighted by their tokens as AReaL's engine weighs them) but the whitening, accepted within its bound."""
    code, out, _ = run(capsys, areal_ppo, "--against", "areal", "--accept", "advantages")
    results = rows(out)
    expected = ["rewards", "returns", "log-probs", "kl", *LOSS_ROWS]
    assert code == 0 and all(results[q] == "pass" or results[q].startswith("pass; never") for q in expected), out
    assert all("entropy" in results[q] for q in LOSS_ROWS), out  # never exercised: named
    assert results["advantages"].startswith("differs (known: AReaL whitens GAE's advantages"), out


def test_areal_ppo_leaves_the_entropy_bonus_uncompared(verify_dumps, areal_site, capsys):
    """The recommended PPO dump (--ent-coef 0.01): AReaL's actor has no entropy bonus, so the loss rows are not
    compared, each saying which flag to set, and verify says INCOMPLETE, never PASS."""
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "areal", "--accept", "advantages")
    results = rows(out)
    assert code == 4 and out.splitlines()[-1].startswith("INCOMPLETE"), out
    assert all(results[q].startswith("skip: AReaL's actor has no entropy bonus") for q in LOSS_ROWS), out
    assert all("--ent-coef 0" in results[q] for q in LOSS_ROWS), out
    assert all(results[q] == "pass" for q in ["rewards", "returns", "log-probs", "kl"]), out


BUGS = {  # file under areal/, the line, the bug, the dump, the rows it fails (advantages accepted within bound)
    "adv_norm without the group's mean": (
        "utils/data.py",
        "mean[s] = group_mean.expand_as(xx)",
        "mean[s] = 0 * group_mean.expand_as(xx)",
        "grpo",
        ["advantages"],
    ),
    "PPO-clip taking the smaller loss": (
        "utils/functional/functional.py",
        "pg_loss = torch.max(pg_loss1, pg_loss2)",
        "pg_loss = torch.min(pg_loss1, pg_loss2)",
        "grpo",
        ["per-token loss", "loss"],
    ),
    "log-probs without the temperature": (
        "utils/functional/vocab_parallel.py",
        "def _gather_logprobs(\n    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0\n):\n"
        "    log_probs = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)",
        "def _gather_logprobs(\n    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0\n):\n"
        "    log_probs = torch.nn.functional.log_softmax(logits.float(), dim=-1)",
        "grpo",
        ["log-probs", "gradient"],
    ),
    "GAE without the discount on the next value": (
        "trainer/ppo/actor.py",
        "delta = rewards[:, t] + self.discount * nextvalues - values[:, t]",
        "delta = rewards[:, t] + nextvalues - values[:, t]",
        "ppo",
        ["advantages", "returns"],
    ),
    "value loss unclipped": (
        "utils/functional/functional.py",
        "value_loss = torch.max(value_loss_original, value_loss_clipped)",
        "value_loss = value_loss_original",
        "ppo",
        ["per-token loss", "loss"],
    ),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_planted_in_areal_fails_its_rows(areal_grpo, areal_ppo, capsys, tmp_path, monkeypatch, bug):
    file, find, replace, script, caught = BUGS[bug]
    monkeypatch.setenv("AREAL_SITE", planted_site(tmp_path, file, find, replace, name="areal"))
    dump = areal_grpo if script == "grpo" else areal_ppo
    code, out, _ = run(capsys, dump, "--against", "areal", "--accept", "advantages")
    results = rows(out)
    assert code == 1 and all(results[q].startswith("FAIL") for q in caught), out
