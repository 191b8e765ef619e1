"""Bad input: data is read as users write it (principle 4), and resume never loses a run or trains on something
else (principle 7). docs/bad_input.md lists each case with its one line, in the sections named for the two principles.

The checks are called directly (a few seconds in all); two cases run the script as a user would.
"""

import dataclasses
import errno
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import grpo
import ppo
import tasks
from machinery import checkpoints, models
from machinery.errors import UsageError
from tasks import Task, load_task, rewards
from tasks import user as user_tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


GOOD = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(5)]

# ---------------------------------------------------------------------------------------------------
# Principle 4: data is read as users write it
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"prompt": "1=", "answer": ' + "7" * 5000 + "}",
            '"answer" is a number of about 5000 digits.*write it as a string',
        ),
        ("[" * 100_000 + "]" * 100_000, r"not valid JSON \(nested too deeply for Python to read\)"),
        ('{"prompt": "1=", "answer": NaN}', r"not valid JSON \(NaN is not a JSON number"),
        ('{"prompt": "1=", "answer": -Infinity}', r"not valid JSON \(-Infinity is not a JSON number"),
        ('{"prompt": "1=", "answer": 1e999999999}', '"answer" is a number of about 1000000000 digits'),
        ('{"prompt": "\\ud800=", "answer": "1"}', r'"prompt" holds .*\\ud800.*half of a surrogate pair'),
        ('{"prompt": "1=", "answer": "\\udfff"}', r'"answer" holds .*\\udfff.*half of a surrogate pair'),
    ],
    ids=[
        "5000-digit number",
        "100k-deep nesting",
        "NaN",
        "-Infinity",
        "1e999999999",
        "lone surrogate in prompt",
        "lone surrogate in answer",
    ],
)
def test_json_python_cannot_take_as_it_is_names_the_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD[0], GOOD[1], line, GOOD[2]])
    with pytest.raises(UsageError, match=rf"^{re.escape(path)}, line 3: {message}") as error:
        load_task(f"jsonl:{path}")
    assert "\n" not in str(error.value) and len(str(error.value)) < 300


def test_a_byte_that_is_not_utf8_names_its_line_and_a_bom_is_read(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(("\n".join(GOOD[:2]) + '\n{"prompt": "caf\xe9", "answer": "1"}\n').encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin\.jsonl, line 3: byte b'\\xe9' is not UTF-8 text"):
        load_task(f"jsonl:{path}")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(GOOD).encode("utf-8"))  # Windows Notepad: a BOM and CRLF
    assert len(user_tasks.read_jsonl(str(bom))) == 5


@pytest.mark.parametrize(
    "written, text",
    [
        ("4", "4"),
        ("4.0", "4.0"),
        ('"4"', "4"),
        ("1e3", "1000"),
        ("0.1", "0.1"),
        ("-2.50", "-2.50"),
        ("1E-7", "0.0000001"),
        ("100000000000000000000000000001", "100000000000000000000000000001"),
        ("3.141592653589793238462643", "3.141592653589793238462643"),
    ],
)
def test_a_json_number_answer_keeps_the_digits_as_written(tmp_path, written, text):
    """JSON numbers are read as Decimal: no float rounding (0.1, pi to 25 places), no "1e+20", no int limit."""
    path = write_jsonl(tmp_path / "n.jsonl", [GOOD[0], f'{{"prompt": "q", "answer": {written}}}'])
    assert user_tasks.read_jsonl(path)[1]["answer"] == text


def test_numbers_are_compared_as_the_numbers_they_are(tmp_path):
    """4, 4.0 and "4" as answer all accept the completions "4", "4.0" and "4.00" (match_reward reads numbers
    exactly); 1e3 accepts "1000" and "1,000"; and 0.1 is not 0.1000000000000000055511151231257827."""
    path = write_jsonl(
        tmp_path / "n.jsonl",
        [
            '{"prompt": "a", "answer": 4}',
            '{"prompt": "b", "answer": 4.0}',
            '{"prompt": "c", "answer": "4"}',
            '{"prompt": "d", "answer": 1e3}',
            '{"prompt": "e", "answer": 0.1}',
        ],
    )
    answers = {ex["prompt"]: ex["answer"] for ex in user_tasks.read_jsonl(path)}
    for prompt in "abc":
        assert [rewards.match_reward(prompt, c, answers[prompt]) for c in ("4", "4.0", " 4.00\n", "5")] == [1, 1, 1, 0]
    assert [rewards.match_reward("d", c, answers["d"]) for c in ("1000", "1,000", "1e3")] == [1, 1, 0]
    assert rewards.match_reward("e", "0.1000000000000000055511151231257827", answers["e"]) == 0


@pytest.mark.parametrize(
    "value, expected",
    [
        (10**5000, "about 5001 digits"),
        (float("nan"), '"answer" is NaN'),
        (float("inf"), '"answer" is Infinity'),
        (1e20, None),
        (True, "must be a string or a number"),
    ],
    ids=["10**5000", "nan", "inf", "1e20", "True"],
)
def test_python_examples_numbers(value, expected):
    where = "reward.py, EXAMPLES[0]"
    if expected is None:
        assert user_tasks.check_example({"prompt": "p", "answer": value}, where)["answer"] == "100000000000000000000"
    else:
        with pytest.raises(UsageError, match=re.escape(f"{where}: ") + ".*" + re.escape(expected)):
            user_tasks.check_example({"prompt": "p", "answer": value}, where)


def test_an_error_message_never_fails_to_show_a_value():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UsageError, match="not a list too large to show"):
        user_tasks.check_example(deep, "EXAMPLES[0]")


