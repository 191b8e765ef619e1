"""The shipped adapters of other implementations (TRL, verl, OpenRLHF) agree once the known differences are
aligned, name them when not, and accept a declared one only within its bound; each skips where its optional
package is absent. OpenRLHF's log-probs are its own Actor.forward (a shift planted there: test_verify_planted.py)."""

import os
import subprocess
import sys

import pytest
from verify_helpers import GRPO_RECIPE, ROOT, make_dump, rows, run, site

TRL = "trl is optional: pip install -r requirements/extra.txt"


def test_trl_matches_once_aligned_and_names_the_differences_when_not(verify_dumps, capsys, tmp_path):
    """TRL's forward without position ids (on the recommended dump's absolute positions), the HF Trainer's
    weight-decay groups, then TRL's KL form: each named; on a rotary model with the groups aligned, all pass."""
    pytest.importorskip("trl", reason=TRL)
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", "trl")
    results = rows(out)
    assert code == 1 and results["log-probs"].startswith("FAIL") and results["update"].startswith("FAIL"), out
    assert results["advantages"] == "pass" and results["per-token loss"] == "pass", out
    assert "TRL's forward passes no position ids" in out, out
    assert "the HF Trainer leaves biases and norm weights out of weight decay" in out
    # aligned: a rotary model, the HF Trainer's decay groups, and no warmup (its schedule is lr * s / warmup)
    aligned = dict(GRPO_RECIPE, model="tiny", warmup_steps=0)
    aligned = make_dump(tmp_path, "grpo", **aligned, decay_norms_and_biases=False)
    code, out, _ = run(capsys, aligned, "--against", "trl")  # TRL's default: the bias-corrected k3
    assert code == 0 and all(r.startswith(("pass", "skip")) for r in rows(out).values()), out
    assert "position ids" not in out and "no --warmup-steps: the learning rate never moves" in out
    code, out, _ = run(capsys, aligned, "--against", "trl", "--set", "use_bias_correction_kl=false")
    assert code == 1 and rows(out)["gradient"].startswith("FAIL") and rows(out)["per-token loss"].startswith("FAIL")
    assert "TRL use_bias_correction_kl=False, grpo.py --bias-corrected-kl True" in out


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_trl_loss_types(capsys, tmp_path, loss_agg):
    """dapo and dr_grpo, with TRL's default bias-corrected k3 matched by --bias-corrected-kl, and GSPO."""
    pytest.importorskip("trl", reason=TRL)
    flags = dict(GRPO_RECIPE, model="tiny", loss_agg=loss_agg, scale_rewards="none", decay_norms_and_biases=False)
    flags.update(warmup_steps=0)  # the HF Trainer's warmup is lr * s / warmup
    if loss_agg == "token-mean":
        flags.update(importance_level="sequence", scale_rewards="batch", clip_low=3e-4, clip_high=4e-4)
    code, out, _ = run(capsys, make_dump(tmp_path, "grpo", **flags), "--against", "trl")
    assert code == 0, out


