"""Bad input gets a one-line error saying what to change, never a traceback, and stops before any training.

Each case runs the script as a user would (`python grpo.py ...`). docs/bad_input.md lists the same table
with the message each case gets.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import grpo
import ppo
from machinery import errors, models
from machinery.tiny_model import TINY_MODEL
from tasks import Task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARD_FILE = """\
EXAMPLES = [{"prompt": f"{i}=", "answer": str(i)} for i in range(10)]


def raises(prompt, completion, answer):
    return 1 / 0


def nan(prompt, completion, answer):
    return float("nan")


def string(prompt, completion, answer):
    return "1"
"""

# (script, flags, what the error line must say). {name} in a flag is a file made by the `inputs` fixture.
BAD_INPUTS = [
    # Args out of range
    ("grpo", "--group-size 1", r"--group-size is 1: GRPO needs at least 2"),
    ("grpo", "--prompts-per-step 0", r"--prompts-per-step is 0: it must be at least 1"),
    ("grpo", "--max-new-tokens 0", r"--max-new-tokens is 0: it must be at least 1"),
    ("grpo", "--temperature 0", r"--temperature is 0.0: it must be > 0"),
    ("grpo", "--clip-low 1.5", r"--clip-low 1.5 .*need 0 <= clip-low < 1"),
    ("grpo", "--clip-low -0.1", r"--clip-low -0.1 .*need 0 <= clip-low < 1"),
    ("grpo", "--beta -0.1", r"--beta .* must be >= 0"),
    ("ppo", "--gamma 1.5", r"--gamma is 1.5: it must be in \[0, 1\]"),
    ("ppo", "--lam -0.1", r"--lam is -0.1: it must be in \[0, 1\]"),
    ("ppo", "--vf-coef -1", r"--vf-coef.* must be >= 0"),
    ("ppo", "--kl-coef -0.1", r"--kl-coef.* must be >= 0"),
    ("ppo", "--update-epochs 0", r"--update-epochs is 0: it must be at least 1"),
    ("ppo", "--num-minibatches 3", r"--num-minibatches 3 does not divide the batch of 64 completions"),
    ("ppo", "--kl-coef 0 --target-kl 0.1", r"--target-kl needs .* a starting --kl-coef > 0"),
    # model, task and data
    ("grpo", "--model /no/such/dir", r"--model '/no/such/dir' is neither a local folder nor a hub id"),
    ("ppo", "--model {garbage_model}", r"could not load .*garbage-model.*: check --model"),
    ("grpo", "--model /no/such/model.gguf", r"--model '/no/such/model\.gguf': no such \.gguf file: fix the path"),
    (
        "ppo",
        "--critic-model /no/such/critic",
        r"--critic-model '/no/such/critic' is neither a local folder nor a hub id",
    ),
    (
        "grpo",
        "--reward-model not/a/model/path",
        r"--reward-model 'not/a/model/path' is neither a local folder nor a hub id",
    ),
    ("grpo", "--task nosuchtask", r"unknown task 'nosuchtask': pass --task with one of copy, "),
    ("grpo", "--task jsonl:{bad_jsonl}", r"bad\.jsonl, line 2: not valid JSON"),
    ("grpo", "--task jsonl:{tmp}/missing.jsonl", r"cannot read '.*missing\.jsonl' \(No such file or directory\)"),
    (
        "grpo",
        "--task jsonl:{long_jsonl}",
        r"a prompt of task .* is 300 tokens .* more than the 256 positions of 'tiny': shorten the prompts",
    ),
    (
        "ppo",
        "--task jsonl:{long_jsonl}",
        r"is 300 tokens .* more than the 256 positions of 'tiny': shorten the prompts",
    ),
    ("grpo", "--task countdown", r"characters the tokenizer of 'tiny' does not know"),
    # a reward function that misbehaves
    (
        "grpo",
        "--task python:{reward_py}:raises",
        r"raised ZeroDivisionError: division by zero .*fix the reward function",
    ),
    ("ppo", "--task python:{reward_py}:nan", r"returned nan .*it must return a finite number"),
    ("grpo", "--task python:{reward_py}:string", r"returned '1' .*it must return a finite number"),
    # checkpoints
    ("grpo", "--resume {tmp}/no-such-checkpoint", r"is not a checkpoint \(no state\.safetensors in it\)"),
    ("grpo", "--resume {corrupt_checkpoint}", r"state\.safetensors cannot be read .*the checkpoint is corrupt"),
    ("grpo", "--resume {ppo_checkpoint}", r"is a checkpoint of ppo\.py, not grpo\.py: resume it with that script"),
    ("ppo", "--resume {grpo_checkpoint}", r"is a checkpoint of grpo\.py, not ppo\.py: resume it with that script"),
    (
        "grpo",
        "--resume {grpo_checkpoint} --learning-rate 1e-3",
        r"was run with --learning-rate 0.0005, not 0.001 \(a branch keeps it: .*\): drop the flag",
    ),
    # flags that cannot act, hangs and tracebacks of round four
    ("grpo", "--lora-alpha 16", r"--lora-alpha 16.0 acts only on LoRA adapters, and --lora-rank is 0"),
    ("grpo", "--max-sampling-rounds 5", r"--max-sampling-rounds 5 acts only with --dynamic-sampling"),
    (
        "grpo",
        "--dynamic-sampling --max-sampling-rounds 1000000000",
        r"--max-sampling-rounds is 1000000000: at most 100",
    ),
    ("grpo", "--lora-rank 4 --lora-target-modules q_proj nosuch_proj", r"nosuch_proj names no linear or embedding"),
    ("grpo", "--lora-rank 1000000000", r"--lora-rank 1000000000 is more than 128, the highest rank"),
    ("grpo", "--lora-rank 4 --lora-target-modules embed_tokens", r"adapts model\.embed_tokens, which 'tiny' ties"),
    ("grpo", "--system-prompt hi", r"--system-prompt goes into the chat template's system turn, and 'tiny' has none"),
    ("grpo", "--model {templated} --system-prompt {long_system}", r"--system-prompt is 100,000 characters, more than"),
    (
        "grpo",
        "--model {invalid_config}",
        r"could not load .*: its files are invalid \(StrictDataclass\w+: .*layer_types",
    ),
    ("grpo", "--reward-model {garbage_weights}", r"could not load .*garbage-weights.*: its files are invalid \(Safet"),
    # hardware
    ("grpo", "--dtype float16", r"invalid choice 'float16' for argument '--dtype'\. Expected one of \('auto', "),
    ("ppo", "--num-steps 1e3", r"Error parsing --num-steps: invalid literal .* \(--help lists every flag\)"),
    ("grpo", "--no-such-flag 3", r"Unrecognized options: --no-such-flag"),
    ("ppo", "--threads 0", r"--threads is '0': pass auto, or a number of threads from 1 to \d+ \(this machine has"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-inputs")
    files = {"tmp": str(tmp)}

    def write(name, text):
        path = tmp / name
        path.write_text(text)
        files[name.replace("-", "_").replace(".", "_")] = str(path)

    write("bad.jsonl", '{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": \n')
    write("long.jsonl", "".join(json.dumps({"prompt": str(i) * 300, "answer": str(i)}) + "\n" for i in range(3)))
    write("reward.py", REWARD_FILE)
    garbage = tmp / "garbage-model"
    garbage.mkdir()
    (garbage / "config.json").write_text("{ this is not json")
    files["garbage_model"] = str(garbage)
    files["long_system"] = "x" * 100_000  # one word: each prompt tokenized with it took 0.2 s, in one call for all
    tiny = models.resolve_model_path(TINY_MODEL)
    for name in ("templated", "invalid-config", "garbage-weights"):
        shutil.copytree(tiny, tmp / name)
        files[name.replace("-", "_")] = str(tmp / name)
    tokenizer = models.load_tokenizer(files["templated"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    tokenizer.save_pretrained(files["templated"])
    config = json.loads((tmp / "invalid-config" / "config.json").read_text())
    (tmp / "invalid-config" / "config.json").write_text(json.dumps(dict(config, layer_types=["full_attention"])))
    config = dict(config, architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    (tmp / "garbage-weights" / "config.json").write_text(json.dumps(config))
    (tmp / "garbage-weights" / "model.safetensors").write_bytes(b"\x00garbage" * 100)

    for script, module in (("grpo", grpo), ("ppo", ppo)):  # the defaults, so only the flag under test differs
        output_dir = tmp / f"{script}-runs"
        module.main(module.Args(num_steps=1, save_every=1, sample_every=0, output_dir=str(output_dir)))
        (files[f"{script}_checkpoint"],) = glob.glob(str(output_dir / "*" / "checkpoint"))
    corrupt = tmp / "corrupt-checkpoint"
    corrupt.mkdir()
    (corrupt / "state.safetensors").write_bytes(b"\x00garbage" * 100)
    files["corrupt_checkpoint"] = str(corrupt)
    return files


def run_script(script, flags, output_dir, xdg_cache):
    """--num-steps 2 first (a flag can override it): a case whose check went missing fails in seconds, not after a
    run."""
    env = dict(os.environ, XDG_CACHE_HOME=xdg_cache, OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            f"{script}.py",
            "--num-steps",
            "2",
            *flags,
            "--sample-every",
            "0",
            "--output-dir",
            str(output_dir),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("script, flags, expected", BAD_INPUTS, ids=[f"{s} {f}" for s, f, _ in BAD_INPUTS])
def test_bad_input_gets_a_one_line_error(script, flags, expected, inputs, tmp_path, xdg_cache):
    flags = [flag.format(**inputs) for flag in flags.split()]
    result = run_script(script, flags, tmp_path / "runs", xdg_cache)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), result.stderr
    assert re.search(expected, lines[-1]), lines[-1]
    if any(
        "python:" in flag for flag in flags
    ):  # a reward function is first called at step 1: the run has started, nothing is saved
        assert not glob.glob(str(tmp_path / "runs" / "*" / "checkpoint")) and not glob.glob(
            str(tmp_path / "runs" / "*" / "final")
        )
    else:  # everything else is refused before the run folder exists, with nothing else on stderr
        assert len(lines) == 1, result.stderr
        assert not os.path.exists(tmp_path / "runs")


def test_a_prompt_that_just_fits_is_accepted(tiny_tokenizer, tiny_model):
    """The length check's boundary: prompt + max_new_tokens == max_position_embeddings (256) is fine, one more is
    not."""
    task = Task("fits", [{"prompt": "1" * 200, "answer": "1"}], [{"prompt": "2" * 100, "answer": "2"}], None)
    models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", 56, chat_template=True)
    with pytest.raises(errors.UsageError, match="is 200 tokens .*lower --max-new-tokens to 56"):
        models.check_prompt_length(tiny_tokenizer, task, tiny_model, "tiny", 57, chat_template=True)
    long_test = Task(
        "long-test", task.train[:1], [{"prompt": "3" * 300, "answer": "3"}], None
    )  # eval reads the test split
    with pytest.raises(errors.UsageError, match="is 300 tokens .*: shorten the prompts$"):
        models.check_prompt_length(tiny_tokenizer, long_test, tiny_model, "tiny", 1, chat_template=True)


def test_every_case_is_distinct():
    assert len(BAD_INPUTS) >= 20 and len({(s, f) for s, f, _ in BAD_INPUTS}) == len(BAD_INPUTS)
