"""Bad input, round five (docs/bad_input.md, "reward_model.py, --reward-model and the environment"): each case runs the
script as a user would, in a subprocess confined to a process and an address-space limit with a timeout, and must
end in one line naming the problem, a non-zero exit, within 90 seconds, with no run folder left behind.

Principles: nothing may take the machine down (size-setting environment variables are checked like flags); a loop
that can run long is bounded up front; reward_model.py refuses what grpo.py refuses for the same flag, and flags that
cannot act; a reward model is checked when it loads, for what it is; preference data is read as written.
"""

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

import pytest

from machinery import bookkeeping, models, threads
from machinery import distributed as dist
from machinery.errors import UsageError
from tasks import preferences

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECONDS = 90


def user_tasks():
    """Threads of every process of this user: RLIMIT_NPROC counts them all, so the limit is set above it."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == os.getuid():
                count += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def confine(tasks):
    """In the child, before it runs: at most `tasks` + 256 threads of this user (not enforced for root), and 16 GiB of
    address space (each thread reserves its stack in it: a few thousand threads at most, for root too)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks + 256, tasks + 256))
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))

    return limit


def run_script(script, flags, tmp_path, env=None):
    """(exit status, stderr, seconds) of `python SCRIPT.py FLAGS` confined; no run folder may be left behind."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, f"{script}.py", *flags, "--output-dir", str(tmp_path / "runs")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=SECONDS,
        preexec_fn=confine(user_tasks()),
    )
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs"), "a run folder was left"
    return result.returncode, result.stderr, time.monotonic() - start


def assert_one_line(result, expected):
    code, stderr, seconds = result
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code not in (0, None) and seconds < SECONDS, (code, seconds)
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr[-2000:]
    assert expected in lines[-1], lines[-1]


# ---------------------------------------------------------------------------------------------------
# Nothing may take the machine down: the size-setting environment, checked like flags.
# ---------------------------------------------------------------------------------------------------

ENVIRONMENT = [
    ("grpo", {"OMP_NUM_THREADS": "100000"}, "OMP_NUM_THREADS is '100000': set it to a number of threads from 1 to"),
    ("reward_model", {"OMP_NUM_THREADS": "100000"}, "OMP_NUM_THREADS is '100000'"),
    ("ppo", {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS is '0'"),
    ("grpo", {"WORLD_SIZE": "abc"}, "WORLD_SIZE is 'abc': torchrun sets it to a whole number"),
    ("grpo", {"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE is 0: a launch has at least 1 process"),
    ("reward_model", {"RANK": "-1"}, "RANK is '-1'"),
    ("ppo", {"RANK": "3"}, "RANK is 3, not below WORLD_SIZE 1"),
    ("grpo", {"WORLD_SIZE": "2"}, "WORLD_SIZE is 2 but MASTER_ADDR is not set"),
]


@pytest.mark.parametrize("script, env, expected", ENVIRONMENT, ids=[f"{s} {e}" for s, e, _ in ENVIRONMENT])
def test_size_setting_environment_is_checked_like_a_flag(script, env, expected, tmp_path):
    assert_one_line(run_script(script, ["--num-steps", "1"], tmp_path, env), expected)


def test_omp_num_threads_is_bounded_as_threads_is(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    for bad in ("100000", "9", "0", "-1", "x", "", "4,100000", "2,", "2,x"):  # every nesting level, as the first
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(UsageError, match="from 1 to 8 .this machine has 2 cores"):
            threads.check_environment()
    for good in ("8", "2,1", " 2 , 8"):
        monkeypatch.setenv("OMP_NUM_THREADS", good)
        threads.check_environment()


def test_a_local_rank_is_checked_against_the_sizes_the_launcher_set():
    """torchrun sets LOCAL_WORLD_SIZE; other launchers (torch.multiprocessing.spawn) may set only WORLD_SIZE: then a
    LOCAL_RANK is bounded by the launch's processes."""
    launch = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="2", RANK="1")
    dist.check_environment(dict(launch, LOCAL_RANK="1"))
    with pytest.raises(UsageError, match="LOCAL_RANK is 2, not below WORLD_SIZE 2"):
        dist.check_environment(dict(launch, LOCAL_RANK="2"))
    with pytest.raises(UsageError, match="LOCAL_RANK is 1, not below LOCAL_WORLD_SIZE 1"):
        dist.check_environment(dict(launch, LOCAL_RANK="1", LOCAL_WORLD_SIZE="1"))