def test_duplicates_do_not_leak_into_the_held_out_split():
    examples = [{"prompt": f"{i % 30}=", "answer": str(i % 30)} for i in range(300)]  # each prompt 10 times
    train, test = tasks.split_examples("dups", examples)
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in test}
    assert len(train) + len(test) == 300 and len({ex["prompt"] for ex in test}) == 3
    with pytest.raises(UsageError, match="has 1 distinct prompt"):
        tasks.split_examples("one", [{"prompt": "1=", "answer": "1"}] * 5)


def test_without_duplicates_the_split_is_the_shuffle_of_the_examples():
    """The split of distinct prompts is unchanged: a plain shuffle of the examples with the same seed."""
    import random

    examples = [{"prompt": f"{i}=", "answer": str(i)} for i in range(57)]
    shuffled = list(examples)
    random.Random(1234).shuffle(shuffled)
    assert tasks.split_examples("plain", examples) == (shuffled[5:], shuffled[:5])


def tiny_task(train, test, answers="written"):
    return Task(
        "mine",
        [{"prompt": p, "answer": a} for p, a in train],
        [{"prompt": p, "answer": a} for p, a in test],
        rewards.match_reward,
        answers,
    )


def test_every_prompt_is_read_held_out_ones_and_past_the_first_200(tiny_tokenizer):
    train = [(f"{i}=", str(i)) for i in range(500)]
    with pytest.raises(
        UsageError,
        match=r"^1 of the 502 prompts of task 'mine' has characters the tokenizer of 'tiny' does not know "
        r"\(e\.g\. 'x' in '4x='\)",
    ):
        models.check_vocabulary(tiny_tokenizer, tiny_task(train, [("1=", "1"), ("4x=", "4")]), "tiny")
    with pytest.raises(UsageError, match=r"does not know \(e\.g\. 'é'"):
        models.check_vocabulary(tiny_tokenizer, tiny_task(train[:300] + [("é=", "1")], [("1=", "1")]), "tiny")


def test_every_answer_is_one_the_tokenizer_can_write(tiny_tokenizer, capsys):
    train, test = [(f"{i}=", str(i)) for i in range(300)], [("2=", "two")]
    with pytest.raises(
        UsageError,
        match=r"^1 of the 301 answers of task 'mine' has characters the tokenizer of 'tiny' cannot write "
        r"\(e\.g\. 't' in 'two'\), so no completion can match them",
    ):
        models.check_vocabulary(tiny_tokenizer, tiny_task(train, test), "tiny")
    models.check_vocabulary(
        tiny_tokenizer, tiny_task(train, test, answers="data"), "tiny"
    )  # never written: not checked
    models.check_vocabulary(tiny_tokenizer, tiny_task(train, test, answers="yours"), "tiny")  # a user's reward: a note
    assert capsys.readouterr().err.startswith("note: 1 of the 301 answers of task 'mine' has characters")


def test_answers_that_are_all_empty_pass_the_checks(tiny_tokenizer, tiny_model):
    """A task whose reward ignores the answer may leave every one empty: nothing to write, nothing to refuse."""
    task = tiny_task([(f"{i}=", "") for i in range(5)], [("9=", "")])
    models.check_vocabulary(tiny_tokenizer, task, "tiny")
    models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", 5, chat_template=True)


