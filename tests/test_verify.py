"""verify.py: the self-check passes on fresh dumps and fails on wrong numbers; bad input gets one line; the
shipped adapters (TRL, verl) agree once the known differences are aligned, and name them when not."""

import os
import subprocess
import sys

import pytest

import grpo
import ppo
import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = dict(seed=3, prompts_per_step=3, group_size=4, max_new_tokens=4, sample_every=0, learning_rate=1e-2)


def grpo_dump(folder, **flags):
    fields = {**FIELDS, "num_steps": 2, **flags}
    grpo.main(grpo.Args(**fields, output_dir=str(folder / "runs"), dump_dir=str(folder / "dump")))
    return str(folder / "dump")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A GRPO dump whose step 2 has a KL to the reference (beta 0.1, lr 1e-2), and a PPO dump."""
    folder = tmp_path_factory.mktemp("verify")
    ppo_flags = dict(seed=3, prompts_per_step=8, max_new_tokens=4, sample_every=0, num_steps=1)
    ppo.main(ppo.Args(**ppo_flags, output_dir=str(folder / "runs"), dump_dir=str(folder / "ppo")))
    return {"grpo": grpo_dump(folder, beta=0.1, bias_corrected_kl=False), "ppo": str(folder / "ppo")}


def run(capsys, *argv):
    code = verify.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out):
    """{quantity: result} from the printed table."""
    cells = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "quantity" not in line]
    return {c[1].strip(): c[6].strip() for c in cells}


def write_adapter(tmp_path, body):
    path = tmp_path / "mine.py"
    path.write_text(body)
    return path


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_self_check_passes(dumps, capsys, script):
    code, out, _ = run(capsys, dumps[script], "--against", "self")
    assert code == 0, out
    results = rows(out)
    expected = ["advantages", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    expected += ["update"] if script == "grpo" else ["returns"]
    assert all(results[q] == "pass" for q in expected), out
    if script == "grpo":  # step 2 ran on the replayed weights
        assert "| log-probs | 1,2 |" in out and "| gradient | 1,2 |" in out


def test_self_check_passes_with_the_entropy_bonus(capsys, tmp_path):
    """The per-token loss of a dump made with --ent-coef includes -ent_coef * the dumped entropy."""
    ppo.main(ppo.Args(seed=3, prompts_per_step=8, max_new_tokens=4, sample_every=0, num_steps=1, ent_coef=0.5,
                      output_dir=str(tmp_path / "runs"), dump_dir=str(tmp_path / "dump")))  # fmt: skip
    code, out, _ = run(capsys, tmp_path / "dump", "--against", "self")
    assert code == 0 and rows(out)["per-token loss"] == "pass" and rows(out)["gradient"] == "pass", out

def test_a_wrong_implementation_fails(dumps, capsys, tmp_path):
    """Population std instead of torch's unbiased one, and a loss 0.1% too large: each named in its row."""
    adapter = write_adapter(tmp_path, """
import verify
ours = verify.load_adapter("self")
def group_advantages(batch, args):
    g = batch["rewards"].view(-1, args["group_size"])
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-4)).view(-1)
def train_loss(model, batch, args, critic=None):
    return ours.train_loss(model, batch, args) * 1.001
""")
    code, out, _ = run(capsys, dumps["grpo"], "--against", adapter)
    assert code == 1
    assert rows(out)["advantages"].startswith("FAIL") and rows(out)["gradient"].startswith("FAIL")
    assert rows(out)["kl"].startswith("skip: adapter has no kl()")
    assert out.strip().endswith("FAIL: advantages, gradient")


