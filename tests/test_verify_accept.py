"""What a pass of verify.py must mean: a known difference accepted only within the bound its adapter declares
(a NaN, a flipped sign or a larger difference fails it), never called "within tolerance"; no pass without the
advantages and a loss row compared (exit 4, saying why); no adapter function handed the value it is checked
against; a relative difference measured against the row's scale, not each element's."""

import pytest
from verify_helpers import rows, run, write_adapter

from verifier import report as verify_report

KNOWN = """
import torch
from verifier.calls import load_adapter
ours = load_adapter("self")
CHANGE = {change!r}

def group_advantages(batch, args):
    a = ours.group_advantages(batch, dict(args, adv_eps=CHANGE["eps"])) * CHANGE["sign"]
    if CHANGE["nan"]:
        a[0] = float("nan")
    return a

per_token_loss, loss = ours.per_token_loss, ours.loss

def known_differences(args, options):
    why, where, derivation = "the std's eps is 1e-3", "mine.py, group_advantages", "eps / std, std > 0.02"
    return {{"advantages": dict(why=why, where=where, bound=("rel", 0.05), derivation=derivation)}}
"""


def known(tmp_path, eps=1e-3, sign=1, nan=False):
    change = dict(eps=eps, sign=sign, nan=nan)
    return write_adapter(tmp_path, KNOWN.format(change=change), f"mine_{abs(hash(str(change)))}.py")


def test_a_known_difference_within_its_bound_is_shown_and_counted_apart(verify_dumps, capsys, tmp_path):
    adapter = known(tmp_path)
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", adapter)
    assert code == 1 and rows(out)["advantages"].startswith("FAIL at step"), out
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", adapter, "--accept", "advantages")
    expected = "differs (known: the std's eps is 1e-3 (mine.py, group_advantages); bound rel 5e-02, derived: eps / std"
    assert code == 0 and rows(out)["advantages"].startswith(expected), out
    summary = out.splitlines()[-1]
    assert summary.startswith("PASS: 2 of the adapter's rows within their tolerances (per-token loss, loss)")
    assert (
        "1 accepted as known differences (the declared expectation within the tolerance, or a derived bound), beyond "
        "the tolerance from this project: advantages" in summary
    )
    assert "within tolerance" not in out.replace("within their tolerances (per-token", "")


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(eps=0.5), "(beyond the known rel 5e-02: at most"),
        (dict(sign=-1), "(a sign flipped: not the known difference)"),
        (dict(nan=True), "(NaN)"),
    ],
)
def test_an_accepted_row_fails_beyond_its_bound_on_nan_and_on_a_flipped_sign(
    verify_dumps, capsys, tmp_path, change, why
):
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", known(tmp_path, **change), "--accept", "advantages")
    assert code == 1 and rows(out)["advantages"].startswith(f"FAIL {why}"), out


@pytest.mark.parametrize(
    "declared, message",
    [
        ("'eps differs'", "known_differences()['advantages'] is eps differs, without a why and a where"),
        ("dict(why='eps', where='x', derivation='d', bound=('rel', -1))", "has the bound value -1, not a finite"),
        ("dict(why='eps', where='x', derivation='d', bound=('rel', 10**400))", "has the bound value 1000000"),
        ("dict(why='eps', where='x', derivation='d', bound=('rel', 1e300))", "beyond the ceiling rel 1"),
        ("dict(why='eps', where='x', derivation='d', bound=('rel', True))", "has the bound value True"),
        ("dict(why='eps', bound=('rel', 1e-2))", "keyed by one of advantages"),
    ],
)
def test_a_known_difference_without_a_bound_is_an_adapter_mistake(verify_dumps, capsys, tmp_path, declared, message):
    body = "def loss(batch, args):\n    return 1\ndef known_differences(args, options):\n"
    body += f"    return {{'advantages': {declared}}}\n"
    code, out, err = run(capsys, verify_dumps["plain"], "--against", write_adapter(tmp_path, body))
    assert code == 3 and out == "" and message in err, err


def test_an_absolute_bound_counts_at_most_the_rows_own_size(verify_dumps, capsys, tmp_path):
    """A per-token loss 1000x ours under a declared abs 1e300: the bound is capped at the row's size, and fails."""
    body = (
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "group_advantages = ours.group_advantages\n"
        "def per_token_loss(batch, args):\n    return 1000 * ours.per_token_loss(batch, args)\n"
        "def known_differences(args, options):\n"
        "    return {'per-token loss': dict(why='x', where='y', derivation='d', bound=('abs', 1e300))}\n"
    )
    code, out, _ = run(
        capsys, verify_dumps["grpo"], "--against", write_adapter(tmp_path, body), "--accept", "per-token loss"
    )
    assert code == 1 and rows(out)["per-token loss"].startswith("FAIL (beyond the known abs 1e+300, capped at"), out


