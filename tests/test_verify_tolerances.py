"""verify.py fails each row on a near miss: off by 1.5 times that row's tolerance (an absolute row: one value
moved by it; a relative row: every value scaled by 1 + it; the update: scaled from a first, larger miss), while
a miss of half the tolerance passes. The reference's log-probs are compared too: a dump whose ref_logp is off
fails the log-probs row, and so does an adapter whose reference log-probs alone are off; a dump whose stored
log-probs are off fails the replay row. Exit status 1 is a failed check (2: bad input, 3: an adapter mistake, 4: too
little compared for a pass)."""

import re
import shutil

import pytest
from safetensors.torch import load_file, save_file
from verify_helpers import rows, run

import verify
from verifier import report as verify_report

# verify.py's tolerances as documented (docs/verify.md, "Tolerances"; verify.py): written here, so a loosened one fails
DOCUMENTED = {
    "advantages": ("rel", 1e-5),
    "rewards": ("abs", 1e-6),
    "returns": ("abs", 1e-6),
    "kl_coef": ("rel", 1e-6),
    "replay": ("abs", 1e-5),
    "log-probs": ("abs", 1e-5),
    "kl": ("rel", 1e-6),
    "per-token loss": ("abs", 1e-6),
    "loss": ("abs", 1e-6),
    "gradient": ("rel", 1e-5),
    "critic gradient": ("rel", 1e-5),
    "update": ("rel", 2e-4),
    "critic update": ("rel", 2e-4),
}
ADAPTER = """
import torch
import verify
ours = verify.load_adapter("self")
DELTA = {delta!r}
group_advantages, gae, per_token_loss = ours.group_advantages, ours.gae, ours.per_token_loss  # a pass's minimum

def bump(x):
    x = torch.as_tensor(x).clone()
    x.view(-1)[0] += DELTA  # the first completion's first token (always a real one)
    return x

def scale(x):
    return torch.as_tensor(x) * (1 + DELTA)  # the largest value moves by DELTA times itself: a relative miss
"""
OVERRIDES = {  # quantity: the adapter's functions, each ours with one value moved by DELTA
    "advantages": """
def group_advantages(batch, args):
    return scale(ours.group_advantages(batch, args))
def gae(batch, args):
    advantages, returns = ours.gae(batch, args)
    return scale(advantages), returns
""",
    "rewards": "def rewards(batch, args):\n    return bump(ours.rewards(batch, args))\n",
    "returns": """
def gae(batch, args):
    advantages, returns = ours.gae(batch, args)
    return advantages, bump(returns)
""",
    "log-probs": "def token_logprobs(model, batch, args):\n    return bump(ours.token_logprobs(model, batch, args))\n",
    "kl_coef": "def kl_coef(batch, args):\n    return scale(ours.kl_coef(batch, args))\n",
    "kl": "def kl(batch, args):\n    return scale(ours.kl(batch, args))\n",
    "per-token loss": "def per_token_loss(batch, args):\n    return bump(ours.per_token_loss(batch, args))\n",
    "loss": "def loss(batch, args):  # DELTA shared over the micro-batches\n"
    "    share = len(batch['new_logp']) / batch['num_seqs'] if args['script'] == 'grpo' else 1\n"
    "    return ours.loss(batch, args) + DELTA * share\n",
    "gradient": """
def train_loss(model, batch, args, critic=None):
    return ours.train_loss(model, batch, args, critic) * (1 + DELTA)
""",
    "update": """
def update(model, batch, args, state, critic=None):
    ours.update(model, batch, args, state, critic)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1 + DELTA)  # every logit scaled: a log-prob miss linear in DELTA
""",
}


PPO_UPDATE = ("rel", 1e-2)  # a PPO dump's update row (docs/verify.md, "How the update's tolerance was chosen")


def test_the_tolerances_are_the_documented_ones():
    assert dict(verify.TOLERANCES) == DOCUMENTED
    assert verify_report.parse_tolerances([], "ppo") == dict(
        DOCUMENTED, update=PPO_UPDATE, **{"critic update": PPO_UPDATE}
    )


@pytest.fixture
def dumps(verify_dumps):
    """verify.py's recommended dumps (its docstring), so that every row's branches are exercised."""
    return verify_dumps


