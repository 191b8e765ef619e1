"""The flag table (docs/flags.md) and logging table (docs/logs.md) against the code: every field of
grpo.Args and ppo.Args (with the shared RunArgs) has its row with its default (and HUB_DEFAULTS value), and
every TensorBoard scalar one step of each script logs (recorded from the writer) has its row, ticked for the
scripts that log it. A failure names the missing and the extra rows. The meanings are prose, not compared."""

import dataclasses
import os
import re

import pytest
from torch.utils.tensorboard import SummaryWriter

import grpo
import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"grpo": grpo, "ppo": ppo}


def docs_table(page, heading):
    """The rows of the first table under `heading` of the docs page `page`: [cells], the header and separator left
    out."""
    text = "\n" + open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def shown(value):
    """A default as the flag table writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def expected_default(module, field):
    value = shown(field.default)
    if field.name in module.HUB_DEFAULTS:
        value += f" (hub {shown(module.HUB_DEFAULTS[field.name])})"
    return value


def differences(documented, code, what):
    """Lines naming the rows the code has and the docs page lacks, and the reverse."""
    missing, extra = sorted(code.keys() - documented.keys()), sorted(documented.keys() - code.keys())
    lines = [f"the docs page lacks the {what} row {name}: {code[name]}" for name in missing]
    lines += [
        f"the docs page has a {what} row {name} that the code does not have: {documented[name]}" for name in extra
    ]
    lines += [
        f"{what} {name}: the docs page says {documented[name]}, the code {code[name]}"
        for name in sorted(documented.keys() & code.keys())
        if documented[name] != code[name]
    ]
    return lines


def test_the_flag_table_is_the_args_of_both_scripts():
    documented = {}
    for cells in docs_table("flags.md", "# Every flag"):
        flag = re.match(r"`(--[\w-]+)", cells[0]).group(1)
        documented[flag] = dict(grpo=cells[1], ppo=cells[2])
    code = {}
    for script, module in SCRIPTS.items():
        for field in dataclasses.fields(module.Args):
            flag = "--" + field.name.replace("_", "-")
            code.setdefault(flag, dict(grpo="-", ppo="-"))[script] = expected_default(module, field)
    if differences(documented, code, "flag"):
        pytest.fail("\n".join(differences(documented, code, "flag")))


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """{script: the scalar names one step logs}, with a reference, an evaluation and PPO's critic."""
    names, add_scalar = {}, SummaryWriter.add_scalar
    folder = tmp_path_factory.mktemp("logged")
    for script, module in SCRIPTS.items():
        names[script] = set()

        def record(self, tag, *args, _names=names[script], **kwargs):
            _names.add(tag)
            return add_scalar(self, tag, *args, **kwargs)

        SummaryWriter.add_scalar = record
        try:
            module.main(
                module.Args(num_steps=1, prompts_per_step=4, eval_every=1, sample_every=0, output_dir=str(folder))
            )
        finally:
            SummaryWriter.add_scalar = add_scalar
    return names


def test_the_logging_table_is_what_the_loops_log(logged):
    documented = {}
    for cells in docs_table("logs.md", "# What is logged"):
        for name in re.findall(r"`([\w/]+)`", cells[0]):
            documented[name] = (
                ", ".join(script for script, cell in zip(SCRIPTS, cells[1:3]) if cell == "✓") or "neither"
            )
    code = {}
    for script in SCRIPTS:
        for name in logged[script]:
            code[name] = ", ".join(s for s in SCRIPTS if name in logged[s])
    if differences(documented, code, "scalar"):
        pytest.fail("\n".join(differences(documented, code, "scalar")))
