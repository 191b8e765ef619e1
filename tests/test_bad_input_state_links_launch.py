"""Bad input, round six (docs/bad_input.md, "What the scripts read from disk"): a checkpoint runs no code when it
loads; a run writes only inside its own folder, through no link; a branch lies outside its source and reads one
consistent checkpoint; the inherited environment is bounded; a wait for a peer is interruptible and bounded; input
is read as written. Each case: one line, a non-zero exit, nothing written outside the run folder (or no run folder).
"""

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from test_bad_input_reward_models_and_environment import assert_one_line, run_script
from test_reproducibility import only_run_dir, quick_args

import grpo
from machinery import checkpoints, flags, lora, run_folder, state_file, threads
from machinery import distributed as dist
from machinery.errors import UsageError
from tasks import user

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A grpo run of 2 steps with its checkpoint at step 2, and a 3-step run of the same flags (its checkpoint at 3)."""
    root = tmp_path_factory.mktemp("round6")
    grpo.main(quick_args("grpo", root / "two", num_steps=2, save_every=2))
    grpo.main(quick_args("grpo", root / "three", num_steps=3, save_every=3))
    return root, only_run_dir(root / "two"), only_run_dir(root / "three")


@pytest.fixture
def run(source, tmp_path):
    """A copy of the 2-step run folder, to plant things in."""
    folder = tmp_path / "run"
    shutil.copytree(source[1], folder)
    return str(folder)


def one_line(error):
    assert "\n" not in str(error.value)
    return str(error.value)


# ---------------------------------------------------------------------------------------------------
# A checkpoint cannot run code when it loads.
# ---------------------------------------------------------------------------------------------------


class Payload:
    """What a crafted pickle runs when it is unpickled: it writes a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["checkpoint", "checkpoint.tmp", "checkpoint.old"])
def test_a_pickled_state_is_never_opened(run, tmp_path, where):
    """An older version's state.pt (a pickle) is refused unopened, at --resume and in the .tmp/.old fallback search."""
    marker = tmp_path / "ran"
    folder = os.path.join(run, "checkpoint")
    os.remove(os.path.join(folder, checkpoints.STATE))
    torch.save({"script": "grpo", "payload": Payload(str(marker))}, os.path.join(folder, "state.pt"))
    if where != "checkpoint":
        os.rename(folder, os.path.join(run, where))
    with pytest.raises(UsageError) as error:
        grpo.main(quick_args("grpo", os.path.dirname(run), num_steps=3, resume=folder))
    expected = "older version of this project, which is a pickle" if where == "checkpoint" else "is not a checkpoint"
    assert expected in one_line(error) and not marker.exists()


def test_the_state_round_trips_exactly_and_refuses_what_it_does_not_write():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    state = {
        "rng": state_file.rng_state(),
        "optimizer": optimizer.state_dict(),
        "setup": {"baseline": torch.arange(4.0), "count": 3, "scale": 0.1, "names": ("a", "b")},
        "tagged": {"__tensor__": 1},  # a user's dict shaped like a tag stays a dict
        "numbers": [float("inf"), -0.0, 2**62, None, True],
    }
    back = state_file.parse_state(state_file.state_bytes(state))
    assert back["rng"]["python"] == state["rng"]["python"] and isinstance(back["rng"]["python"], tuple)
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1]) and back["rng"]["numpy"][1].dtype == "u4"
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert list(back["optimizer"]["state"]) == [0] and back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(back["setup"]["baseline"], torch.arange(4.0)) and back["setup"]["names"] == ("a", "b")
    assert back["tagged"] == {"__tensor__": 1} and str(back["numbers"]) == str(state["numbers"])
    for meta in ('{"__tensor__": "9"}', '{"__ndarray__": ["O", [1], [1]]}', "[" * 100 + "]" * 100, '{"__tuple__": 1}'):
        data = state_file.save({}, metadata={"format": "reference-rl-state", "state": meta})
        with pytest.raises((ValueError, RecursionError)):
            state_file.parse_state(data)
    with pytest.raises(TypeError, match="cannot hold a Payload"):
        state_file.state_bytes({"x": Payload("nowhere")})


def test_a_state_naming_files_outside_the_checkpoint_is_refused(run):
    folder = os.path.join(run, "checkpoint")
    state, _ = checkpoints.read_state(folder)
    for name in ("/dev/zero", "../../etc/passwd", "policy/../../x"):
        state["files"] = {name: (0, "0" * 64)}
        with pytest.raises(UsageError, match="not a file of the checkpoint") as error:
            checkpoints.check_files(folder, state)
        one_line(error)


