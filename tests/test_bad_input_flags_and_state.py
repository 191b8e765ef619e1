"""Bad input, by principle (docs/bad_input.md names each test): every flag checked before anything loads, algorithm
state that stays valid, user code that may do anything, only trainable models trained, outputs that never collide,
and signals. Principles 4 (data) and 7 (resume) are in test_bad_input_data_and_resume.py.
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import typing

import pytest
import torch

import grpo
import ppo
from machinery import bookkeeping, checkpoints, dumps, models, startup
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL, tiny_model_dir
from tasks import Task
from tasks import user as user_tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {grpo: dict(prompts_per_step=2, group_size=2), ppo: dict(prompts_per_step=4, num_minibatches=2)}


def small_args(module, tmp_path, **overrides):
    return module.Args(
        **{
            **dict(num_steps=1, max_new_tokens=3, sample_every=0, output_dir=str(tmp_path / "runs")),
            **SMALL[module],
            **overrides,
        }
    )


def run_with_flag(module, name, value, base, monkeypatch):
    """`module.main` with one flag as the user types it over the Args `base`: (its UsageError or None, models
    loaded)."""
    import tyro

    args = tyro.cli(module.Args, args=[f"--{name.replace('_', '-')}", value], default=base)
    loads, real_load = [], models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    try:
        module.main(args)
    except UsageError as e:
        return e, loads
    return None, loads


def float_flags(module):
    hints = typing.get_type_hints(module.Args)
    return [
        f.name for f in dataclasses.fields(module.Args) if float in (hints[f.name], *typing.get_args(hints[f.name]))
    ]


# ---------------------------------------------------------------------------------------------------
# Principle 1: every flag is checked before anything loads.
# ---------------------------------------------------------------------------------------------------

FUZZ = [
    (module, name, value)
    for module in (grpo, ppo)
    for name in float_flags(module)
    for value in ("nan", "inf", "-inf", "0", "-1")
]


@pytest.mark.parametrize("module, name, value", FUZZ, ids=[f"{m.__name__} {n}={v}" for m, n, v in FUZZ])
def test_principle1_fuzz_every_float_flag(module, name, value, tmp_path, monkeypatch):
    """Each float flag, parsed from the command line as the user types it: a clean run with a finite model, or one
    line naming the flag, raised before any model loads. Anything else (a traceback) fails the test."""
    e, loads = run_with_flag(module, name, value, small_args(module, tmp_path), monkeypatch)
    if e is not None:
        assert "\n" not in str(e) and not loads, (str(e), loads)
        if not math.isfinite(float(value)):
            assert str(e) == f"--{name.replace('_', '-')} is {float(value)}: it must be a finite number"
        return
    (final,) = [
        os.path.join(r, d, "final") for r, ds, _ in os.walk(tmp_path / "runs") for d in ds if d.startswith("copy")
    ]
    weights = models.load_causal_lm(final, models.CPU)
    assert all(torch.isfinite(p).all() for p in weights.parameters())


def test_principle1_fuzz_covers_every_float_flag():
    assert {"learning_rate", "temperature", "clip_high", "beta"} <= set(float_flags(grpo))
    assert {"target_kl", "critic_learning_rate", "gamma", "lam", "kl_coef"} <= set(float_flags(ppo))
    assert len(FUZZ) == 5 * (len(float_flags(grpo)) + len(float_flags(ppo))) >= 100


@pytest.mark.parametrize(
    "module, flags, expected",
    [
        (grpo, dict(seed=-1), "--seed is -1: it must be in [0, 2**32)"),
        (grpo, dict(learning_rate=2.0), "--learning-rate is 2.0: it must be in (0, 1)"),
        (grpo, dict(learning_rate=0.5, weight_decay=2.0), "--learning-rate 0.5 times --weight-decay 2.0 is >= 1"),
        (ppo, dict(kl_horizon=0), "--kl-horizon is 0: it must be at least 1"),
        (ppo, dict(target_kl=1.0, kl_horizon=10), "--kl-horizon 10 is below the 64 completions of a step"),
        (ppo, dict(gamma=1.5), "--gamma is 1.5: it must be in [0, 1]"),
    ],
)
def test_principle1_ranges(module, flags, expected):
    with pytest.raises(UsageError) as e:
        module.check_args(module.Args(**flags))
    assert str(e.value).startswith(expected), str(e.value)


def test_principle1_ppos_batch_checks_count_completions_not_prompts():
    """--kl-horizon and --num-minibatches are checked against the step's completions, prompts x samples per prompt:
    4 prompts x 4 samples are 16 completions, 3 x 2 are 6."""
    ok = dict(prompts_per_step=4, samples_per_prompt=4, target_kl=1.0, num_minibatches=2)
    ppo.check_args(ppo.Args(**ok, kl_horizon=16))
    with pytest.raises(UsageError, match="--kl-horizon 8 is below the 16 completions of a step"):
        ppo.check_args(ppo.Args(**ok, kl_horizon=8))
    ppo.check_args(ppo.Args(prompts_per_step=3, samples_per_prompt=2, num_minibatches=2))
    with pytest.raises(UsageError, match="--num-minibatches 4 does not divide the batch of 6 completions"):
        ppo.check_args(ppo.Args(prompts_per_step=3, samples_per_prompt=2, num_minibatches=4))


CANNOT_ACT = [
    (grpo, dict(lora_alpha=16.0), "--lora-alpha 16.0 acts only on LoRA adapters, and --lora-rank is 0"),
    (grpo, dict(lora_dropout=0.1), "--lora-dropout 0.1 acts only on LoRA adapters"),
    (ppo, dict(lora_target_modules=("q_proj",)), "--lora-target-modules q_proj acts only on LoRA adapters"),
    (grpo, dict(lora_merged=True), "--lora-merged acts only on LoRA adapters"),
    (
        grpo,
        dict(max_sampling_rounds=5),
        "--max-sampling-rounds 5 acts only with --dynamic-sampling, so it would change",
    ),
    (grpo, dict(scale_rewards="none", adv_eps=1e-6), "--adv-eps 1e-06 acts only when a std divides the advantages"),
    (ppo, dict(kl_horizon=500), "--kl-horizon 500 acts only with --target-kl"),
    (ppo, dict(vf_coef=0.0, critic_model="tiny"), "--critic-model tiny acts only on the critic, and --vf-coef 0"),
    (ppo, dict(vf_coef=0.0, critic_learning_rate=1e-4), "--critic-learning-rate 0.0001 acts only on the critic"),
    (ppo, dict(vf_coef=0.0, cliprange_value=0.5), "--cliprange-value 0.5 acts only on the critic"),
    (grpo, dict(system_prompt="Be brief.", chat_template=False), "--system-prompt goes into the chat template's"),
    (grpo, dict(dynamic_sampling=True, max_sampling_rounds=10**9), "--max-sampling-rounds is 1000000000: at most 100"),
]


@pytest.mark.parametrize("module, flags, expected", CANNOT_ACT, ids=[str(f) for _, f, _ in CANNOT_ACT])
def test_principle1_a_flag_that_cannot_act_is_refused(module, flags, expected):
    with pytest.raises(UsageError) as e:
        module.check_args(module.Args(**flags))
    assert str(e.value).startswith(expected), str(e.value)


def test_principle1_a_flag_given_its_default_is_no_reason_to_refuse():
    """Passing a flag's declared default (or its hub default) changes nothing: accepted without its partner."""
    grpo.check_args(grpo.Args(lora_alpha=32.0, lora_target_modules=("all-linear",), max_sampling_rounds=3))
    args = ppo.Args(model="some/model", vf_coef=0.0, critic_learning_rate=ppo.HUB_DEFAULTS["critic_learning_rate"])
    ppo.check_args(args)
    grpo.check_args(grpo.Args(dynamic_sampling=True, max_sampling_rounds=100))


