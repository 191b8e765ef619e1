"""verify.py: the self-check passes on the recommended dumps with every branch exercised; NaN fails and prints as
NaN; a check that could not fail says so; adapter mistakes (an os._exit included) and bad input each get one line
with their own exit status. Peers: test_verify_peers.py; planted bugs: test_verify_planted.py; --accept and the
minimum a pass needs: test_verify_accept.py; dumps verify must refuse or replay: test_verify_dumps.py."""

import json
import os
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, ROOT, copy_dump, make_dump, rows, run, write_adapter

import verify


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_self_check_passes_with_every_branch_exercised(verify_dumps, capsys, script):
    code, out, _ = run(capsys, verify_dumps[script], "--against", "self")
    assert code == 0 and out.splitlines()[-1].startswith("PASS: "), out
    results = rows(out)
    expected = ["advantages", "replay", "log-probs", "kl", "per-token loss", "loss", "gradient"]
    expected += ["update"] if script == "grpo" else ["rewards", "returns", "kl_coef"]
    assert all(results[q] == "pass" for q in expected), out  # "pass" alone: no "never exercised"
    steps = "1,2,3" if script == "grpo" else "1,2,3,4"
    assert f"| gradient | {steps} |" in out and f"| replay | {steps} |" in out  # the replay reached the last step


def test_a_check_that_could_not_fail_says_so(verify_dumps, capsys):
    code, out, _ = run(capsys, verify_dumps["plain"], "--against", "self")
    assert code == 0 and "never exercised" in out.splitlines()[-1], out
    results = rows(out)
    assert "never exercised: a ratio away from 1" in results["per-token loss"], out
    assert "a KL that is not 0" in results["kl"] and "left padding" in results["log-probs"], out


NAN = """
import torch
from verifier.calls import load_adapter
ours = load_adapter("self")
def group_advantages(batch, args):
    a = ours.group_advantages(batch, args).clone()
    a[0] = float("nan")  # one NaN: it must fail the row, not hide it
    return a
def kl(batch, args):
    return ours.kl(batch, args) * float("nan")
def per_token_loss(batch, args):
    return ours.per_token_loss(batch, args) * float("nan")
def loss(batch, args):
    return ours.loss(batch, args) * float("inf")
def token_logprobs(model, batch, args):
    return ours.token_logprobs(model, batch, args) * float("nan")
def train_loss(model, batch, args, critic=None):
    return ours.train_loss(model, batch, args, critic) * float("nan")
"""


def test_nan_fails_every_row_and_prints_as_nan(verify_dumps, capsys, tmp_path):
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", write_adapter(tmp_path, NAN))
    assert code == 1
    results = rows(out)
    for q in ("advantages", "kl", "per-token loss", "log-probs", "gradient"):
        assert results[q].startswith("FAIL (NaN)"), out
        assert f"| {q} | 1,2,3 | NaN | NaN |" in out, out
    assert results["loss"].startswith("FAIL (inf)") and "| loss | 1,2,3 | inf | inf |" in out, out


def test_the_update_row_sees_the_optimizer_state(verify_dumps, capsys, tmp_path):
    """A fresh AdamW every step: the same first step (Adam's is scale-free), a different second."""
    adapter = write_adapter(
        tmp_path,
        """
from verifier.calls import load_adapter
ours = load_adapter("self")
def update(model, batch, args, state):
    state.clear()
    ours.update(model, batch, args, state)
""",
    )
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", adapter)
    assert code == 1 and rows(out)["update"].startswith("FAIL at step 2"), out