def test_an_accepted_gradient_must_keep_its_direction(verify_dumps, capsys, tmp_path):
    """A gradient's small elements may change sign under a real difference; its direction may not (cosine 0.5)."""
    body = (
        "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
        "group_advantages = ours.group_advantages\n"
        "def train_loss(model, batch, args, critic=None):\n    return -ours.train_loss(model, batch, args, critic)\n"
        "def known_differences(args, options):\n"
        "    return {'gradient': dict(why='x', where='y', derivation='d', bound=('rel', 1.0))}\n"
    )
    code, out, _ = run(
        capsys, verify_dumps["plain"], "--against", write_adapter(tmp_path, body), "--accept", "gradient"
    )
    assert code == 1 and rows(out)["gradient"].startswith("FAIL (its direction is more than 60 degrees"), out


@pytest.mark.parametrize(
    "body, message",
    [
        (  # a value verify cannot read: the adapter's, not the dump's
            "def group_advantages(batch, args):\n    return torch.zeros(len(batch['rewards']), device='meta')\n",
            "group_advantages() returned a tensor that cannot be read as float32",
        ),
        (  # a model its update() left broken
            "def update(model, batch, args, state):\n    model.get_output_embeddings().weight = None\n",
            "the models its update() left cannot compute log-probs or values",
        ),
    ],
)
def test_a_mistake_past_the_adapters_call_is_the_adapters(verify_dumps, capsys, tmp_path, body, message):
    """Exit status 3 naming the adapter, not 2 ("the dump is damaged")."""
    head = "import torch\nfrom verifier.calls import load_adapter\nours = load_adapter('self')\n"
    head += "group_advantages, per_token_loss = ours.group_advantages, ours.per_token_loss\n"
    code, out, err = run(capsys, verify_dumps["grpo"], "--against", write_adapter(tmp_path, head + body))
    assert code == 3 and "adapter 'mine'" in err and message in err and "damaged" not in err, err


FUNCTIONS = ("group_advantages", "gae", "rewards", "kl_coef", "token_logprobs", "kl", "per_token_loss", "loss")
NOT_IMPLEMENTED = "".join(
    f"def {name}(*args):\n    raise NotImplementedError('not in my code')\n"
    for name in FUNCTIONS + ("train_loss", "update")
)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_nothing_compared_is_not_a_pass(verify_dumps, capsys, tmp_path, script):
    code, out, _ = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, NOT_IMPLEMENTED))
    assert code == verify_report.INCOMPLETE == 4, out
    assert out.splitlines()[-1].startswith(
        "INCOMPLETE: compared nothing of the adapter's; a pass needs the advantages row and a loss row (per-token "
        "loss, loss or gradient) compared (skipped: advantages: not in my code; per-token loss: not in my code"
    ), out


def test_one_row_compared_is_not_a_pass(verify_dumps, capsys, tmp_path):
    """Log-probs alone (as OpenRLHF's adapter on a GRPO dump with the batch's std and the ratio-weighted k3)."""
    adapter = write_adapter(
        tmp_path, "from verifier.calls import load_adapter\ntoken_logprobs = load_adapter('self').token_logprobs\n"
    )
    code, out, _ = run(capsys, verify_dumps["grpo"], "--against", adapter)
    assert code == 4 and out.splitlines()[-1].startswith(
        "INCOMPLETE: compared log-probs of the adapter's; a pass needs"
    ), out
    assert rows(out)["log-probs"] == "pass"


ALONE = {
    "advantages": "group_advantages, gae = ours.group_advantages, ours.gae\n",
    "loss rows": "per_token_loss, loss = ours.per_token_loss, ours.loss\n",
}


@pytest.mark.parametrize("script", ["grpo", "ppo"])
@pytest.mark.parametrize("alone", list(ALONE))
def test_the_advantages_or_the_loss_rows_alone_are_not_a_pass(verify_dumps, capsys, tmp_path, script, alone):
    """A pass needs both: the advantages compared without a loss row, or the loss rows without the advantages, is
    INCOMPLETE (exit 4) however well they agree; both together pass."""
    head = "from verifier.calls import load_adapter\nours = load_adapter('self')\n"
    code, out, _ = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, head + ALONE[alone]))
    compared = "advantages" if alone == "advantages" else "per-token loss, loss"
    assert code == verify_report.INCOMPLETE and out.splitlines()[-1].startswith(f"INCOMPLETE: compared {compared}"), out
    both = write_adapter(tmp_path, head + "".join(ALONE.values()), "both.py")
    code, out, _ = run(capsys, verify_dumps[script], "--against", both)
    assert code == 0 and out.splitlines()[-1].startswith("PASS: "), out