LAYERS = [
    (
        dict(lora_target_modules=("q_proj", "nosuch_proj")),
        "--lora-target-modules nosuch_proj names no linear or "
        "embedding layer of --model 'tiny': its linear layers are down_proj gate_proj k_proj lm_head o_proj q_proj "
        "up_proj v_proj; fix the name, or keep all-linear",
    ),
    (
        dict(lora_rank=10**9),
        "--lora-rank 1000000000 is more than 128, the highest rank any adapted layer of --model 'tiny' can use",
    ),
    (
        dict(lora_target_modules=("embed_tokens",)),
        "--lora-target-modules adapts model.embed_tokens, which 'tiny' ties "
        "to its input embedding or output head (tie_word_embeddings)",
    ),
    (dict(lora_target_modules=("q_proj", "lm_head")), "--lora-target-modules adapts lm_head, which 'tiny' ties"),
]


@pytest.mark.parametrize("flags, expected", LAYERS, ids=[str(f) for f, _ in LAYERS])
def test_principle1_lora_flags_are_checked_against_the_layers_before_any_load(flags, expected, monkeypatch):
    """On the model's skeleton (the meta device): no weight loads, no allocation (a rank of 1e9 allocated 512 GB)."""
    pytest.importorskip("peft")
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    args = grpo.Args(**{"lora_rank": 4, **flags})
    grpo.check_args(args)
    with pytest.raises(UsageError) as e:
        startup.check_model_names(args)
    assert str(e.value).startswith(expected), str(e.value)
    startup.check_model_names(grpo.Args(lora_rank=128, lora_target_modules=("q_proj", "v_proj")))  # the most, fine
    startup.check_model_names(ppo.Args(lora_rank=4, lora_target_modules=("q_proj",)))  # the critic's layers too