def test_answers_that_need_more_tokens_than_max_new_tokens_get_the_number_to_use(tiny_tokenizer, tiny_model):
    """The figures of the message are recomputed here: the tiny tokenizer writes one token per character; an
    answer of more tokens than --max-new-tokens can never be written, and the advice leaves room for the EOS.
    All answers count, held-out ones too (2964 of the 3302 are in the training split)."""
    task = load_task("arithmetic:4")
    answers = [ex["answer"] for ex in task.train + task.test]
    too_long, longest = sum(len(a) > 5 for a in answers), max(map(len, answers))
    assert (too_long, longest, sum(len(ex["answer"]) > 5 for ex in task.train)) == (3302, 8, 2964)
    with pytest.raises(
        UsageError,
        match=rf"^task 'arithmetic:4' has {too_long} answers longer than --max-new-tokens 5 tokens "
        rf"\(the longest, '\d+', is {longest} tokens\): raise --max-new-tokens to {longest + 1} "
        r"\(its tokens and the EOS\)$",
    ):
        models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", 5, chat_template=True)
    models.check_prompt_length(
        tiny_tokenizer, load_task("copy"), tiny_model, "tiny", 3, chat_template=True
    )  # "123", no EOS: fits
    models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", longest + 1, chat_template=True)
    fits = [("1" * 200, "1"), ("2=", "9" * 60)]  # each alone fits in 256 positions; the longest of both does not
    with pytest.raises(UsageError, match=r"is 60 tokens\): shorten the answers, or the prompts"):
        models.check_prompt_length(
            tiny_tokenizer, tiny_task(fits, [("3=", "3")]), tiny_model, "tiny", 50, chat_template=True
        )


def test_a_4mb_prompt_is_refused_before_it_is_tokenized(tiny_tokenizer, tiny_model):
    task = tiny_task([("1" * 4_000_000, "1"), ("2=", "2")], [("3=", "3")])
    start = time.perf_counter()
    models.check_vocabulary(tiny_tokenizer, task, "tiny")
    with pytest.raises(
        UsageError, match=r"is 4000000 characters \('1111.*more than the 256 positions of 'tiny' can hold"
    ):
        models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", 5, chat_template=True)
    assert time.perf_counter() - start < 3  # tokenizing it alone takes ~30 s, padding it into a batch of 1000 hangs


def test_the_length_bound_counts_what_generation_feeds_the_model(tiny_tokenizer, tiny_model):
    """Prompts under the bytes bound are not tokenized; the ones over it are measured as encode_prompts encodes them."""
    from machinery.generation import encode_prompts

    prompts = ["1" * n for n in (1, 100, 240, 251)]
    (length, text), over = models.longest(tiny_tokenizer, prompts, 240, chat_template=True)
    assert (length, text, over) == (251, "1" * 251, 1)
    assert int(encode_prompts(tiny_tokenizer, [text], True)["attention_mask"].sum()) == length


# ---------------------------------------------------------------------------------------------------
# Principle 7: resume never loses a run or trains on something else
# ---------------------------------------------------------------------------------------------------


