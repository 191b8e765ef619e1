"""The flag table (docs/flags.md) and logging table (docs/logs.md) against the code: every row of the flag table
is a field of grpo.Args or ppo.Args (with the shared RunArgs) with its default (and HUB_DEFAULTS value), and
every TensorBoard scalar one step of each script logs (recorded from the writer) has its row, ticked for the
scripts that log it. A failure names the missing and the extra rows. The meanings are prose, not compared."""

import dataclasses
import os
import re
import sys
import types

import pytest
from torch.utils.tensorboard import SummaryWriter

import grpo
import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"grpo": grpo, "ppo": ppo}
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import doc_figures  # noqa: E402


def docs_table(page, heading):
    """The rows of the first table under `heading` of the docs page `page`: [cells], the header and separator left
    out."""
    text = "\n" + open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


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


def test_each_row_of_the_flag_table_is_a_flag_with_its_default():
    """No stale row, no wrong default. A field the table lacks is no failure here (a fork's new flag: its --help
    documents it); benchmarks/doc_figures.py --check lists those before a release, and --write adds them."""
    code, _ = doc_figures.code_flags(SCRIPTS)
    documented = doc_figures.documented_flags(open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8").read())
    assert len(documented) > 40  # the table was read
    wrong = doc_figures.wrong_rows(documented, code)
    assert not wrong, "\n".join(wrong)


def test_each_row_of_reward_model_flag_table_is_one_of_its_flags_with_its_default():
    """docs/flags.md's second table, reward_model.py's flags, as the first: no stale row, no wrong default, read."""
    import reward_model

    code, _ = doc_figures.code_flags({"reward_model": reward_model})
    page = open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8").read()
    documented = doc_figures.documented_flags(page, doc_figures.RM_HEADING, ("reward_model",))
    assert len(documented) > 20 and documented["--num-pairs"] == {"reward_model": "6144 (hub 2048)"}
    assert not doc_figures.wrong_rows(documented, code)
    assert "--group-size" not in documented and "--label-beta" not in doc_figures.documented_flags(page)


def test_a_forks_new_flag_is_missing_from_the_table_not_wrong_in_it():
    """What a fork of grpo.py that adds a field meets: the table check passes, the release check names the row."""

    @dataclasses.dataclass
    class Forked(grpo.Args):
        cispo_clip: float = 5.0
        """the importance weight is clipped above at 1 + cispo_clip"""

    forked = types.SimpleNamespace(Args=Forked, HUB_DEFAULTS=grpo.HUB_DEFAULTS)
    code, meanings = doc_figures.code_flags(dict(grpo=forked, ppo=ppo))
    documented = doc_figures.documented_flags(open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8").read())
    assert doc_figures.wrong_rows(documented, code) == []
    assert "docs/flags.md lacks a row for --cispo-clip: {'grpo': '5.0', 'ppo': '-'}" in doc_figures.missing_rows(
        documented, code
    )
    assert meanings["--cispo-clip"] == "the importance weight is clipped above at 1 + cispo_clip"
    del code["--clip-low"]  # a row for a flag no script has, and a wrong default, are failures
    code["--seed"]["ppo"] = "2"
    assert doc_figures.wrong_rows(documented, code) == [
        "docs/flags.md has a row --clip-low that no script has",
        "docs/flags.md: --seed says {'grpo': '1', 'ppo': '1'}, the code {'grpo': '1', 'ppo': '2'}",
    ]


@pytest.mark.parametrize(
    "above", ["", "Checked by benchmarks/doc_figures.py.\n\n"], ids=["as-shipped", "a-line-above-the-heading"]
)
def test_doc_figures_write_adds_only_the_missing_rows_and_the_measured_figures(tmp_path, monkeypatch, above):
    """--write on a copy of the docs, for a fork that adds one flag and whose two files differ in 6 of 14 lines
    (main: 4 of 6): the table gains that flag's row after its last row and nothing else (no second row for a flag
    it has), the README states 43% and 67, each in its place; --check passes afterwards and failed before."""

    @dataclasses.dataclass
    class Forked(grpo.Args):
        cispo_clip: float = 5.0
        """the importance weight is clipped above at 1 + cispo_clip"""

    (tmp_path / "docs").mkdir()
    for path, text in (("README.md", ""), (doc_figures.FLAGS_PAGE, above)):
        text += open(os.path.join(ROOT, path), encoding="utf-8").read()
        (tmp_path / path).write_text(text, encoding="utf-8")
    (tmp_path / "grpo.py").write_text("import x\ns0 = 0\ns1 = 0\ndef main():\n    p\n    q\nz = 0\n")
    (tmp_path / "ppo.py").write_text("import x\ns0 = 0\ns1 = 0\ndef main():\n    r\n    s\nz = 1\n")
    monkeypatch.setattr(doc_figures, "ROOT", str(tmp_path))
    forked = types.SimpleNamespace(Args=Forked, HUB_DEFAULTS=grpo.HUB_DEFAULTS)
    monkeypatch.setattr(doc_figures, "scripts", lambda: dict(grpo=forked, ppo=ppo))
    before = (tmp_path / doc_figures.FLAGS_PAGE).read_text(encoding="utf-8")

    def run(*options):
        monkeypatch.setattr(sys, "argv", ["doc_figures.py", *options])
        doc_figures.main()

    with pytest.raises(SystemExit, match="1"):
        run("--check")
    run("--write")
    after = (tmp_path / doc_figures.FLAGS_PAGE).read_text(encoding="utf-8")
    rows_before, rows_after = doc_figures.table_rows(before), doc_figures.table_rows(after)
    assert rows_after[: len(rows_before)] == rows_before
    assert rows_after[len(rows_before) :] == [
        ["`--cispo-clip`", "5.0", "-", "the importance weight is clipped above at 1 + cispo_clip"]
    ]
    assert doc_figures.readme_shares((tmp_path / "README.md").read_text(encoding="utf-8"))[2:] == (43, 67)
    run("--check")  # nothing left to write


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