# ---------------------------------------------------------------------------------------------------
# A run writes only inside its own folder, through no link.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["checkpoint.tmp", "checkpoint.old", "final.tmp", "events.out.tfevents.1.x", ".lock"])
def test_a_link_in_the_run_folder_is_refused_and_never_written_through(run, tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if os.path.exists(os.path.join(run, name)):
        os.remove(os.path.join(run, name))  # the run's .lock
    os.symlink(elsewhere, os.path.join(run, name))
    before = sorted(os.listdir(run))
    with pytest.raises(UsageError, match=f"holds a link, {name} -> ") as error:
        grpo.main(quick_args("grpo", os.path.dirname(run), num_steps=3, resume=os.path.join(run, "checkpoint")))
    one_line(error)
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(run)) == before


def test_a_checkpoint_or_final_that_is_a_link_is_refused(run, tmp_path):
    for name in ("checkpoint", "final"):
        elsewhere = tmp_path / f"elsewhere-{name}"
        shutil.move(os.path.join(run, name), elsewhere)
        os.symlink(elsewhere, os.path.join(run, name))
        before = sorted(os.listdir(elsewhere))
        with pytest.raises(UsageError, match=f"holds a link, {name} -> ") as error:
            grpo.main(quick_args("grpo", os.path.dirname(run), num_steps=3, resume=os.path.join(run, "checkpoint")))
        one_line(error)
        assert sorted(os.listdir(elsewhere)) == before
        os.remove(os.path.join(run, name))
        shutil.move(elsewhere, os.path.join(run, name))


def test_a_run_folder_that_is_a_link_is_refused(run, tmp_path):
    link = tmp_path / "link"
    os.symlink(run, link)
    before = sorted(os.listdir(run))
    with pytest.raises(UsageError, match="is a link") as error:
        grpo.main(quick_args("grpo", tmp_path, num_steps=3, resume=str(link / "checkpoint")))
    one_line(error)
    assert sorted(os.listdir(run)) == before


def test_a_link_planted_during_a_run_is_refused_at_the_save(run, tmp_path):
    """The save itself checks: a link made after the start is never written through either."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run, "final"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(run, "final"))
    os.symlink(elsewhere, os.path.join(run, "final.tmp"))
    with pytest.raises(UsageError, match="holds a link, final.tmp -> "):
        checkpoints.save_model(model, tokenizer, os.path.join(run, "final"), step=3)
    assert os.listdir(elsewhere) == []


# ---------------------------------------------------------------------------------------------------
# A branch lies outside its source, reads one consistent checkpoint, and --output-dir is read as given.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", ["checkpoint", "final", ".", "sub/deeper"])
def test_a_branch_inside_its_source_is_refused(run, inside):
    before = sorted(os.listdir(run))
    with pytest.raises(UsageError, match="lies inside the run folder .* it branches from") as error:
        grpo.main(quick_args("grpo", os.path.join(run, inside), num_steps=3, resume=os.path.join(run, "checkpoint")))
    one_line(error)
    assert sorted(os.listdir(run)) == before


def test_an_output_dir_given_as_its_default_makes_a_branch(run, tmp_path, monkeypatch):
    """`--output-dir runs` given on the command line is read as given, as any other folder would be."""
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--output-dir", "runs", "--resume", os.path.join(run, "checkpoint")])
    args, given = flags.parse_args(grpo.Args, grpo.HUB_DEFAULTS)
    assert "output_dir" in given and args.output_dir == "runs"
    monkeypatch.setattr(run_folder, "GIVEN", {"output_dir"})
    assert run_folder.branches(args)
    monkeypatch.setattr(run_folder, "GIVEN", set())
    assert not run_folder.branches(args)  # not given: the checkpoint's own run folder


def test_a_branch_of_a_source_that_saves_meanwhile_is_refused(run, source, tmp_path, monkeypatch):
    """The source saves step 3 between the branch's reading of its state (step 2) and of its weights."""
    real_restore, checkpoint = lora.restore_weights, os.path.join(run, "checkpoint")

    def restore(model, folder, loader):
        if os.path.isdir(checkpoint):  # the source's save: its new checkpoint swapped into place
            os.rename(checkpoint, checkpoint + ".old")
            shutil.copytree(os.path.join(source[2], "checkpoint"), checkpoint)
        return real_restore(model, folder, loader)

    monkeypatch.setattr(lora, "restore_weights", restore)
    with pytest.raises(UsageError, match="was replaced by a newer save while this run read it") as error:
        grpo.main(quick_args("grpo", tmp_path / "branch", num_steps=4, resume=checkpoint))
    one_line(error)