def test_principle1_dynamic_sampling_stops_between_rounds_on_a_signal():
    """Groups that never differ: sampling goes on to --max-sampling-rounds, or stops at the round where `stopped`
    says a signal came; either way the batch is one step's (prompts_per_step groups)."""
    args = grpo.Args(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_sampling_rounds=100)
    calls = []
    sample = lambda: calls.append(1) or dict(scores=torch.ones(4), completion_mask=torch.ones(4, 3))
    batch, rounds = grpo.dynamic_sampling(sample, args)
    assert rounds == len(calls) == 100 and len(batch["scores"]) == 4
    calls.clear()
    batch, rounds = grpo.dynamic_sampling(sample, args, stopped=lambda: len(calls) >= 3)
    assert rounds == len(calls) == 3 and len(batch["scores"]) == 4


# ---------------------------------------------------------------------------------------------------
# Principle 2: algorithm state stays valid.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [grpo, ppo])
def test_principle2_nonfinite_weights_are_never_saved_as_the_final_model(module, tmp_path, monkeypatch):
    """An update that leaves a weight NaN (here forced after the real step) stops the run in one line: no final
    model."""
    real_step, calls = torch.optim.AdamW.step, []
    last = 1 if module is grpo else ppo.Args.update_epochs * SMALL[ppo]["num_minibatches"]  # PPO: the last minibatch's

    def poisoned_step(self, *a, **k):
        result = real_step(self, *a, **k)
        calls.append(1)
        if len(calls) == last:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    with pytest.raises(
        UsageError,
        match=r"weights are not finite after the last update, so .*final was not written "
        r"\(no checkpoint was saved\): lower --learning-rate",
    ):
        module.main(small_args(module, tmp_path))
    assert not [d for _, ds, _ in os.walk(tmp_path) for d in ds if d in ("final", "final.tmp")]


def test_principle2_a_checkpoint_is_not_replaced_by_nonfinite_weights(tmp_path, tiny_tokenizer):
    model = models.load_causal_lm(TINY_MODEL, models.CPU)
    folder = str(tmp_path / "run" / "checkpoint")
    checkpoints.save_model(model, tiny_tokenizer, folder)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(UsageError, match="the last good checkpoint is .*checkpoint"):
        checkpoints.save_model(model, tiny_tokenizer, folder)
    reloaded = models.load_causal_lm(folder, models.CPU)
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())


def test_principle2_the_kl_coefficient_stays_positive_at_the_smallest_horizon_allowed():
    """check_args wants kl_horizon >= N, so each step moves the coefficient by at most 20%: it never turns negative."""
    kl_coef = 0.1
    for _ in range(100):
        kl_coef = ppo.adaptive_kl_coef(kl_coef, kl=0.0, target_kl=1.0, n_completions=64, horizon=64)
    assert kl_coef == pytest.approx(0.1 * 0.8**100) and kl_coef > 0
    assert ppo.adaptive_kl_coef(0.1, 0.0, 1.0, 64, 10) < 0  # what the check keeps out