# ---------------------------------------------------------------------------------------------------
# reward_model.py: what grpo.py refuses, flags that cannot act, loops bounded up front.
# ---------------------------------------------------------------------------------------------------

FLAGS = [
    (["--learning-rate", "1e-20"], "--learning-rate is 1e-20: it must be at least 1e-8"),
    (["--max-grad-norm", "1e-300"], "--max-grad-norm is 1e-300: it must be at least 1e-6"),
    (["--warmup-steps", "100000000", "--num-steps", "3"], "--warmup-steps 100000000 is too long for a run of"),
    (["--batch-size", "100000000"], "(the batch's tokens: "),
    (["--batch-size", "2000000", "--micro-batch-size", "2000000"], "(a micro-batch's activations: "),
    (["--num-pairs", "30000"], "--num-pairs is 30000: the synthetic task draws at most 25600 pairs"),
    (["--task", "jsonl:{good}", "--num-pairs", "5"], "--num-pairs 5 acts only with --task synthetic"),
    (["--task", "jsonl:{good}", "--label-beta", "3"], "--label-beta 3.0 acts only with --task synthetic"),
    (["--task", "jsonl:{good}", "--max-new-tokens", "7"], "--max-new-tokens 7 acts only with --task synthetic"),
    (["--reward-model", "tiny"], "--reward-model tiny acts only in grpo.py and ppo.py"),
    (["--lora-rank", "4"], "--lora-rank 4 acts only in grpo.py and ppo.py"),
    (["--model", "{two}"], "is a classifier (Qwen2ForSequenceClassification) that has 2 outputs: a reward model has 1"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Preference files and folders that are not what they claim, made once."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

    folder = tmp_path_factory.mktemp("round5")
    tiny, tokenizer = models.resolve_model_path("tiny"), models.load_tokenizer("tiny")
    good = [{"prompt": f"{i}=", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(20)]
    user, reply = {"role": "user", "content": "1="}, {"role": "assistant", "content": "2"}
    lines = {
        "good": [],
        "letters": ['{"prompt": "1=", "chosen": "abc", "rejected": "xyz"}'],
        "surrogate": ['{"prompt": "1=", "chosen": "\\ud800", "rejected": "2"}'],
        "content": [json.dumps({"prompt": [user], "chosen": [dict(reply, content=6)], "rejected": [reply]})],
        "same": [json.dumps({"chosen": [user, reply], "rejected": [user, reply]})],
        "forms": [json.dumps({"prompt": "1=", "chosen": [reply], "rejected": "6"})],
        "number": ['{"prompt": 5, "chosen": "1", "rejected": "2"}'],
        "long": [json.dumps({"prompt": "1=", "chosen": "1" * 10_000_000, "rejected": "2"})],
    }
    paths = {}
    for name, extra in lines.items():
        paths[name] = str(folder / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in good) + "".join(line + "\n" for line in extra))
    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    small.update(num_labels=1, pad_token_id=0)

    def reward_model(name, model, saved_tokenizer=tokenizer):
        paths[name] = str(folder / name)
        model.save_pretrained(paths[name])
        saved_tokenizer.save_pretrained(paths[name])

    reward_model("two", AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=2))
    reward_model("one", AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1))
    reward_model(
        "short", Qwen2ForSequenceClassification(Qwen2Config(vocab_size=25, max_position_embeddings=8, **small))
    )
    reward_model("few_ids", Qwen2ForSequenceClassification(Qwen2Config(vocab_size=10, **small)))
    reward_model("letters_rm", Qwen2ForSequenceClassification(Qwen2Config(vocab_size=30, **small)), letters_tokenizer())
    paths["no_head"] = str(folder / "no_head")  # a causal LM's weights under a classifier's config: no score.weight
    shutil.copytree(tiny, paths["no_head"])
    config = json.load(open(os.path.join(paths["no_head"], "config.json")))
    config.update(architectures=["Qwen2ForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    json.dump(config, open(os.path.join(paths["no_head"], "config.json"), "w"))
    paths["run"] = str(folder / "run")  # a run folder: its model is in final/
    shutil.copytree(paths["two"], os.path.join(paths["run"], "final"))
    paths["reward_file"] = str(folder / "reward.py")
    with open(paths["reward_file"], "w") as f:
        f.write(
            "EXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(10)]\ndef fn(p, c, a):\n    return 1.0\n"
        )
    return paths


def letters_tokenizer():
    """A character-level tokenizer of ten letters: it reads every digit as <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as token_models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefghij"])}
    backend = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("flags, expected", FLAGS, ids=[" ".join(f) for f, _ in FLAGS])
def test_reward_model_refuses_what_grpo_refuses_and_what_cannot_act(flags, expected, files, tmp_path):
    flags = [flag.format(**files) for flag in flags]
    assert_one_line(run_script("reward_model", flags, tmp_path), expected)


@pytest.mark.parametrize("flags", [["--learning-rate", "1e-20"], ["--max-grad-norm", "1e-300"]])
def test_grpo_refuses_the_same_values_with_the_same_line(flags, tmp_path):
    _, grpo_line, _ = run_script("grpo", flags, tmp_path)
    _, reward_line, _ = run_script("reward_model", flags, tmp_path)
    assert grpo_line.strip().splitlines()[-1] == reward_line.strip().splitlines()[-1]


def test_label_beta_of_a_million_is_a_probability_not_an_overflow():
    assert preferences.preference_probability(0.0, 1.0, 1e6) == 0.0
    assert preferences.preference_probability(1.0, 0.0, 1e6) == 1.0
    assert preferences.preference_probability(0.5, 0.6, 30) == pytest.approx(1 / (1 + math.exp(3)))


# ---------------------------------------------------------------------------------------------------
# A reward model is checked when it loads, for what it is.
# ---------------------------------------------------------------------------------------------------

REWARD_MODELS = [
    ("tiny", [], "--reward-model 'tiny' is a causal LM, not a reward model"),
    ("{run}", [], "is a run folder, not a model: pass "),
    ("{two}", [], "that has 2 outputs: a reward model has 1"),
    ("{no_head}", [], "has no trained 'score.weight' in its weights"),
    ("{short}", [], "has 8 positions, fewer than the longest prompt of task 'copy'"),
    ("{few_ids}", [], "its tokenizer writes ids up to 24, but its model embeds only 10"),
    ("{letters_rm}", [], "does not know 11 of the characters of task 'copy'"),
]


@pytest.mark.parametrize("folder, flags, expected", REWARD_MODELS, ids=[e[:40] for _, _, e in REWARD_MODELS])
def test_a_reward_model_is_checked_for_what_it_is(folder, flags, expected, files, tmp_path):
    flags = ["--reward-model", folder.format(**files), *(flag.format(**files) for flag in flags), "--num-steps", "1"]
    assert_one_line(run_script("grpo", flags, tmp_path), expected)


def test_a_learnt_reward_has_no_target_of_0_9_in_the_summary(capsys):
    history = {"score": [1.0] * 20, "length": [3.0] * 20}
    bookkeeping.print_summary("grpo", history, 1.0, models.CPU, "final", learnt_reward="RUN/final")
    learnt = capsys.readouterr().out
    bookkeeping.print_summary("grpo", history, 1.0, models.CPU, "final")
    assert "0.9" not in learnt and "10-step mean >= 0.9 at step 10" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Preference data is read as written.
# ---------------------------------------------------------------------------------------------------

PAIRS = [
    ("letters", "line 21: 'a' is a character the tokenizer of 'tiny' does not know"),
    ("surrogate", "line 21: \"chosen\" holds '\\ud800', half of a surrogate pair"),
    ("content", 'line 21: "chosen"[0]["content"] must be a string, not 6'),
    ("same", 'line 21: "chosen" equals "rejected"'),
    ("forms", 'line 21: "chosen" is a list of messages and "rejected" a string: write the two completions in one'),
    ("number", 'line 21: "prompt" must be a string, not 5'),
    ("long", "line 21: its prompt and chosen completion are 10000002 characters"),
]


@pytest.mark.parametrize("name, expected", PAIRS, ids=[name for name, _ in PAIRS])
def test_preference_data_is_read_as_written(name, expected, files, tmp_path):
    result = run_script("reward_model", ["--task", f"jsonl:{files[name]}"], tmp_path)
    assert_one_line(result, expected)
    assert "Decimal" not in result[1]
