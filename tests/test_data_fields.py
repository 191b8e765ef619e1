"""A JSONL line's other fields reach what a variant reads: kept by the readers with plain int/float numbers, in
the batch each entry point receives and in the dumps, and in the checkpoint's fingerprint of the data."""

import glob
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

import grpo
import ppo
from machinery import batches, checkpoints
from machinery.errors import UsageError
from tasks.preferences import load_pairs
from tasks.user import read_jsonl


def write_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_lines_other_fields_are_kept_with_plain_numbers(tmp_path):
    line = '{"prompt": "1=", "answer": 4.0, "margin": 0.33, "level": 2, "tags": ["a", 1.5, 7], "big": 1e3}\n'
    (tmp_path / "d.jsonl").write_text(line)
    (example,) = read_jsonl(str(tmp_path / "d.jsonl"))
    assert example == {"prompt": "1=", "answer": "4.0", "margin": 0.33, "level": 2, "tags": ["a", 1.5, 7], "big": 1e3}
    assert [type(example[k]) for k in ("margin", "level", "big")] == [float, int, float]
    assert [type(v) for v in example["tags"]] == [str, float, int]


def test_a_pairs_margin_is_kept(tmp_path):
    rows = [dict(prompt=f"p{i}", chosen="a", rejected="b", margin=i / 3) for i in range(10)]
    train, test = load_pairs("jsonl:" + write_lines(tmp_path / "pairs.jsonl", rows), None, 0, 0, 0)
    assert sorted(pair["margin"] for pair in train + test) == [row["margin"] for row in rows]
    assert all(type(pair["margin"]) is float for pair in train)


def test_example_fields_one_entry_a_completion():
    examples = [dict(prompt="a", answer="1", margin=0.5, level=1, note="x"), dict(prompt="b", answer="2", level=3)]
    fields = batches.example_fields(examples, 2)
    assert fields["level"].tolist() == [1, 1, 3, 3] and fields["level"].dtype == torch.int64
    assert fields["margin"] == [0.5, 0.5, None, None]  # a line lacks it: a list
    assert fields["note"] == ["x", "x", None, None]
    assert batches.example_fields([dict(prompt="a", answer="1", margin=2, w=0.5)], 1)["margin"].dtype == torch.int64
    with pytest.raises(UsageError, match="'rewards' is a name the batch uses"):
        batches.example_fields([dict(prompt="a", answer="1", rewards=1.0)], 1)


def test_example_fields_tensor_types_follow_the_values():
    """Bools alone: a bool tensor; ints with a float: float32; a bool among numbers (JSON's true beside 2) is no
    number to torch's eyes: a list, as written."""

    def field(*values):
        return batches.example_fields([dict(prompt=str(i), answer="1", f=v) for i, v in enumerate(values)], 1)["f"]

    assert field(True, False).dtype == torch.bool and field(True, False).tolist() == [True, False]
    assert field(1, 0.5).dtype == torch.float32 and field(1, 0.5).tolist() == [1.0, 0.5]
    assert field(True, 2) == [True, 2] and field(0.5, False) == [0.5, False]


def test_example_fields_keep_an_int_past_int64_as_a_list():
    """JSON's integers have no bound; int64's is 2**63 - 1: up to it (either sign) a tensor, from 2**63 a list."""
    for largest in (2**63 - 1, -(2**63 - 1)):
        fields = batches.example_fields(
            [dict(prompt="a", answer="1", level=largest), dict(prompt="b", answer="2", level=1)], 1
        )
        assert fields["level"].dtype == torch.int64 and fields["level"].tolist() == [largest, 1]
    for past in (2**63, -(2**63) - 1, 2**64):
        fields = batches.example_fields(
            [dict(prompt="a", answer="1", level=past), dict(prompt="b", answer="2", level=1)], 1
        )
        assert fields["level"] == [past, 1]


@pytest.mark.parametrize("module", [grpo, ppo])
def test_a_field_reaches_the_loss_and_the_dump(module, tmp_path, monkeypatch):
    rows = [dict(prompt=f"{i:03d}=", answer=f"{i:03d}", margin=i / 4, note=f"n{i}") for i in range(40)]
    seen, compute_loss = [], module.compute_loss

    def recording(outputs, batch, args):
        seen.append(batch)
        return compute_loss(outputs, batch, args)

    monkeypatch.setattr(module, "compute_loss", recording)
    dump_dir = tmp_path / "dump"
    args = module.Args(task=f"jsonl:{write_lines(tmp_path / 'd.jsonl', rows)}", num_steps=1, prompts_per_step=4)
    module.main(module.Args(**{**vars(args), "output_dir": str(tmp_path / "runs"), "dump_dir": str(dump_dir)}))
    by_prompt = {row["prompt"]: row for row in rows}
    for batch in seen:
        assert batch["margin"].dtype == torch.float32 and len(batch["margin"]) == len(batch["completion_mask"])
        assert len(batch["note"]) == len(batch["completion_mask"])
    (dump,) = glob.glob(str(dump_dir / "*.safetensors"))
    assert "margin" in load_file(dump) and "note" not in load_file(dump)  # numbers dumped, text not
    assert set(seen[0]["note"]) <= {row["note"] for row in by_prompt.values()}


def old_fingerprint(examples):
    """The fingerprint before other fields were covered: prompt, answer, chosen, rejected only."""
    keys = ("prompt", "answer", "chosen", "rejected")
    return hashlib.sha256(json.dumps([[e[k] for k in keys if k in e] for e in examples]).encode()).hexdigest()


def test_the_datas_fingerprint_covers_every_field():
    examples = [dict(prompt="a", chosen="x", rejected="y", margin=0.33, where="f.jsonl, line 1")]
    rewritten = [dict(examples[0], margin=5.0)]
    assert checkpoints.data_fingerprint(examples) != checkpoints.data_fingerprint(rewritten)
    moved = [dict(examples[0], where="g.jsonl, line 1")]  # the same data read from another file
    assert checkpoints.data_fingerprint(examples) == checkpoints.data_fingerprint(moved)
    plain = [
        dict(prompt="12=", answer="12"),
        dict(prompt="3=", answer="3"),
    ]  # a checkpoint written before still resumes
    assert checkpoints.data_fingerprint(plain) == old_fingerprint(plain)
    # reward_model.py's pairs too: prompt, chosen, rejected in that order, as the older version wrote them.
    pairs = [dict(prompt="p", chosen="x", rejected="y"), dict(prompt="q", chosen="zz", rejected="w", where="f, line 2")]
    assert checkpoints.data_fingerprint(pairs) == old_fingerprint(pairs)
    # The other fields by name: the order a line writes them in is not the data.
    reordered = [dict(reversed(list(dict(prompt="a", answer="1", margin=0.5, level=2).items())))]
    assert checkpoints.data_fingerprint(reordered) == checkpoints.data_fingerprint(
        [dict(prompt="a", answer="1", margin=0.5, level=2)]
    )
