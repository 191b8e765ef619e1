"""verify.py: the self-check passes on the recommended dumps with every branch exercised; peers with planted bugs
fail the row of the formula they break; NaN fails; a check that could not fail says so; adapter mistakes and
bad input each get one line with their own exit status; the shipped adapters (TRL, verl, OpenRLHF) agree once
the known differences are aligned, and name them when not."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import grpo
import ppo
import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# verify.py's recommended dumps (its docstring and docs/verify.md give the same commands).
GRPO_RECIPE = dict(
    task="copy:1-3",
    num_steps=3,
    num_iterations=2,
    learning_rate=1e-2,
    clip_low=0.05,
    clip_high=0.05,
    beta=0.1,
    max_new_tokens=4,
    temperature=0.8,
    weight_decay=0.1,
)
PPO_RECIPE = dict(
    task="copy:1-3",
    num_steps=3,
    prompts_per_step=16,
    learning_rate=1e-2,
    critic_learning_rate=1e-2,
    clip_low=0.05,
    clip_high=0.05,
    cliprange_value=0.01,
    target_kl=2.0,
    kl_horizon=100,
    max_new_tokens=4,
    temperature=0.8,
    gamma=0.95,
    micro_batch_size=4,
)


def make_dump(folder, script, **flags):
    module = grpo if script == "grpo" else ppo
    module.main(module.Args(**flags, sample_every=0, output_dir=str(folder / "runs"), dump_dir=str(folder / script)))
    return str(folder / script)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The recommended dumps, and a one-step GRPO dump at the defaults (ratio 1, KL 0: nothing exercised)."""
    folder = tmp_path_factory.mktemp("verify")
    plain = make_dump(
        tmp_path_factory.mktemp("plain"),
        "grpo",
        seed=3,
        prompts_per_step=3,
        group_size=4,
        max_new_tokens=4,
        num_steps=1,
    )
    return {
        "grpo": make_dump(folder, "grpo", **GRPO_RECIPE),
        "ppo": make_dump(folder, "ppo", **PPO_RECIPE),
        "plain": plain,
    }


def run(capsys, *argv):
    code = verify.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out):
    """{quantity: result} from the printed table."""
    cells = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "quantity" not in line]
    return {c[1].strip(): c[6].strip() for c in cells}


