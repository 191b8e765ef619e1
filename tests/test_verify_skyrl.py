"""SkyRL 0.4.0 through verify.py (verifier/adapters/skyrl.py): its GRPO agrees on every row once the dump takes
its settings, its PPO differs where it aggregates the value loss per sequence (named, and accepted within its
bound on the loss), and a bug planted in a copy of its advantage, KL or loss code fails that row. Skips where
SkyRL is not installed apart (requirements/skyrl.txt)."""

import pytest
from verify_helpers import GRPO_RECIPE, make_dump, planted_site, rows, run, site

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


def test_skyrl_ppo_names_its_value_loss_aggregation(verify_dumps, skyrl_site, capsys):
    """The recommended PPO dump: rewards, returns, the controller, KL and per-token loss agree; the whitening and the
    per-sequence value loss are named known differences, and the gradient fails, naming why."""
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "skyrl", "--accept", "advantages", "--accept", "loss")
    results = rows(out)
    assert code == 1 and out.splitlines()[-1] == "FAIL: gradient", out
    assert all(results[q] == "pass" for q in ["rewards", "returns", "kl_coef", "kl", "per-token loss"]), out
    assert results["advantages"].startswith("differs (known: SkyRL whitens GAE's advantages"), out
    assert results["loss"].startswith("differs (known: SkyRL's ppo_critic_loss averages"), out
    assert "the value loss's weights above move the critic's gradient" in out, out


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