# ---------------------------------------------------------------------------------------------------
# Principle 3: user code may do anything.
# ---------------------------------------------------------------------------------------------------


def misbehaving(kind):
    def reward(prompt, completion, answer):
        if kind == "exit0":
            sys.exit(0)
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "huge":
            return 10**400
        if kind == "multiline":
            raise ValueError("first line\nsecond line")
        os.chdir("/")
        return float(sys.argv[1:] == [])  # it sees no flags of ours

    return reward


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("exit0", r"raised SystemExit: 0 on prompt '1=' and completion '2': fix the reward function"),
        ("interrupt", r"raised KeyboardInterrupt: \(no message\) on prompt '1='"),
        ("huge", r"returned 1000000000.*\.\.\. on prompt '1=' and completion '2': it must return a finite number"),
        ("multiline", r"raised ValueError: first line second line on prompt"),
    ],
)
def test_principle3_any_exception_or_unconvertible_number_is_one_line(kind, expected):
    task = Task("python:r.py:f", [], [], misbehaving(kind))
    with pytest.raises(UsageError, match=rf"^reward function of task 'python:r.py:f' {expected}") as e:
        task.score(["1="], ["2"], ["1"])
    assert "\n" not in str(e.value)


def test_principle3_chdir_and_sys_argv_do_not_leak(monkeypatch):
    cwd = os.getcwd()
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--task", "python:r.py:f"])
    assert Task("t", [], [], misbehaving("chdir")).score(["1="], ["2"], ["1"]) == [1.0]
    assert os.getcwd() == cwd and sys.argv == ["grpo.py", "--task", "python:r.py:f"]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("raise SystemExit(0)", "SystemExit: 0: fix that file"),
        ("raise KeyboardInterrupt", "KeyboardInterrupt: (no message): fix that file"),
        (
            "import argparse\nARGS = argparse.ArgumentParser().parse_args()\n"
            "EXAMPLES = [{'prompt': '1=', 'answer': '1'}] * 2\n"
            "def f(p, c, a):\n    return 1.0",
            None,
        ),
    ],
)
def test_principle3_a_module_that_exits_interrupts_or_parses_argv_at_import(source, expected, tmp_path, monkeypatch):
    path = tmp_path / "r.py"
    path.write_text(source)
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--task", f"python:{path}:f", "--num-steps", "3"])
    if expected is None:  # argparse sees no flags of ours, so it parses
        reward_fn, examples = user_tasks.python_reward_and_examples(f"{path}:f")
        assert len(examples) == 2
        return
    with pytest.raises(UsageError) as e:
        user_tasks.python_reward_and_examples(f"{path}:f")
    assert str(e.value) == f"importing {path} raised {expected}"


def test_principle3_a_reward_function_calling_sys_exit_0_fails_the_run(tmp_path, xdg_cache):
    """Exit status 0 with no model would read as success: the CLI says what happened, and exits nonzero."""
    (tmp_path / "r.py").write_text(
        "import sys\nEXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(4)]\n"
        "def f(p, c, a):\n    sys.exit(0)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "grpo.py",
            "--task",
            f"python:{tmp_path / 'r.py'}:f",
            "--num-steps",
            "1",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--sample-every",
            "0",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        cwd=REPO,
        env=dict(os.environ, XDG_CACHE_HOME=xdg_cache, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: reward function of task 'python:"), result.stderr
    assert "raised SystemExit: 0" in result.stderr.splitlines()[-1]


def test_principle3_the_run_folder_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = bookkeeping.make_run_dir(grpo.Args(output_dir="relative-runs"))
    assert os.path.isabs(folder) and folder.startswith(str(tmp_path / "relative-runs"))


# ---------------------------------------------------------------------------------------------------
# Principle 5: only what can be trained is trained.
# ---------------------------------------------------------------------------------------------------


def save_from_config(folder, config, model_class, tokenizer=None):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model_class(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


def test_principle5_a_saved_classifier_or_encoder_is_not_a_causal_lm(tmp_path, tiny_tokenizer):
    from transformers import BertConfig, BertForMaskedLM, Qwen2Config, Qwen2ForSequenceClassification

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=40)
    classifier = save_from_config(
        tmp_path / "rm", Qwen2Config(**tiny, num_labels=1, pad_token_id=0), Qwen2ForSequenceClassification
    )
    with pytest.raises(UsageError, match=r"was saved as Qwen2ForSequenceClassification, not a causal LM: pass one"):
        models.load_causal_lm(classifier, models.CPU)
    bert = save_from_config(tmp_path / "bert", BertConfig(**tiny), BertForMaskedLM)
    with pytest.raises(UsageError, match=r"was saved as BertForMaskedLM, not a causal LM"):
        models.load_causal_lm(bert, models.CPU)


def test_principle5_a_tokenizer_with_neither_pad_nor_eos(tmp_path, tiny_tokenizer):
    folder = tmp_path / "no-eos"
    tiny_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("pad_token", None), config.pop("eos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # A tokenizer that has padded a batch saves its pad token in tokenizer.json too; a user's file would not.
    saved = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**saved, "padding": None}))
    with pytest.raises(UsageError, match=r"has neither a pad nor an EOS token, so no completion can end"):
        models.load_tokenizer(str(folder))