def test_an_old_checkpoint_says_which_value_to_pass(run):
    """A checkpoint of the version whose --gradient-checkpointing was a bool: its False is read as off."""
    folder = os.path.join(run, "checkpoint")
    state, _ = checkpoints.read_state(folder)
    state["args"]["gradient_checkpointing"] = False
    checkpoints.write_state(os.path.join(folder, checkpoints.STATE), state)
    with pytest.raises(UsageError) as error:
        grpo.main(quick_args("grpo", os.path.dirname(run), num_steps=3, resume=folder))
    assert "run with --gradient-checkpointing off, not auto: pass --gradient-checkpointing off" in one_line(error)
    grpo.main(quick_args("grpo", os.path.dirname(run), num_steps=3, resume=folder, gradient_checkpointing="off"))


# ---------------------------------------------------------------------------------------------------
# Silent input: '', None, --exp-name, JSONL fields.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("resume", "", "--resume is empty"),
        ("reward_model", "", "--reward-model is empty"),
        ("critic_model", "", "--critic-model is empty"),
        ("dump_dir", "", "--dump-dir is empty"),
        ("output_dir", "", "--output-dir is empty"),
        ("exp_name", "x/../../../y", "--exp-name 'x/../../../y' is not a plain name"),
        ("exp_name", "/tmp/abs", "is not a plain name"),
        ("exp_name", "..", "is not a plain name"),
    ],
)
def test_empty_and_escaping_names_are_refused(field, value, expected, tmp_path):
    import ppo

    module = ppo if field == "critic_model" else grpo
    args = module.Args(num_steps=1, sample_every=0, output_dir=str(tmp_path / "runs"))
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")) as error:
        module.main(dataclasses.replace(args, **{field: value}))
    one_line(error)
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")


@pytest.mark.parametrize("flag", ["--resume", "--reward-model", "--critic-model", "--dump-dir", "--system-prompt"])
def test_none_is_refused_not_read_as_unset(flag, monkeypatch):
    for argv in ([flag, "None"], [f"{flag}=None"]):
        monkeypatch.setattr(sys, "argv", ["ppo.py", *argv])
        import ppo

        with pytest.raises(UsageError, match=f"{flag} None: None would read as no {flag} at all"):
            flags.parse_args(ppo.Args, ppo.HUB_DEFAULTS)


JSONL = {  # a line's fields besides its example's: the line, and the start of its one-line error
    "a key twice": ('"k": 1, "k": 2', "line 2: the key 'k' is given twice in one object: keep one"),
    "1e400": ('"margin": 1e400', 'line 2: field "margin" holds a number past float'),
    "5000 digits": ('"n": ' + "9" * 5000, 'line 2: field "n" holds an integer past 64 bits'),
    "600 deep": ('"x": ' + "[" * 600 + "]" * 600, 'line 2: field "x" nests deeper than 100 levels'),
    "a surrogate key": ('"\\ud800": 1', "line 2: \"\\ud800\" holds '\\ud800', half of a surrogate pair"),
    "a surrogate inside": ('"a": {"b": ["\\udfff"]}', "line 2: \"a > b\" holds '\\udfff'"),
}


@pytest.mark.parametrize("case", JSONL)
def test_a_jsonl_field_a_later_step_could_not_hold_is_one_line(case, tmp_path):
    """The same line in grpo.py's examples and reward_model.py's pairs: refused when read, never at a later save."""
    from tasks import preferences

    fields, expected = JSONL[case]
    path = tmp_path / "data.jsonl"
    for first, check in (
        ('"prompt": "1=", "answer": "1"', ()),
        ('"prompt": "1=", "chosen": "a", "rejected": "b"', (preferences.check_pair, preferences.PAIR_FORM)),
    ):
        path.write_text(f"{{{first}}}\n{{{first}, {fields}}}\n")
        with pytest.raises(UsageError) as error:
            user.read_jsonl(str(path), *check)
        assert expected in one_line(error)