def verify_with(capsys, tmp_path, dump, quantity, delta):
    path = tmp_path / f"near_{abs(hash((quantity, delta)))}.py"
    path.write_text(ADAPTER.format(delta=delta) + OVERRIDES[quantity])
    code, out, _ = run(capsys, dump, "--against", path)
    return code, rows(out)[quantity], out


@pytest.mark.parametrize(
    "script, quantity",
    [
        ("grpo", "advantages"),
        ("grpo", "log-probs"),
        ("grpo", "kl"),
        ("grpo", "per-token loss"),
        ("grpo", "loss"),
        ("grpo", "gradient"),
        ("ppo", "advantages"),
        ("ppo", "rewards"),
        ("ppo", "returns"),
        ("ppo", "kl_coef"),
        ("ppo", "log-probs"),
        ("ppo", "kl"),
        ("ppo", "per-token loss"),
        ("ppo", "loss"),
        ("ppo", "gradient"),
    ],
)
def test_a_near_miss_fails_its_row(dumps, capsys, tmp_path, script, quantity):
    tolerance = DOCUMENTED[quantity][1]
    code, result, out = verify_with(capsys, tmp_path, dumps[script], quantity, 1.5 * tolerance)
    assert code == 1 and result.startswith("FAIL"), out
    code, result, out = verify_with(capsys, tmp_path, dumps[script], quantity, 0.5 * tolerance)
    assert code == 0 and result.split(";")[0] == "pass", out  # perhaps noting a branch this dump never exercised


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_a_near_miss_of_the_update_fails(dumps, capsys, tmp_path, script):
    tolerance = (DOCUMENTED["update"] if script == "grpo" else PPO_UPDATE)[1]
    # the miss of a 1e-3 scaling (where it is linear: at 1e-2 PPO's compounds over its 12 optimizer steps)
    _, _, out = verify_with(capsys, tmp_path, dumps[script], "update", 1e-3)
    miss = float(re.search(r"\| update \| \S+ \| (\S+) \|", out).group(1))
    code, result, out = verify_with(capsys, tmp_path, dumps[script], "update", 1e-3 * 1.5 * tolerance / miss)
    assert code == 1 and result.startswith("FAIL"), out
    code, result, out = verify_with(capsys, tmp_path, dumps[script], "update", 1e-3 * 0.5 * tolerance / miss)
    assert code == 0 and result.split(";")[0] == "pass", out  # perhaps noting a branch this dump never exercised


REFERENCE_ONLY = """
INITIAL = {}

def setup(args, options, model):
    INITIAL["weight"] = model.get_output_embeddings().weight.detach().clone()

def token_logprobs(model, batch, args):  # moved only where the model is the initial one, the reference
    logp = ours.token_logprobs(model, batch, args)
    return bump(logp) if torch.equal(model.get_output_embeddings().weight, INITIAL["weight"]) else logp
"""


def test_a_near_miss_of_the_reference_log_probs_fails(dumps, capsys, tmp_path):
    """An adapter whose reference log-probs alone are off (the policy has moved by the first check: mu = 2)."""
    tolerance = DOCUMENTED["log-probs"][1]
    for delta, expected_code in ((1.5 * tolerance, 1), (0.5 * tolerance, 0)):
        path = tmp_path / f"reference_{expected_code}.py"
        path.write_text(ADAPTER.format(delta=delta) + REFERENCE_ONLY)
        code, out, _ = run(capsys, dumps["grpo"], "--against", path)
        assert code == expected_code and rows(out)["log-probs"].startswith("FAIL" if code else "pass"), out


@pytest.mark.parametrize("key, row", [("new_logp", "replay"), ("old_logp", "replay"), ("ref_logp", "log-probs")])
def test_a_dump_whose_log_probs_are_slightly_off_fails(dumps, capsys, tmp_path, key, row):
    """Step 2's stored log-probs moved by 1.5 times the tolerance on one token: the policy's fail the replay (the
    run trained otherwise than its dump says), the reference's the log-probs row."""
    copy = tmp_path / "dump"
    shutil.copytree(dumps["grpo"], copy)
    d = load_file(copy / "step000002.safetensors")
    d[key][0, 0] += 1.5 * DOCUMENTED[row][1]
    save_file(d, copy / "step000002.safetensors")
    code, out, _ = run(capsys, copy, "--against", "self")
    assert code == 1 and rows(out)[row].startswith("FAIL at step 2"), out
