"""Runs that lose nothing: a signal saves a checkpoint to resume from; a NaN stops the run with the batch
dumped and the last good checkpoint intact; running out of memory says which flag to lower."""

import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
import ppo
from machinery import bookkeeping, checkpoints, errors, models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"grpo": grpo, "ppo": ppo}


def child_env(xdg_cache):
    return dict(os.environ, XDG_CACHE_HOME=xdg_cache, OMP_NUM_THREADS="1")


def wait_for(predicate, what, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            pytest.fail(f"the run exited (code {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.parametrize(
    "script, sig",
    [
        pytest.param("grpo", signal.SIGINT, id="grpo-SIGINT"),
        pytest.param("ppo", signal.SIGTERM, id="ppo-SIGTERM"),
        pytest.param(
            "grpo", signal.SIGTERM, id="grpo-SIGTERM", marks=pytest.mark.slow
        ),  # one handler: the third adds little
        pytest.param("grpo", signal.SIGHUP, id="grpo-SIGHUP"),
    ],  # a closed terminal or ssh session
)
def test_signal_saves_a_checkpoint_to_resume_from(script, sig, tmp_path, xdg_cache):
    output_dir, log_path = tmp_path / "runs", tmp_path / "stderr.txt"
    small = ["--prompts-per-step", "4", "--max-new-tokens", "4"] + (["--group-size", "2"] if script == "grpo" else [])
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                f"{script}.py",
                "--num-steps",
                "400",
                "--sample-every",
                "0",
                "--output-dir",
                str(output_dir),
                *small,
            ],
            cwd=REPO,
            env=child_env(xdg_cache),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        # tqdm's bar shows "2/400" once two steps are done: the loop is running, the handler installed.
        steps_done = lambda: max(map(int, re.findall(r"(\d+)/400", log_path.read_text())), default=0)
        wait_for(lambda: steps_done() >= 2, "step 2", process)
        process.send_signal(sig)
        stdout, _ = process.communicate(timeout=120)
    stderr = log_path.read_text()
    assert process.returncode != 0, stdout
    assert "Traceback" not in stderr, stderr
    last_line = [line for line in stderr.splitlines() if line.strip()][-1]
    match = re.fullmatch(rf"stopped by {sig.name} after step (\d+); resume with: (.+)", last_line)
    assert match, stderr
    stopped_at, command = int(match[1]), shlex.split(match[2])
    assert command[:2] == ["python", f"{script}.py"] and command[-2] == "--resume", command
    checkpoint = command[-1]
    assert stopped_at >= 2
    assert os.path.isfile(os.path.join(checkpoint, checkpoints.STATE))
    assert checkpoints.read_state(checkpoint)[0]["step"] == stopped_at

    # The printed command resumes it (here to two more steps, not to 400: a later flag overrides an earlier one).
    result = subprocess.run(
        [sys.executable, *command[1:], "--num-steps", str(stopped_at + 2)],
        cwd=REPO,
        env=child_env(xdg_cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"{script} done: {stopped_at + 2} steps" in result.stdout
    run_dir = os.path.dirname(checkpoint)
    assert os.path.isfile(os.path.join(run_dir, "final", "model.safetensors"))


def test_resume_command_repeats_the_flags_but_not_the_old_resume(monkeypatch):
    monkeypatch.setattr(
        sys,
        "argv",
        ["grpo.py", "--learning-rate", "1e-3", "--resume", "old/checkpoint", "--task", "jsonl:my data.jsonl"],
    )
    command = checkpoints.resume_command("grpo", "runs/x/checkpoint")
    assert command == "python grpo.py --learning-rate 1e-3 --task 'jsonl:my data.jsonl' --resume runs/x/checkpoint"
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])  # main() called from Python: no flags to repeat
    assert checkpoints.resume_command("ppo", "c") == "python ppo.py --resume c"


def quick_args(script, tmp_path, **overrides):
    one_update = (
        dict(prompts_per_step=4, group_size=2)
        if script == "grpo"
        else dict(prompts_per_step=4, update_epochs=1, num_minibatches=1)
    )
    fields = dict(seed=1, num_steps=3, max_new_tokens=4, sample_every=0, output_dir=str(tmp_path), **one_update)
    fields.update(overrides)
    return SCRIPTS[script].Args(**fields)


@pytest.mark.parametrize("script", SCRIPTS)
def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(script, tmp_path, monkeypatch):
    calls = []
    clipped_policy_loss = SCRIPTS[script].clipped_policy_loss

    def nan_at_step_2(*args):
        calls.append(1)  # one call per step: one micro-batch, one iteration/epoch/minibatch
        loss = clipped_policy_loss(*args)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(SCRIPTS[script], "clipped_policy_loss", nan_at_step_2)
    args = quick_args(script, tmp_path, save_every=1)
    with pytest.raises(errors.UsageError, match="step 2: the loss is not finite") as error:
        SCRIPTS[script].main(args)
    monkeypatch.undo()
    (run_dir,) = glob.glob(os.path.join(tmp_path, "*"))
    checkpoint, dumped = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "nonfinite_step2.safetensors")
    assert checkpoint in str(error.value) and dumped in str(error.value)

    assert checkpoints.load_checkpoint(checkpoint, script, args)["step"] == 1
    policy = models.load_causal_lm(os.path.join(checkpoint, "policy"), torch.device("cpu"))
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    batch = load_file(dumped)
    assert {"completion_ids", "advantages", "new_logp", "per_token_loss"} <= batch.keys()
    assert torch.isnan(batch["per_token_loss"]).any()
    assert not os.path.exists(os.path.join(run_dir, "final"))


def test_nan_reward_from_a_python_task_stops_the_run(tmp_path):
    reward_file = tmp_path / "nan_reward.py"
    reward_file.write_text(
        'EXAMPLES = [{"prompt": f"{i}=", "answer": str(i)} for i in range(10)]\n\n'
        "def reward(prompt, completion, answer):\n"
        '    return float("nan")\n'
    )
    with pytest.raises(errors.UsageError, match=r"returned nan .* it must return a finite number"):
        grpo.main(quick_args("grpo", tmp_path / "runs", task=f"python:{reward_file}:reward"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_out_of_memory_names_the_flags_to_lower(script, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(common, "token_logprobs", out_of_memory)
    with pytest.raises(SystemExit) as stop:
        bookkeeping.run_main(lambda: SCRIPTS[script].main(quick_args(script, tmp_path)))
    message = str(stop.value.code)
    assert message.startswith("error: out of GPU memory") and "--micro-batch-size" in message


def test_a_signal_whose_exception_loading_swallowed_still_stops_the_run(tmp_path, capsys):
    """Code that swallows every exception while the models load (the one the Ctrl-C handler raises included) cannot
    lose the Ctrl-C: the training loop's handlers raise it again as they take over, and nothing was saved."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def main():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException:  # noqa: S110 (what such code does)
            pass
        checkpoints.StopSignal(str(tmp_path / "checkpoint"))
        raise AssertionError("the run went on")

    try:
        with pytest.raises(SystemExit) as stopped:
            bookkeeping.run_main(main)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stopped.value.code == 128 + signal.SIGINT and not errors.Interrupted.received
    assert capsys.readouterr().err.strip() == "SIGINT before the first step: nothing was saved"