SNOOP = """
from verifier.calls import load_adapter
ours = load_adapter("self")
ANSWERS = {  # what each function's result is compared with, and so must never be among its inputs
    "token_logprobs": ("old_logp", "new_logp", "ref_logp"),
    "group_advantages": ("advantages",),
    "gae": ("advantages", "returns"),
    "rewards": ("rewards",),
    "per_token_loss": ("per_token_loss", "loss"),
    "loss": ("per_token_loss", "loss"),
}

def snooping(name):
    def function(*inputs):
        given = [key for key in ANSWERS[name] if key in inputs[-2]]
        if given:
            raise ValueError(f"{name} was handed {given}")
        return getattr(ours, name)(*inputs)
    return function

for name in ANSWERS:
    globals()[name] = snooping(name)
"""


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_no_adapter_call_is_handed_its_answer(verify_dumps, capsys, tmp_path, script):
    """Every call of each function, token_logprobs on the policy and on the reference alike, gets its inputs
    without the values it is compared with (an adapter that read them would pass by echoing them)."""
    code, out, err = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, SNOOP))
    assert code == 0 and "was handed" not in err, (out, err)
    assert rows(out)["log-probs"] == "pass", out


ECHO = """
import torch
from verifier.calls import load_adapter
ours = load_adapter("self")
KEY = {key!r}

def echo(batch, value, key):  # the batch's own value where it has one (a naming clash, a cache): 0 without it
    return batch.get(KEY, torch.zeros_like(value)) if key == KEY else value

def group_advantages(batch, args):
    return echo(batch, ours.group_advantages(batch, args), "advantages")

def gae(batch, args):
    advantages, returns = ours.gae(batch, args)
    return echo(batch, advantages, "advantages"), echo(batch, returns, "returns")

def rewards(batch, args):
    return echo(batch, ours.rewards(batch, args), "rewards")

def per_token_loss(batch, args):
    return echo(batch, ours.per_token_loss(batch, args), "per_token_loss")

def loss(batch, args):
    return echo(batch, ours.loss(batch, args), "loss")

def token_logprobs(model, batch, args):
    return echo(batch, ours.token_logprobs(model, batch, args), "new_logp" if args["script"] == "grpo" else "old_logp")
"""
ECHOED = [
    ("grpo", "advantages", "advantages"),
    ("grpo", "per_token_loss", "per-token loss"),
    ("grpo", "loss", "loss"),
    ("grpo", "new_logp", "log-probs"),
    ("ppo", "advantages", "advantages"),
    ("ppo", "returns", "returns"),
    ("ppo", "rewards", "rewards"),
    ("ppo", "per_token_loss", "per-token loss"),
    ("ppo", "loss", "loss"),
    ("ppo", "old_logp", "log-probs"),
]


@pytest.mark.parametrize("script, key, row", ECHOED)
def test_an_adapter_that_echoes_the_batch_fails(verify_dumps, capsys, tmp_path, script, key, row):
    """Each function gets its inputs alone: the value it is compared with is not in its batch, so an adapter that
    returns the batch's own `key` (or 0 without it) fails that row; one that reads it is a KeyError (exit 3)."""
    code, out, _ = run(capsys, verify_dumps[script], "--against", write_adapter(tmp_path, ECHO.format(key=key)))
    assert code == 1 and rows(out)[row].startswith("FAIL"), out
    reads = write_adapter(
        tmp_path, ECHO.format(key=key).replace("batch.get(KEY, torch.zeros_like(value))", "batch[KEY]"), "reads.py"
    )
    code, _, err = run(capsys, verify_dumps[script], "--against", reads)
    assert code == 3 and f"raised KeyError: '{key}'" in err, err


def test_a_relative_difference_is_against_the_rows_scale():
    """Two rows, each off by 1e-3 on one element: relative to the row's largest value (over every step), however
    small that element; a loss's scale is what the caller passes (its per-token losses)."""
    import torch

    report = verify_report.Report(verify_report.TOLERANCES)
    expected = torch.tensor([[1e-9, 2.0], [0.5, -1.0]])
    report.add("kl", 1, expected + torch.tensor([[1e-3, 0], [0, 0]]), expected)
    report.add("kl", 2, torch.zeros(2, 2), torch.zeros(2, 2))  # a step whose KL is 0 everywhere (step 1's)
    report.add("loss", 1, torch.tensor(1e-9 + 1e-7), torch.tensor(1e-9), scale=0.5)
    assert report.largest("kl") == pytest.approx(1e-3) and report.scale("kl") == 2.0
    table = report.table()
    assert "| kl | 1,2 | 1.00e-03 | 5.00e-04 |" in table and "| loss | 1 | 1.00e-07 | 2.00e-07 |" in table, table
