"""What the verify.py tests share: the recommended dumps' flags (verify.py's docstring gives the same commands),
running verify.py in-process and reading its table, writing adapters, and the optional peers' folders."""

import os
import shutil

import pytest

import grpo
import ppo
import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_RECIPE = dict(
    model="tiny-gpt2",
    task="copy:1-3",
    num_steps=3,
    num_iterations=2,
    learning_rate=1e-3,  # tiny-gpt2 moves fast: its log-ratios stay within +-2 nats, inside every peer's clamps
    warmup_steps=2,  # the learning rate moves from step to step: a schedule a step late shows
    clip_low=0.05,
    clip_high=0.08,  # apart from clip_low: swapped bounds show
    beta=0.1,
    max_new_tokens=4,
    temperature=0.8,
    weight_decay=1.0,  # lr * weight_decay 1e-3 a step: forgetting it moves the next log-probs by ~1e-2
    micro_batch_size=32,  # 4 micro-batches of the 128 completions: the loss's accumulation is compared
)
PPO_RECIPE = dict(
    model="tiny-gpt2",
    task="copy:1-3",
    num_steps=4,
    prompts_per_step=16,
    learning_rate=1e-2,
    critic_learning_rate=3e-3,  # apart from the policy's: a critic stepped at the policy's rate shows
    warmup_steps=2,
    clip_low=0.05,
    clip_high=0.08,
    cliprange_value=0.01,
    target_kl=1.0,  # summed KL 0, 1.07, 1.85 at steps 1-3: errors -1 (clipped low), +0.07 (within), +0.85 (high)
    kl_horizon=100,
    max_new_tokens=4,
    temperature=0.8,
    gamma=0.95,
    lam=0.9,  # apart from gamma: the two swapped show
    micro_batch_size=4,
    ent_coef=0.01,  # an entropy bonus: its sign and aggregation are compared
    weight_decay=0.01,
    max_grad_norm=0.3,  # step 4 then scores a completion that ends early (the rewards row's branch)
)
# A one-step GRPO dump of the tiny model at the defaults (ratio 1, KL 0): the rows say what it never exercised.
PLAIN = dict(seed=3, prompts_per_step=3, group_size=4, max_new_tokens=4, num_steps=1)


def make_dump(folder, script, **flags):
    module = grpo if script == "grpo" else ppo
    module.main(module.Args(**flags, sample_every=0, output_dir=str(folder / "runs"), dump_dir=str(folder / script)))
    return str(folder / script)


def run(capsys, *argv):
    """verify.py's exit status, stdout and stderr (of verify alone: what the test printed before is dropped)."""
    capsys.readouterr()
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


def copy_dump(dump, folder):
    shutil.copytree(dump, folder)
    return folder


def site(name, requirements):
    """An optional peer installed apart (adapters/NAME.py): $NAME_SITE, or .NAME-site in the checkout."""
    folder = os.environ.get(f"{name.upper()}_SITE") or os.path.join(ROOT, f".{name}-site")
    if not os.path.isdir(os.path.join(folder, name)):
        pytest.skip(f"{name} is optional: pip install --no-deps --target .{name}-site -r {requirements}")
    return folder


def planted_site(tmp_path, file, find, replace, name="openrlhf"):
    """A copy of a peer's folder (.NAME-site: OpenRLHF by default) with one line of `file` (under NAME/) changed: a
    bug planted in the peer."""
    original = site(name, f"requirements/{name}.txt")
    copy = tmp_path / f"{name}-site"
    shutil.copytree(os.path.join(original, name), copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / name / file
    text = path.read_text()
    assert text.count(find) == 1, f"{file}: the line to plant the bug in moved: {find!r}"
    path.write_text(text.replace(find, replace))
    return str(copy)


# An adapter that is this project's own, with one source line of grpo.py or ppo.py changed while it runs: a bug
# planted in a peer that otherwise agrees. ALGORITHMS is what the self adapter's entry points call.
PLANTED_SOURCE = """
import sys, types
from verifier.calls import load_adapter
ours = load_adapter("self")
FIND, REPLACE, SCRIPT = {find!r}, {replace!r}, {script!r}
path = ours.ALGORITHMS[SCRIPT].__file__
text = open(path).read()
assert text.count(FIND) == 1, FIND
planted = sys.modules[SCRIPT + "_planted"] = types.ModuleType(SCRIPT + "_planted")
planted.__file__ = path
exec(compile(text.replace(FIND, REPLACE), path, "exec"), planted.__dict__)
ours.ALGORITHMS = dict(ours.ALGORITHMS, **{{SCRIPT: planted}})
group_advantages, gae, rewards, kl_coef = ours.group_advantages, ours.gae, ours.rewards, ours.kl_coef
kl, per_token_loss, loss, train_loss = ours.kl, ours.per_token_loss, ours.loss, ours.train_loss
"""


def planted_source(script, find, replace):
    return PLANTED_SOURCE.format(script=script, find=find, replace=replace)