def write_adapter(tmp_path, body, name="mine.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_self_check_passes_with_every_branch_exercised(dumps, capsys, script):
    code, out, _ = run(capsys, dumps[script], "--against", "self")
    assert code == 0, out
    results = rows(out)
    expected = ["advantages", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    expected += ["update"] if script == "grpo" else ["rewards", "returns", "kl_coef"]
    assert all(results[q] == "pass" for q in expected), out  # "pass" alone: no "never exercised"
    assert "| gradient | 1,2,3 |" in out and "| log-probs | 1,2,3 |" in out  # the replay reached step 3


def test_a_check_that_could_not_fail_says_so(dumps, capsys):
    code, out, _ = run(capsys, dumps["plain"], "--against", "self")
    assert code == 0 and "never exercised" in out.splitlines()[-1], out
    results = rows(out)
    assert "never exercised: a ratio away from 1" in results["per-token loss"], out
    assert "a KL that is not 0" in results["kl"] and "left padding" in results["log-probs"], out


# Peers with planted bugs: this project's functions with one formula replaced, only while the adapter runs.
PLANTED = """
import contextlib, torch, common, grpo, ppo
from verifier import report as verify_report
ours = verify_report.load_adapter("self")

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
BUGS = {
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
CAUGHT_BY = {
    "value clip takes the min": ["per-token loss", "loss", "gradient"],
    "policy clip takes the min": ["per-token loss", "loss", "gradient"],
    "GRPO clip bound doubled": ["per-token loss", "loss", "gradient"],
    "PPO KL sign flipped": ["rewards", "kl", "kl_coef"],
    "GRPO KL sign flipped": ["kl"],
    "EOS penalty sign flipped": ["rewards"],
    "score one past the EOS": ["rewards"],
    "controller error not clipped": ["kl_coef"],
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_fails_its_rows_on_the_recommended_dump(dumps, capsys, tmp_path, bug):
    script, plant = BUGS[bug]
    code, out, err = run(capsys, dumps[script], "--against", write_adapter(tmp_path, PLANTED + plant))
    results = rows(out)
    assert code == 1, out + err
    assert all(results[q].startswith("FAIL") for q in CAUGHT_BY[bug]), out
    assert all(results[q] == "pass" for q in results if q not in CAUGHT_BY[bug] and not results[q].startswith("skip"))


def test_nan_fails_every_row(dumps, capsys, tmp_path):
    adapter = write_adapter(
        tmp_path,
        """
import torch
from verifier import report as verify_report
ours = verify_report.load_adapter("self")
def group_advantages(batch, args):
    a = ours.group_advantages(batch, args).clone()
    a[0] = float("nan")  # one NaN: it must fail the row, not hide it
    return a
def kl(batch, args):
    return ours.kl(batch, args) * float("nan")
def per_token_loss(batch, args):
    return ours.per_token_loss(batch, args) * float("nan")
def loss(batch, args):
    return ours.loss(batch, args) * float("nan")
def token_logprobs(model, batch, args):
    return ours.token_logprobs(model, batch, args) * float("nan")
def train_loss(model, batch, args, critic=None):
    return ours.train_loss(model, batch, args, critic) * float("nan")
""",
    )
    code, out, _ = run(capsys, dumps["grpo"], "--against", adapter)
    assert code == 1
    results = rows(out)
    for q in ("advantages", "kl", "per-token loss", "loss", "log-probs", "gradient"):
        assert results[q].startswith("FAIL (NaN or inf)"), out


def test_a_known_difference_is_shown_not_passed(dumps, capsys, tmp_path):
    adapter = write_adapter(
        tmp_path,
        """
from verifier import report as verify_report
ours = verify_report.load_adapter("self")
def group_advantages(batch, args):
    return ours.group_advantages(batch, dict(args, adv_eps=1e-2))
def known_differences(args, options):
    return {"advantages": "the std's eps is 1e-2 (mine.py)"}
""",
    )
    code, out, _ = run(capsys, dumps["grpo"], "--against", adapter)
    assert code == 1 and rows(out)["advantages"].startswith("FAIL"), out
    code, out, _ = run(capsys, dumps["grpo"], "--against", adapter, "--accept", "advantages")
    assert code == 0 and rows(out)["advantages"].startswith("differs (known: the std's eps is 1e-2 (mine.py))"), out
    code, _, err = run(capsys, dumps["grpo"], "--against", adapter, "--accept", "kl")
    assert code == 2 and "--accept kl: adapter 'mine' declares no known difference for it" in err


def test_the_update_row_sees_the_optimizer_state(dumps, capsys, tmp_path):
    """A fresh AdamW every step: the same first step (Adam's is scale-free), a different second."""
    adapter = write_adapter(
        tmp_path,
        """
from verifier import report as verify_report
ours = verify_report.load_adapter("self")
def update(model, batch, args, state):
    state.clear()
    ours.update(model, batch, args, state)
""",
    )
    code, out, _ = run(capsys, dumps["grpo"], "--against", adapter)
    assert code == 1 and rows(out)["update"].startswith("FAIL at step 2"), out


def test_a_tampered_dump_fails(dumps, capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "dump"
    shutil.copytree(dumps["plain"], copy)
    d = load_file(copy / "step000001.safetensors")
    d["loss"] = d["loss"] + 1e-4
    save_file(d, copy / "step000001.safetensors")
    code, out, _ = run(capsys, copy, "--against", "self")
    assert code == 1 and rows(out)["loss"].startswith("FAIL") and rows(out)["per-token loss"].startswith("pass")


MISTAKES = {
    "raises": ("def loss(batch, args):\n    raise KeyError('rewardz')", "loss() raised KeyError: 'rewardz'"),
    "does not compile": ("def loss(batch, args)\n    return 1", "does not compile: "),
    "exits": ("import sys\ndef loss(batch, args):\n    sys.exit(0)", "loss() called sys.exit(0)"),
    "returns None": ("def loss(batch, args):\n    pass", "loss() returned None: return its value, or raise"),
    "returns a string": ("def loss(batch, args):\n    return 'x'", "loss() returned str, not a tensor"),
    "the wrong shape": (
        "import torch\ndef kl(batch, args):\n    return torch.zeros(3, 1)",
        "kl() returned shape (3, 1) at step 1; the dump's kl is (12, 4)",
    ),
    "no autograd": (
        "from verifier import report as verify_report\nours = verify_report.load_adapter('self')\n"
        "def train_loss(model, batch, args, critic=None):\n    return ours.train_loss(model, batch, args)"
        ".detach()",
        "train_loss() returned a tensor of shape () without autograd",
    ),
    "exits on import": (
        "import sys\nsys.exit(0)\ndef loss(batch, args):\n    return 1",
        "called sys.exit(0) on import",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_an_adapter_mistake_is_one_line_with_its_own_status(dumps, capsys, tmp_path, mistake):
    body, message = MISTAKES[mistake]
    code, out, err = run(capsys, dumps["plain"], "--against", write_adapter(tmp_path, body + "\n"))
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, (mistake, out, err)
    assert message in err, (mistake, err)


def test_ctrl_c_in_the_adapter(dumps, capsys, tmp_path):
    adapter = write_adapter(tmp_path, "def loss(batch, args):\n    raise KeyboardInterrupt\n")
    code, out, err = run(capsys, dumps["plain"], "--against", adapter)
    assert code == 130 and err.strip() == "interrupted in adapter 'mine''s loss(): no result", err


def test_a_stub_at_import_does_not_break_the_models(dumps, capsys, tmp_path):
    adapter = write_adapter(
        tmp_path,
        "import sys, types\nsys.modules['deepspeed'] = types.ModuleType('deepspeed')\n"
        "from verifier import report as verify_report\nloss = verify_report.load_adapter('self').loss\n",
    )
    try:
        code, out, _ = run(capsys, dumps["plain"], "--against", adapter)
    finally:  # verify.py runs once a process: the stub must not reach the tests after this one
        sys.modules.pop("deepspeed", None)
    assert code == 0 and rows(out)["loss"].startswith("pass"), out


def test_bad_input_gets_one_line(dumps, capsys, tmp_path):
    options = write_adapter(
        tmp_path, "OPTIONS = {'eps': 1e-4}\ndef kl(batch, args):\n    return batch['ref_logp']\n", "opts.py"
    )
    other = tmp_path / "other"
    shutil.copytree(dumps["plain"], other)
    meta = json.loads((other / "metadata.json").read_text())
    (other / "metadata.json").write_text(json.dumps(dict(meta, script="ppo")))
    gone = tmp_path / "gone"
    shutil.copytree(dumps["plain"], gone)
    (gone / "metadata.json").write_text(json.dumps(dict(meta, args=dict(meta["args"], model=str(tmp_path / "no")))))
    cases = [
        ([tmp_path / "nowhere"], "is not a dump folder (no metadata.json)"),
        ([dumps["plain"], "--against", "nosuch"], "no adapter 'nosuch': pass one of"),
        ([dumps["plain"], "--against", write_adapter(tmp_path, "x = 1\n")], "defines none of the functions"),
        ([dumps["plain"], "--set", "beta=1"], "adapter 'self' has no option 'beta'"),
        ([dumps["plain"], "--against", options, "--set", "eps=abc"], "eps takes a float, like its default 0.0001"),
        ([dumps["plain"], "--tol", "speed=1"], "--tol 'speed=1': the quantities are"),
        ([dumps["plain"], "--tol", "loss=abc"], "the tolerance must be a finite number >= 0"),
        ([dumps["plain"], "--tol", "advantages=nan"], "the tolerance must be a finite number >= 0"),
        ([dumps["plain"], "--accept", "speed"], "--accept 'speed': the quantities are"),
        ([other], "says ppo.py but holds flags it has not"),
        ([gone], f"the dump's model '{tmp_path / 'no'}' cannot be loaded"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert message in err, (argv, err)


def test_an_older_dump_gets_the_defaults_named(dumps, capsys, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(dumps["plain"], older)
    meta = json.loads((older / "metadata.json").read_text())
    del meta["args"]["adv_eps"]
    (older / "metadata.json").write_text(json.dumps(meta))
    code, out, _ = run(capsys, older, "--against", "self")
    assert code == 0 and "note: the dump has no adv_eps (an older version): their defaults are used" in out, out


def test_an_inconsistent_dump_gets_one_line(dumps, capsys, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "dump"
    shutil.copytree(dumps["plain"], copy)
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


def test_trl_matches_once_aligned_and_names_the_difference_when_not(dumps, capsys, tmp_path):
    """The HF Trainer's weight-decay groups, then TRL's KL form: each named, each aligned by a flag."""
    pytest.importorskip("trl", reason="trl is optional: pip install -r requirements/extra.txt")
    code, out, _ = run(capsys, dumps["grpo"], "--against", "trl")
    assert code == 1 and rows(out)["update"].startswith("FAIL") and rows(out)["gradient"] == "pass", out
    assert "the HF Trainer leaves biases and norm weights out of weight decay" in out
    aligned = make_dump(tmp_path, "grpo", **GRPO_RECIPE, decay_norms_and_biases=False)
    code, out, _ = run(capsys, aligned, "--against", "trl")  # TRL's default: the bias-corrected k3
    assert code == 0 and all(r.startswith(("pass", "skip")) for r in rows(out).values()), out
    code, out, _ = run(capsys, aligned, "--against", "trl", "--set", "use_bias_correction_kl=false")
    assert code == 1 and rows(out)["gradient"].startswith("FAIL") and rows(out)["per-token loss"].startswith("FAIL")
    assert "TRL use_bias_correction_kl=False, grpo.py --bias-corrected-kl True" in out


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_trl_loss_types(capsys, tmp_path, loss_agg):
    """dapo and dr_grpo, with TRL's default bias-corrected k3 matched by --bias-corrected-kl, and GSPO."""
    pytest.importorskip("trl", reason="trl is optional: pip install -r requirements/extra.txt")
    flags = dict(GRPO_RECIPE, loss_agg=loss_agg, scale_rewards="none", decay_norms_and_biases=False)
    if loss_agg == "token-mean":
        flags.update(importance_level="sequence", scale_rewards="batch", clip_low=3e-4, clip_high=4e-4)
    code, out, _ = run(capsys, make_dump(tmp_path, "grpo", **flags), "--against", "trl")
    assert code == 0, out


def recipe(script):
    """The recommended command of verify.py's docstring, as Args fields; docs/verify.md gives the same command."""
    text = verify.__doc__.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith(f"python {script}.py"))
    tokens = line.split("#")[0].split()[2:]
    fields = {tokens[i][2:].replace("-", "_"): tokens[i + 1] for i in range(0, len(tokens), 2)}
    page = open(os.path.join(ROOT, "docs", "verify.md"), encoding="utf-8").read()
    assert " ".join(line.split("#")[0].split()) in page
    return {k: v for k, v in fields.items() if k != "dump_dir"}


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_documented_recipe_is_the_tested_one(script):
    tested = GRPO_RECIPE if script == "grpo" else PPO_RECIPE
    documented = recipe(script)
    assert documented.keys() == tested.keys()
    assert all(str(tested[k]) == v or float(tested[k]) == float(v) for k, v in documented.items() if k != "task")


def site_env(name, requirements):
    """An optional peer installed apart (adapters/NAME.py): NAME_SITE, or .NAME-site in the checkout."""
    site = os.environ.get(f"{name.upper()}_SITE") or os.path.join(ROOT, f".{name}-site")
    if not os.path.isdir(os.path.join(site, name)):
        pytest.skip(f"{name} is optional: pip install --no-deps --target .{name}-site -r {requirements}")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": site}


def run_peer(dump, peer, env, *flags):
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), dump, "--against", peer, *flags]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_verl(dumps, script):
    code, out = run_peer(dumps[script], "verl", site_env("verl", "requirements/verl.txt"))
    results = rows(out)
    if script == "grpo":  # the batch std of the tiny defaults has no verl counterpart; the rest agrees
        assert code == 0, out
        assert results["advantages"].startswith("skip: verl's GRPO divides by the group's std")
    else:  # GAE whitening by the unbiased variance: the one difference, named
        assert code == 1 and "FAIL: advantages" in out, out
        assert results["returns"].startswith("pass") and results["gradient"].startswith("pass")
        assert "verl whitens them with the unbiased variance" in out


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_openrlhf(dumps, tmp_path, script):
    """OpenRLHF's own functions agree once a dump has its settings, and name what differs when not."""
    env = site_env("openrlhf", "requirements/openrlhf.txt")
    if script == "ppo":  # its controller is fed the per-token mean KL: the one difference, named and accepted
        code, out = run_peer(dumps["ppo"], "openrlhf", env)
        assert code == 1 and rows(out)["kl_coef"].startswith("FAIL at step 3") and "FAIL: kl_coef" in out, out
        code, out = run_peer(dumps["ppo"], "openrlhf", env, "--accept", "kl_coef")
        assert code == 0 and rows(out)["kl_coef"].startswith("differs (known: OpenRLHF feeds"), out
    else:  # its GRPO: the group's std with eps 1e-9, the paper's k3
        flags = dict(GRPO_RECIPE, scale_rewards="group", bias_corrected_kl=False)
        code, out = run_peer(make_dump(tmp_path / "a", "grpo", **flags), "openrlhf", env)
        assert code == 1 and rows(out)["advantages"].startswith("FAIL") and "FAIL: advantages" in out, out
        code, out = run_peer(make_dump(tmp_path / "b", "grpo", **flags, adv_eps=1e-9), "openrlhf", env)
        assert code == 0, out
    expected = ["advantages", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    expected += ["rewards", "returns"] if script == "ppo" else []
    assert all(rows(out)[q] == "pass" for q in expected), out


def test_self_check_passes_with_the_entropy_bonus(capsys, tmp_path):
    """The per-token loss of a dump made with --ent-coef includes -ent_coef * the dumped entropy."""
    ppo.main(
        ppo.Args(
            seed=3,
            prompts_per_step=8,
            max_new_tokens=4,
            sample_every=0,
            num_steps=1,
            ent_coef=0.5,
            output_dir=str(tmp_path / "runs"),
            dump_dir=str(tmp_path / "dump"),
        )
    )
    code, out, _ = run(capsys, tmp_path / "dump", "--against", "self")
    assert code == 0 and rows(out)["per-token loss"].startswith("pass") and rows(out)["gradient"].startswith("pass"), (
        out
    )


def test_the_recommended_task_mixes_prompt_lengths():
    """copy:LOW-HIGH: as many prompts of each length, so a batch is left-padded; a reversed range is refused."""
    from machinery.errors import UsageError
    from tasks import load_task

    task = load_task("copy:1-3")
    lengths = [len(ex["answer"]) for ex in task.train]
    assert sorted(set(lengths)) == [1, 2, 3] and lengths.count(1) == lengths.count(3)
    assert task.reward_fn("1=", "1", "1") == 1.0
    with pytest.raises(UsageError, match="write copy:DIGITS, copy:LOW-HIGH"):
        load_task("copy:3-1")