def test_a_tampered_dump_fails(verify_dumps, capsys, tmp_path):
    copy = copy_dump(verify_dumps["plain"], tmp_path / "dump")
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
    "complex values": (
        "import torch\nfrom verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "def group_advantages(batch, args):\n    return ours.group_advantages(batch, args) * (1 + 0j)",
        "group_advantages() returned complex values (torch.complex64): return reals",
    ),
    "the wrong shape": (
        "import torch\ndef kl(batch, args):\n    return torch.zeros(3, 1)",
        "kl() returned shape (3, 1) at step 1; the dump's kl is (12, 4)",
    ),
    "no autograd": (
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "def train_loss(model, batch, args, critic=None):\n    return ours.train_loss(model, batch, args)"
        ".detach()",
        "train_loss() returned a tensor of shape () without autograd",
    ),
    "exits on import": (
        "import sys\nsys.exit(0)\ndef loss(batch, args):\n    return 1",
        "called sys.exit(0) on import",
    ),
    "OPTIONS a list": (
        "OPTIONS = ['eps']\ndef loss(batch, args):\n    return 1",
        "OPTIONS is list ['eps']: make it a dict",
    ),
    "ends the process": (
        "import os\ndef loss(batch, args):\n    os._exit(0)",
        "loss() of adapter 'mine' ended verify's process (exit status 0; os._exit, a crash or a kill)",
    ),
    "ends the process on import": (
        "import os\nos._exit(0)\ndef loss(batch, args):\n    return 1",
        "importing adapter 'mine' ended verify's process (exit status 0",
    ),
    "is killed": (
        "import os, signal\ndef loss(batch, args):\n    os.kill(os.getpid(), signal.SIGKILL)",
        "loss() of adapter 'mine' ended verify's process (killed by SIGKILL",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_an_adapter_mistake_is_one_line_with_its_own_status(verify_dumps, capsys, tmp_path, mistake):
    body, message = MISTAKES[mistake]
    code, out, err = run(capsys, verify_dumps["plain"], "--against", write_adapter(tmp_path, body + "\n"))
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, (mistake, out, err)
    assert message in err, (mistake, err)


@pytest.mark.slow
def test_an_adapter_that_ends_the_process_in_the_script_is_not_a_pass(verify_dumps, tmp_path):
    """The command line too: the child's os._exit(0) is exit status 3 and a line, never a silent 0."""
    adapter = write_adapter(tmp_path, "import os\ndef loss(batch, args):\n    os._exit(0)\n")
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), verify_dumps["plain"], "--against", str(adapter)]
    out = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert out.returncode == 3 and "loss() of adapter 'mine' ended verify's process" in out.stderr, out


def test_a_child_ended_outside_an_adapter_call_gives_its_own_status(capsys):
    """verify's child process killed by a signal N where no adapter call runs (the kernel's out-of-memory killer:
    SIGKILL) exits 128 + N, 137, never a FAIL (1) nor an adapter mistake (3); one that exits with a status of its
    own gives it; inside an adapter call, any end is the adapter's mistake (3)."""
    from verifier import calls, isolation

    def killed(signum, inside=None):
        def target(opts):
            if inside:
                calls.mark(inside)
            if signum != signal.SIGKILL:  # a handler an earlier test left (StopSignal's) would catch SIGTERM
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        return target

    assert isolation.run(killed(signal.SIGKILL), None, threads=1) == 137
    assert "ended before its report (killed by SIGKILL)" in capsys.readouterr().err
    assert isolation.run(killed(signal.SIGTERM), None, threads=1) == 128 + signal.SIGTERM
    assert isolation.run(lambda opts: os._exit(5), None, threads=1) == 5
    assert isolation.run(killed(signal.SIGKILL, "adapter 'mine''s loss()"), None, threads=1) == 3
    assert "adapter 'mine''s loss() ended verify's process (killed by SIGKILL" in capsys.readouterr().err


def test_ctrl_c_in_the_adapter(verify_dumps, capsys, tmp_path):
    adapter = write_adapter(tmp_path, "def loss(batch, args):\n    raise KeyboardInterrupt\n")
    code, out, err = run(capsys, verify_dumps["plain"], "--against", adapter)
    assert code == 130 and err.strip() == "interrupted in loss() of adapter 'mine': no result", err


def test_a_stub_at_import_does_not_break_the_models(verify_dumps, capsys, tmp_path):
    adapter = write_adapter(
        tmp_path,
        "import sys, types\nsys.modules['deepspeed'] = types.ModuleType('deepspeed')\n"
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "group_advantages, loss = ours.group_advantages, ours.loss\n",
    )
    code, out, _ = run(capsys, verify_dumps["plain"], "--against", adapter)
    assert code == 0 and rows(out)["loss"].startswith("pass"), out
    assert "deepspeed" not in sys.modules  # the adapter ran in verify's child process