def test_a_pipe_and_a_device_are_refused_unopened(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line(run_script("grpo", ["--task", f"jsonl:{fifo}", "--num-steps", "1"], tmp_path), "not a regular")
    assert_one_line(run_script("reward_model", ["--task", "jsonl:/dev/zero"], tmp_path), "not a regular file")
    for path in (str(fifo), "/dev/zero"):  # after the confined runs: a blocking open would hang this process
        with pytest.raises(UsageError, match="is not a regular file"):
            user.read_jsonl(path)


# ---------------------------------------------------------------------------------------------------
# The inherited environment, bounded; the wait for a peer, interruptible and bounded.
# ---------------------------------------------------------------------------------------------------


def test_every_thread_count_of_the_environment_is_bounded(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    for name in threads.THREAD_COUNTS:
        for bad in ("100000", "0", "x", "", "²", "9"):
            with pytest.raises(UsageError, match=f"{name} is .*from 1 to 8"):
                threads.check_environment({name: bad})
        threads.check_environment({name: "8"})


ENVIRONMENT = [
    ("grpo", {"RAYON_NUM_THREADS": "100000"}, "RAYON_NUM_THREADS is '100000': set it to a number of threads from 1"),
    ("reward_model", {"MKL_NUM_THREADS": "100000"}, "MKL_NUM_THREADS is '100000'"),
    ("ppo", {"WORLD_SIZE": "²"}, "WORLD_SIZE is '²': torchrun sets it to a whole number"),
    ("grpo", {"WORLD_SIZE": "1000000000"}, "WORLD_SIZE is 1000000000: more processes than a launch holds"),
    ("grpo", {"XDG_CACHE_HOME": "/dev/null/cache"}, "XDG_CACHE_HOME is '/dev/null/cache', /dev/null is not a folder"),
    ("reward_model", {"XDG_CACHE_HOME": "relative"}, "XDG_CACHE_HOME is 'relative', not an absolute path"),
    ("reward_model", {}, "--batch-size 1000000 is more than the "),
]


@pytest.mark.parametrize("script, env, expected", ENVIRONMENT, ids=[e[:30] for _, _, e in ENVIRONMENT])
def test_the_environment_is_checked_in_one_line(script, env, expected, tmp_path):
    extra = ["--batch-size", "1000000"] if "batch-size" in expected else ["--num-steps", "1"]
    assert_one_line(run_script(script, extra, tmp_path, env), expected)


def test_torchruns_variables_are_ascii_numbers_a_port_and_a_host():
    launch = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="2", RANK="0")
    dist.check_environment(launch)
    for change, expected in [
        (dict(RANK="⁰"), "RANK is '⁰': torchrun sets it to a whole number"),
        (dict(WORLD_SIZE="1000000000"), "WORLD_SIZE is 1000000000: more processes than a launch holds"),
        (dict(MASTER_PORT="abc"), "MASTER_PORT is 'abc': set it to a port number from 1 to 65535"),
        (dict(MASTER_PORT="99999"), "MASTER_PORT is '99999'"),
        (dict(MASTER_PORT="0"), "MASTER_PORT is '0'"),
        (dict(MASTER_ADDR="no-such-host.invalid"), "MASTER_ADDR 'no-such-host.invalid' cannot be resolved"),
    ]:
        with pytest.raises(UsageError, match=expected) as error:
            dist.check_environment(dict(launch, **change))
        one_line(error)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PEER_WAIT = """
import sys, torch
from machinery import bookkeeping, distributed as dist
dist.PEER_WAIT_SECONDS = float(sys.argv[1])
bookkeeping.run_main(lambda: dist.init(torch.device("cpu")))
"""


def waiting_alone(seconds):
    port = free_port()
    env = dict(
        os.environ, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", PEER_WAIT, str(seconds)], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    return process, port


def test_a_wait_for_a_peer_that_never_comes_is_bounded():
    process, _ = waiting_alone(2)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()  # a wait that was not bounded
    assert (
        process.returncode == 1
        and stderr.strip().splitlines() == [stderr.strip().splitlines()[-1]]
        and "waited 2.0 s for the others" in stderr
    ), stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_wait_for_a_peer_is_interruptible(signum):
    process, port = waiting_alone(300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # rank 0 listens on MASTER_PORT once it waits for the others
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(0.5)
    process.send_signal(signum)
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()  # a wait the signal did not end
    assert process.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == f"{signal.Signals(signum).name} before the first step: nothing was saved"


def test_a_reward_models_tokenizer_past_its_embeddings_is_refused_at_start(tmp_path):
    """Ids with a gap: the tokenizer has few tokens, but one id past the model's embeddings (step 1's index error)."""
    from tokenizers import Tokenizer
    from tokenizers import models as token_models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=40, num_labels=1, pad_token_id=0, **small))
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{str(d): 3 + d for d in range(9)}, "9": 500}
    backend = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    assert_one_line(
        run_script("grpo", ["--reward-model", str(tmp_path / "rm"), "--num-steps", "1"], tmp_path),
        "its tokenizer writes ids up to 500, but its model embeds only 40",
    )


def test_a_checkpoint_of_reward_model_is_read_safely_too(tmp_path):
    import reward_model

    marker = tmp_path / "ran"
    folder = tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    torch.save({"payload": Payload(str(marker))}, folder / "state.pt")
    args = reward_model.Args(resume=str(folder), output_dir=str(tmp_path))
    with pytest.raises(UsageError, match="which is a pickle"):
        checkpoints.load_checkpoint(str(folder), "reward_model", args)
    assert not marker.exists() and json.dumps(sorted(os.listdir(folder))) == '["state.pt"]'