def test_a_tampered_dump_fails(dumps, capsys, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "dump"
    shutil.copytree(dumps["grpo"], copy)
    d = load_file(copy / "step000002.safetensors")
    d["loss"] = d["loss"] + 1e-4
    save_file(d, copy / "step000002.safetensors")
    code, out, _ = run(capsys, copy, "--against", "self")
    assert code == 1 and rows(out)["loss"].startswith("FAIL") and rows(out)["per-token loss"] == "pass"


def test_bad_input_gets_one_line(dumps, capsys, tmp_path):
    cases = [
        ([tmp_path / "nowhere"], "is not a dump folder (no metadata.json)"),
        ([dumps["grpo"], "--against", "nosuch"], "no adapter 'nosuch': pass one of self, trl, verl"),
        ([dumps["grpo"], "--against", write_adapter(tmp_path, "x = 1\n")], "defines none of the functions"),
        ([dumps["grpo"], "--set", "beta=1"], "adapter 'self' has no option 'beta'"),
        ([dumps["grpo"], "--tol", "speed=1"], "--tol 'speed=1': the quantities are"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert message in err, (argv, err)


def test_mismatched_shapes_get_one_line(dumps, capsys, tmp_path):
    adapter = write_adapter(tmp_path, """
import torch
def token_logprobs(model, batch, args):
    return torch.zeros(len(batch["completion_mask"]), batch["completion_mask"].shape[1] + 1)
""")
    code, out, err = run(capsys, dumps["grpo"], "--against", adapter)
    assert code == 2
    assert err.strip() == "error: step 1: the adapter's log-probs are (12, 5), the dump's new_logp (12, 4)"


def test_an_inconsistent_dump_gets_one_line(dumps, capsys, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "dump"
    shutil.copytree(dumps["grpo"], copy)
    d = load_file(copy / "step000001.safetensors")
    d["new_logp"] = torch.zeros(12, 7)
    save_file(d, copy / "step000001.safetensors")
    code, _, err = run(capsys, copy)
    assert code == 2 and "step 1: new_logp has shape (12, 7), completion_mask (12, 4)" in err


@pytest.mark.slow
def test_the_command_line(dumps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), dumps["ppo"]]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "all checks that ran passed" in out.stdout, out.stderr


# The shipped adapters of other implementations, skipped where the optional package is absent.


def test_trl_matches_once_aligned_and_names_the_difference_when_not(dumps, capsys):
    pytest.importorskip("trl", reason="trl is optional: pip install -r requirements-extra.txt")
    code, out, _ = run(capsys, dumps["grpo"], "--against", "trl", "--set", "use_bias_correction_kl=false")
    assert code == 0, out
    assert all(r == "pass" for q, r in rows(out).items() if q != "returns"), out
    code, out, _ = run(capsys, dumps["grpo"], "--against", "trl")  # TRL's default: the bias-corrected k3
    assert code == 1 and rows(out)["gradient"] == "FAIL at step 2" and rows(out)["loss"] == "pass", out
    assert "TRL use_bias_correction_kl=True, grpo.py --bias-corrected-kl False" in out


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_trl_loss_types(capsys, tmp_path, loss_agg):
    """dapo and dr_grpo, with TRL's default bias-corrected k3 matched by --bias-corrected-kl, and GSPO."""
    pytest.importorskip("trl", reason="trl is optional: pip install -r requirements-extra.txt")
    flags = dict(beta=0.1, loss_agg=loss_agg, bias_corrected_kl=True, num_iterations=2, scale_rewards="none")
    if loss_agg == "token-mean":
        flags.update(importance_level="sequence", scale_rewards="batch")
    code, out, _ = run(capsys, grpo_dump(tmp_path, **flags), "--against", "trl")
    assert code == 0, out


@pytest.mark.slow
def test_trl_weight_decay_is_named(capsys, tmp_path):
    pytest.importorskip("trl", reason="trl is optional: pip install -r requirements-extra.txt")
    dump = grpo_dump(tmp_path, beta=0.1, weight_decay=0.1, bias_corrected_kl=True)
    code, out, _ = run(capsys, dump, "--against", "trl")
    assert code == 1 and rows(out)["update"].startswith("FAIL") and rows(out)["gradient"] == "pass", out
    assert "the HF Trainer leaves biases and norm weights out of weight decay" in out


def verl_env():
    """verl lives in a folder of its own (adapters/verl.py): VERL_SITE, or .verl-site in the checkout."""
    site = os.environ.get("VERL_SITE") or os.path.join(ROOT, ".verl-site")
    if not os.path.isdir(os.path.join(site, "verl")):
        pytest.skip("verl is optional: pip install --no-deps --target .verl-site -r requirements-verl.txt")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": site}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_verl(dumps, script):
    env = verl_env()
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), dumps[script], "--against", "verl"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    results = rows(out.stdout)
    if script == "grpo":  # the batch std of the tiny defaults has no verl counterpart; the rest agrees
        assert out.returncode == 0, out.stdout + out.stderr
        assert results["advantages"].startswith("skip: verl's GRPO divides by the group's std")
    else:  # GAE whitening by the unbiased variance: the one difference, named
        assert out.returncode == 1 and "FAIL: advantages" in out.stdout, out.stdout + out.stderr
        assert results["returns"] == "pass" and results["gradient"] == "pass"
        assert "verl whitens them with the unbiased variance" in out.stdout