def quick_args(output_dir, **overrides):
    fields = dict(
        seed=1,
        num_steps=1,
        save_every=1,
        sample_every=0,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=4,
        output_dir=str(output_dir),
    )
    fields.update(overrides)
    return grpo.Args(**fields)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint folder, the Args main() had) of a one-step grpo run, to be copied before each damage."""
    output_dir = tmp_path_factory.mktemp("saved")
    args = quick_args(output_dir)
    grpo.main(args)
    (checkpoint,) = glob.glob(str(output_dir / "*" / "checkpoint"))
    return checkpoint, args


@pytest.fixture
def copy(saved, tmp_path):
    folder = str(tmp_path / "run" / "checkpoint")
    shutil.copytree(saved[0], folder)
    return folder, saved[1]


def edit_state(folder, change):
    state, _ = checkpoints.read_state(folder)
    change(state)
    checkpoints.write_state(os.path.join(folder, checkpoints.STATE), state)


def truncate(folder, name):
    path = os.path.join(folder, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def change_config(folder):
    path = os.path.join(folder, "policy", "config.json")
    config = json.load(open(path))
    config["num_hidden_layers"] = 2
    json.dump(config, open(path, "w"))


DAMAGES = {
    "truncated weights": (
        lambda f: truncate(f, "policy/model.safetensors"),
        r"policy/model\.safetensors is \d+ bytes, not the \d+ saved: it was cut short",
    ),
    "changed config": (change_config, r"policy/config\.json was changed after the save"),
    "missing file": (
        lambda f: os.remove(os.path.join(f, "policy", "tokenizer.json")),
        r"policy/tokenizer\.json is missing",
    ),
    "state missing a key": (lambda f: edit_state(f, lambda s: s.pop("optimizer")), r"safetensors has no 'optimizer'"),
    "state missing its list of keys": (lambda f: edit_state(f, lambda s: s.pop("keys")), r"safetensors has no 'keys'"),
    "older version": (
        lambda f: edit_state(f, lambda s: s.pop("version")),
        r"was written by an older version of grpo\.py \(checkpoint format 1, this one reads 3\)",
    ),
    "newer version": (lambda f: edit_state(f, lambda s: s.update(version=99)), r"was written by a newer version"),
    "written before a flag existed, given another value": (
        lambda f: edit_state(f, lambda s: s["args"].pop("prompts_per_step")),
        r"was written before --prompts-per-step existed, so it ran as with --prompts-per-step 16, not 2: drop the flag",
    ),
    "a flag since removed": (
        lambda f: edit_state(f, lambda s: s["args"].update(old_flag=1)),
        r"was run with --old-flag, which this version does not have",
    ),
    "not our state": (
        lambda f: checkpoints.write_state(os.path.join(f, checkpoints.STATE), [1, 2]),
        r"state\.safetensors is not a checkpoint of grpo\.py, ppo\.py or reward_model\.py",
    ),
    "truncated state": (
        lambda f: truncate(f, checkpoints.STATE),
        r"state\.safetensors cannot be read \(\w+\): the checkpoint is corrupt",
    ),
    "history's scores cut": (
        lambda f: edit_state(f, lambda s: s["history"].update(score=[])),
        r"state\.safetensors's history's score is not 1 finite numbers, one a step, not what a run writes: the "
        "checkpoint was edited or is damaged",
    ),
    "history's token count a string": (
        lambda f: edit_state(f, lambda s: s["history"].update(tokens="many")),
        r"state\.safetensors's history's token count is 'many'",
    ),
    "history's length NaN": (
        lambda f: edit_state(f, lambda s: s["history"].update(length=[float("nan")])),
        r"state\.safetensors's history's length is not 1 finite numbers",
    ),
    "history gone": (lambda f: edit_state(f, lambda s: s.update(history=None)), r"history is not a dict of lists"),
    "--lora-merged dropped on resume": (
        lambda f: edit_state(f, lambda s: s["args"].update(lora_merged=True)),
        r"was run with --lora-merged: pass it again, or its final-merged model would stay at an older step than final",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_damage_is_one_line_naming_it(copy, damage, monkeypatch):
    folder, args = copy
    make, message = DAMAGES[damage]
    make(folder)
    monkeypatch.setattr(
        models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model before checking the checkpoint")
    )
    with pytest.raises(UsageError, match=message) as error:
        grpo.main(quick_args(os.path.dirname(os.path.dirname(folder)), num_steps=2, resume=folder))  # in place
    assert "\n" not in str(error.value)


def test_an_old_checkpoint_of_ppo_is_refused_in_one_line(tmp_path):
    """Before format 3, a checkpoint's state was state.pt, a pickle: never opened (it could run code), refused."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    args = ppo.Args()
    torch.save({"script": "ppo", "args": vars(args), "step": 3, "kl_coef": 0.05}, folder / "state.pt")
    with pytest.raises(
        UsageError,
        match=r"holds state\.pt, the checkpoint format of an older version of this project, which is a pickle and "
        r"could run code when read: this version does not open it; resume it with the version that wrote it",
    ):
        checkpoints.load_checkpoint(str(folder), "ppo", args)


def test_data_changed_since_the_checkpoint(copy, tmp_path):
    folder, args = copy
    args = dataclasses.replace(args, num_steps=2)  # past the checkpoint's step
    state = checkpoints.load_checkpoint(folder, "grpo", args, load_task("copy"))  # the same data: fine
    changed = load_task("copy")
    changed.train[7] = {"prompt": "123=", "answer": "124"}
    with pytest.raises(
        UsageError, match=r"was trained on other examples than task 'copy' gives now \(900 training examples\)"
    ):
        checkpoints.load_checkpoint(folder, "grpo", args, changed)
    sampler = __import__("machinery.batches").batches.PromptSampler(changed.train, 1)
    with pytest.raises(UsageError, match="trained on other examples"):  # when load_checkpoint had no task
        checkpoints.restore_state(state, None, None, sampler)


def test_resume_from_a_run_folder_names_its_checkpoint(copy):
    folder, args = copy
    with pytest.raises(
        UsageError,
        match=r"is not a checkpoint \(no state\.safetensors in it\): "
        rf"pass a run's checkpoint folder, such as {re.escape(folder)}$",
    ):
        checkpoints.load_checkpoint(os.path.dirname(folder), "grpo", args)