def test_principle5_a_critic_with_another_vocabulary(tmp_path, tiny_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = tiny_tokenizer.__class__.from_pretrained(tiny_model_dir())
    other.add_tokens(["<extra>"])
    config = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=40
    )
    critic = save_from_config(tmp_path / "critic", config, Qwen2ForCausalLM, other)
    with pytest.raises(UsageError, match=r"--critic-model .* has another vocabulary than --model 'tiny'"):
        startup.check_model_names(ppo.Args(critic_model=critic))
    small = save_from_config(
        tmp_path / "small", Qwen2Config(**{**config.to_dict(), "vocab_size": 10}), Qwen2ForCausalLM
    )
    with pytest.raises(UsageError, match=r"embeds 10 tokens, fewer than the 25 of --model 'tiny'"):
        startup.check_model_names(ppo.Args(critic_model=small))


# ---------------------------------------------------------------------------------------------------
# Principle 6: outputs never collide or mix.
# ---------------------------------------------------------------------------------------------------


def test_principle6_two_runs_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    args = grpo.Args(output_dir=str(tmp_path))
    first, second = bookkeeping.make_run_dir(args), bookkeeping.make_run_dir(args)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert second == first + "_2"


def test_principle6_output_dir_that_is_a_file_or_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"--output-dir .*file is a file, not a folder: pick another --output-dir"):
        bookkeeping.make_run_dir(grpo.Args(output_dir=str(tmp_path / "file")))

    def read_only(path, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(
        UsageError, match=r"cannot create the run folder .* \(Permission denied\): pick another --output-dir"
    ):
        bookkeeping.make_run_dir(grpo.Args(output_dir=str(tmp_path / "ro")))


def test_principle6_dump_dir_of_another_run_or_a_file_is_refused(tmp_path):
    args = grpo.Args(dump_dir=str(tmp_path / "dumps"))
    dumps.start_dumps(args, "grpo", "/runs/a")
    (tmp_path / "dumps" / "step000001.safetensors").write_bytes(b"")
    dumps.start_dumps(grpo.Args(dump_dir=str(tmp_path / "dumps")), "grpo", "/runs/a")  # the same run, resumed
    with pytest.raises(UsageError, match=r"--dump-dir .*dumps already holds files of /runs/a: pass an empty or new"):
        dumps.start_dumps(grpo.Args(dump_dir=str(tmp_path / "dumps")), "grpo", "/runs/b")
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "step000001.safetensors").write_bytes(b"")
    with pytest.raises(UsageError, match=r"already holds files of another run"):
        dumps.start_dumps(grpo.Args(dump_dir=str(tmp_path / "stray")), "grpo", "/runs/b")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match=r"--dump-dir .*a-file is a file, not a folder"):
        dumps.start_dumps(grpo.Args(dump_dir=str(tmp_path / "a-file")), "grpo", "/runs/b")