def run_verl(dump, *flags):
    """verl's own imports need its folder on the path: a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": site("verl", "requirements/verl.txt")}
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), dump, "--against", "verl", *flags]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow
def test_verl(verify_dumps):
    code, out = run_verl(verify_dumps["grpo"])  # the batch std of the recipe has no verl counterpart
    assert code == 4 and rows(out)["advantages"].startswith("skip: verl's GRPO divides by the group's std"), out
    code, out = run_verl(verify_dumps["ppo"])  # GAE whitening by the unbiased variance: the one difference
    results = rows(out)
    assert code == 1 and "FAIL: advantages" in out, out
    assert results["returns"] == "pass" and results["gradient"] == "pass" and "the unbiased variance" in out
    code, out = run_verl(verify_dumps["ppo"], "--accept", "advantages")
    assert code == 0 and rows(out)["advantages"].startswith("differs (known: verl whitens GAE's advantages"), out


def test_openrlhf_ppo(verify_dumps, capsys, monkeypatch):
    """Its whitening floors the variance (an exact expectation under --accept advantages); its controller fed as
    ppo.py feeds its own: every other row passes; fed as OpenRLHF's trainer feeds it, the row fails, and --accept
    takes it where it matches the mean-fed controller exactly."""
    monkeypatch.setenv("OPENRLHF_SITE", site("openrlhf", "requirements/openrlhf.txt"))
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "openrlhf", "--accept", "advantages")
    expected = ["rewards", "returns", "kl_coef", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    assert code == 0 and all(rows(out)[q].startswith("pass") for q in expected), out
    # the floor shows where a step's advantages have a variance near 1e-8 (not on every dump): pass or the expectation
    assert rows(out)["advantages"].startswith(("pass", "differs (known: OpenRLHF whitens GAE's advantages")), out
    assert "written out by the adapter, not compared: CriticModel.forward" in out.splitlines()[-1], out
    flags = ("--accept", "advantages", "--set", "controller_kl=mean")
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "openrlhf", *flags)
    assert code == 1 and rows(out)["kl_coef"].startswith("FAIL") and "FAIL: kl_coef" in out, out
    code, out, _ = run(capsys, verify_dumps["ppo"], "--against", "openrlhf", *flags, "--accept", "kl_coef")
    assert code == 0 and rows(out)["kl_coef"].startswith("differs (known: OpenRLHF feeds"), out
    assert "matches the declared expectation within the tolerance" in rows(out)["kl_coef"], out


@pytest.mark.slow
def test_openrlhf_grpo(verify_dumps, capsys, monkeypatch, tmp_path):
    """The recommended dump (the batch's std, the ratio-weighted k3) leaves OpenRLHF the log-probs alone: no pass.
    With its settings (the group's std, the paper's k3), its eps is the one difference: accepted within its bound,
    and gone with --adv-eps 1e-9."""
    monkeypatch.setenv("OPENRLHF_SITE", site("openrlhf", "requirements/openrlhf.txt"))
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", "openrlhf")
    assert code == 4 and out.splitlines()[-1].startswith("INCOMPLETE: compared log-probs of the adapter's"), out
    flags = dict(GRPO_RECIPE, scale_rewards="group", bias_corrected_kl=False)
    dump = make_dump(tmp_path / "a", "grpo", **flags, loss_agg="token-mean")  # OpenRLHF's default aggregation
    code, out, _ = run(capsys, dump, "--against", "openrlhf")
    assert code == 1 and rows(out)["advantages"].startswith("FAIL") and "FAIL: advantages" in out, out
    code, out, _ = run(capsys, dump, "--against", "openrlhf", "--accept", "advantages")
    assert code == 0 and rows(out)["advantages"].startswith("differs (known: group_norm divides by std + 1e-9"), out
    # its KL term is a token mean whatever the policy loss's mode: on seq-mean-token-mean the loss and gradient
    # differ (a known difference, accepted within its bound); on token-mean, OpenRLHF's default, nothing does
    dump = make_dump(tmp_path / "b", "grpo", **flags, adv_eps=1e-9)
    code, out, _ = run(capsys, dump, "--against", "openrlhf")
    assert code == 1 and out.splitlines()[-1] == "FAIL: loss, gradient" and rows(out)["per-token loss"] == "pass"
    code, out, _ = run(capsys, dump, "--against", "openrlhf", "--accept", "loss", "--accept", "gradient")
    assert code == 0 and rows(out)["gradient"].startswith("differs (known: OpenRLHF adds its GRPO KL term"), out
    dump = make_dump(tmp_path / "c", "grpo", **flags, adv_eps=1e-9, loss_agg="token-mean")
    code, out, _ = run(capsys, dump, "--against", "openrlhf")
    expected = ["advantages", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    assert code == 0 and all(rows(out)[q] == "pass" for q in expected), out