def test_bad_input_gets_one_line(verify_dumps, capsys, tmp_path):
    plain = verify_dumps["plain"]
    options = write_adapter(
        tmp_path, "OPTIONS = {'eps': 1e-4}\ndef kl(batch, args):\n    return batch['ref_logp']\n", "opts.py"
    )
    other = copy_dump(plain, tmp_path / "other")
    meta = json.loads((other / "metadata.json").read_text())
    (other / "metadata.json").write_text(json.dumps(dict(meta, script="ppo")))
    gone = copy_dump(plain, tmp_path / "gone")
    (gone / "metadata.json").write_text(json.dumps(dict(meta, args=dict(meta["args"], model=str(tmp_path / "no")))))
    cases = [
        ([tmp_path / "nowhere"], "is not a dump folder (no metadata.json)"),
        ([plain, "--against", "nosuch"], "no adapter 'nosuch': pass one of"),
        ([plain, "--against", write_adapter(tmp_path, "x = 1\n")], "defines none of the functions"),
        ([plain, "--set", "beta=1"], "adapter 'self' has no option 'beta'"),
        ([plain, "--against", options, "--set", "eps=abc"], "eps takes a float, like its default 0.0001"),
        ([plain, "--tol", "speed=1"], "--tol 'speed=1': the quantities are"),
        ([plain, "--tol", "loss=abc"], "the tolerance must be a finite number >= 0"),
        ([plain, "--tol", "advantages=nan"], "the tolerance must be a finite number >= 0"),
        ([plain, "--accept", "speed"], "--accept 'speed': the quantities are"),
        ([other], "says ppo.py but holds flags it has not"),
        ([gone], f"the dump's model '{tmp_path / 'no'}' cannot be loaded"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert message in err, (argv, err)


def test_an_older_dump_gets_the_defaults_named(verify_dumps, capsys, tmp_path):
    older = copy_dump(verify_dumps["plain"], tmp_path / "older")
    meta = json.loads((older / "metadata.json").read_text())
    del meta["args"]["adv_eps"]
    (older / "metadata.json").write_text(json.dumps(meta))
    code, out, _ = run(capsys, older, "--against", "self")
    assert code == 0 and "note: the dump has no adv_eps (an older version): their defaults are used" in out, out


@pytest.mark.slow
def test_the_command_line(verify_dumps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, os.path.join(ROOT, "verify.py"), verify_dumps["ppo"]]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("PASS: 12 of the adapter's rows"), out.stderr


def recipe(script):
    """The recommended command of verify.py's docstring, as Args fields; the docs give the same command."""
    text = verify.__doc__.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith(f"python {script}.py"))
    tokens = line.split("#")[0].split()[2:]
    fields = {tokens[i][2:].replace("-", "_"): tokens[i + 1] for i in range(0, len(tokens), 2)}
    pages = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "verify.md")]
    docs = " ".join(open(p, encoding="utf-8").read() for p in pages if os.path.isfile(p))
    command = " ".join(line.split("#")[0].split())
    assert command in " ".join(docs.replace("\\\n", " ").split()), f"README.md or docs/verify.md lacks {command}"
    return {k: v for k, v in fields.items() if k != "dump_dir"}


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_documented_recipe_is_the_tested_one(script):
    tested = GRPO_RECIPE if script == "grpo" else PPO_RECIPE
    documented = recipe(script)
    assert documented.keys() == tested.keys()
    assert all(str(tested[k]) == v or float(tested[k]) == float(v) for k, v in documented.items())


def test_self_check_passes_with_the_entropy_bonus(capsys, tmp_path):
    """The per-token loss of a dump made with --ent-coef includes -ent_coef * the dumped entropy."""
    dump = make_dump(tmp_path, "ppo", seed=3, prompts_per_step=8, max_new_tokens=4, num_steps=1, ent_coef=0.5)
    code, out, _ = run(capsys, dump, "--against", "self")
    results = rows(out)
    assert code == 0 and results["per-token loss"].startswith("pass") and results["gradient"].startswith("pass"), out


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