def save_killed_between_renames(tmp_path, monkeypatch, keep_tmp_state=True):
    """A 2-step run, killed at step 2's save right after its first rename (checkpoint -> checkpoint.old)."""
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if dst.endswith("checkpoint.old"):
            if not keep_tmp_state:  # killed earlier still: the new save had not written its state.pt
                os.remove(os.path.join(src + ".tmp", checkpoints.STATE))
            raise KeyboardInterrupt  # as a second Ctrl-C, or a kill, would stop it here

    args = quick_args(tmp_path, num_steps=2)
    monkeypatch.setattr(checkpoints.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        grpo.main(args)
    monkeypatch.undo()
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    folder = os.path.join(run_dir, "checkpoint")
    assert not os.path.exists(folder) and os.path.isdir(folder + ".old") and os.path.isdir(folder + ".tmp")
    return folder, args


def test_a_kill_between_the_renames_resumes_from_the_newer_save(tmp_path, monkeypatch, capsys):
    folder, args = save_killed_between_renames(tmp_path, monkeypatch)
    capsys.readouterr()
    assert checkpoints.load_checkpoint(folder, "grpo", dataclasses.replace(args, num_steps=3))["step"] == 2
    note = capsys.readouterr().err.strip()
    assert (
        note == f"note: {folder} was missing (a save was stopped between its renames); "
        f"resuming from the save in progress, step 2, moved back from {folder}.tmp"
    )
    assert os.path.isfile(os.path.join(folder, checkpoints.STATE))


def test_a_kill_before_the_new_save_was_complete_resumes_from_the_previous_one(tmp_path, monkeypatch, capsys):
    folder, args = save_killed_between_renames(tmp_path, monkeypatch, keep_tmp_state=False)
    scores = grpo.main(quick_args(tmp_path, num_steps=3, resume=folder))  # and the run goes on from it, to the end
    assert len(scores) == 3
    assert "resuming from the previous checkpoint, step 1, moved back from" in capsys.readouterr().err


@pytest.mark.parametrize("when", ["first save", "later save", "final model"])
def test_disk_full_names_the_last_good_checkpoint(tmp_path, monkeypatch, when):
    from transformers import PreTrainedModel

    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_save, real_save_pretrained, saves = checkpoints.write_state, PreTrainedModel.save_pretrained, []

    def save(path, state):
        saves.append(path)
        if when == "first save" or (when == "later save" and len(saves) == 2):
            raise enospc
        return real_save(path, state)

    def save_pretrained(self, folder, *a, **k):
        if str(folder).endswith("final.tmp"):
            real_save_pretrained(self, folder, *a, **k)  # part of it written, then the disk is full
            raise enospc
        return real_save_pretrained(self, folder, *a, **k)

    monkeypatch.setattr(checkpoints, "write_state", save)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    with pytest.raises(UsageError) as error:
        grpo.main(quick_args(tmp_path, num_steps=2))
    monkeypatch.undo()
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    checkpoint, full = os.path.join(run_dir, "checkpoint"), "(No space left on device)"
    expected = {
        "first save": f"could not write the checkpoint of step 1 to {checkpoint} {full}; "
        "no checkpoint was saved before: free some disk space and start again",
        "later save": f"could not write the checkpoint of step 2 to {checkpoint} {full}; the last good checkpoint is "
        f"{checkpoint}: free some disk space, then resume from it",
        "final model": f"could not write the model to {run_dir}/final {full}; "
        f"the last good checkpoint is {checkpoint}: free some disk space, then resume from it",
    }[when]
    assert str(error.value) == expected
    assert not glob.glob(os.path.join(run_dir, "*.tmp"))  # what was half written is removed, its space freed


# ---------------------------------------------------------------------------------------------------
# Two cases as a user meets them: one line on stderr, before the run folder exists.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            "--task arithmetic:4",
            "error: task 'arithmetic:4' has 3302 answers longer than --max-new-tokens 5 tokens "
            "(the longest, '97871442', is 8 tokens): raise --max-new-tokens to 9 (its tokens and the EOS)",
        ),
        (
            "--task jsonl:{deep}",
            "error: {deep}, line 1: not valid JSON (nested too deeply for Python to read); write one "
            'object like {{"prompt": "..."}} or {{"prompt": "...", "answer": "..."}} per line',
        ),
    ],
)
def test_the_script_says_one_line(tmp_path, xdg_cache, tiny_model, flags, expected):  # tiny_model: built already
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    flags = flags.format(deep=deep).split()
    env = dict(os.environ, XDG_CACHE_HOME=xdg_cache, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "grpo.py", "--num-steps", "1", *flags, "--output-dir", str(tmp_path / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stderr.strip() == expected.format(deep=deep)
    assert not os.path.exists(tmp_path / "runs")