def test_principle6_resume_with_another_output_dir_branches_into_a_new_folder(tmp_path):
    """--resume with the checkpoint's own --output-dir continues in its run folder; with another, a branch: a new run
    folder there (tests/test_branch.py runs one), the checkpoint's only read."""
    checkpoint = tmp_path / "runs" / "copy__grpo__1__1" / "checkpoint"
    checkpoint.mkdir(parents=True)
    same = grpo.Args(resume=str(checkpoint), output_dir=str(tmp_path / "runs"))
    assert bookkeeping.make_run_dir(same) == str(checkpoint.parent)
    branch = bookkeeping.make_run_dir(grpo.Args(resume=str(checkpoint), output_dir=str(tmp_path / "elsewhere")))
    assert os.path.dirname(branch) == str(tmp_path / "elsewhere") and os.listdir(checkpoint.parent) == ["checkpoint"]


def test_principle6_a_refused_start_leaves_no_empty_folder(tmp_path, monkeypatch):
    """The run folder is made before the models load; a start refused after that removes it again."""

    def refused():
        bookkeeping.make_run_dir(grpo.Args(output_dir=str(tmp_path / "runs")))
        raise UsageError("refused")

    monkeypatch.setattr(bookkeeping, "MADE_FOLDERS", [])
    with pytest.raises(SystemExit, match="error: refused"):
        bookkeeping.run_main(refused)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------
# Principle 8: signals.
# ---------------------------------------------------------------------------------------------------


def start(flags, tmp_path, xdg_cache):
    log = open(tmp_path / "stderr.txt", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "grpo.py",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--sample-every",
            "0",
            "--output-dir",
            str(tmp_path / "runs"),
            *flags,
        ],
        cwd=REPO,
        env=dict(os.environ, XDG_CACHE_HOME=xdg_cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    return process, log


def wait_for(condition, process, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None and time.time() < deadline, "the run ended or timed out first"
        time.sleep(0.05)


def test_principle8_ctrl_c_while_loading_says_nothing_was_saved(tmp_path, xdg_cache):
    process, log = start([], tmp_path, xdg_cache)
    line = process.stdout.readline()
    while line.startswith(("threads: ", "dtype: ")):  # the threads and precision chosen, printed before the settings
        line = process.stdout.readline()
    assert line.startswith("settings (")  # printed once the run folder exists, before any load
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=120)
    log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert stderr.strip().splitlines()[-1] == "SIGINT before the first step: nothing was saved", stderr
    assert not (tmp_path / "runs").exists()  # the empty run folder is removed again


def test_principle8_a_second_sigterm_stops_a_step_that_hangs_in_user_code(tmp_path, xdg_cache):
    marker = tmp_path / "entered"
    (tmp_path / "r.py").write_text(
        "import pathlib, time\nEXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(4)]\n"
        f"def f(p, c, a):\n    pathlib.Path({str(marker)!r}).touch()\n"
        "    while True:\n        try:\n            time.sleep(100)\n        except BaseException:\n            pass\n"
    )
    process, log = start(["--task", f"python:{tmp_path / 'r.py'}:f"], tmp_path, xdg_cache)
    wait_for(marker.exists, process)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert process.poll() is None  # the first one waits for the step to finish
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == (
        "SIGTERM again: stopped at once, in the middle of a step; no checkpoint was saved"
    ), stderr


def test_principle8_sigterm_during_dynamic_sampling_ends_the_step_at_the_next_round(tmp_path, xdg_cache):
    """Groups that never differ (a constant reward) under --dynamic-sampling --max-sampling-rounds 100, 0.2 s a
    round: the step would take 20 s more; one SIGTERM ends sampling at the next round, saves and stops."""
    marker = tmp_path / "sampling"
    (tmp_path / "r.py").write_text(
        "import pathlib, time\nEXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(4)]\n"
        f"def f(p, c, a):\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.05)\n    return 1.0\n"
    )
    flags = ["--task", f"python:{tmp_path / 'r.py'}:f", "--dynamic-sampling", "--max-sampling-rounds", "100"]
    process, log = start([*flags, "--num-steps", "5"], tmp_path, xdg_cache)
    wait_for(marker.exists, process)
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    process.communicate(timeout=60)
    log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert time.monotonic() - started < 15, stderr
    assert stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM after step 1; resume with: "), stderr
