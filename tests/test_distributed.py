"""Under torchrun (distributed.py, FSDP2, gloo on CPU, 2 processes): one update on 2 processes is the update on 1,
both scripts learn, stop together on a signal to one process and resume exactly, and bad launches get one line."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
from safetensors.torch import load_file

import grpo
import ppo
from machinery import checkpoints, dumps, generation, models, prompt_cache
from machinery import distributed as dist
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = """EXAMPLES = [{"prompt": f"{i:03d}=", "answer": "7"} for i in range(200)]


def reward(prompt, completion, answer):
    return sum(c in "0123456789" for c in completion) / 5
"""  # a reward the tiny model learns in ~10 steps (one process, lr 5e-3: GRPO 0.54 over steps 1-5, 0.90 over 6-10)


@pytest.fixture
def digits_task(tmp_path):
    path = tmp_path / "digits.py"
    path.write_text(DIGITS)
    return f"python:{path}:reward"


# ---------------------------------------------------------------------------------------------------
# Bad launches: checked from torchrun's WORLD_SIZE before the processes join, printed once.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (grpo, dict(prompts_per_step=1), "--prompts-per-step 1 leaves some of the 2 processes without a prompt"),
        (grpo, dict(prompts_per_step=3), "--prompts-per-step 3 on 2 processes would split a group (--group-size 8)"),
        (grpo, dict(prompts_per_step=3, group_size=3), "--prompts-per-step 3 (9 completions) does not divide across 2"),
        (ppo, dict(prompts_per_step=3), "--prompts-per-step 3 (3 completions) does not divide across 2 processes"),
        (ppo, dict(prompts_per_step=6, num_minibatches=2), "does not divide the batch of 3 completions per process"),
        (grpo, dict(prompts_per_step=4, dump_dir="d"), "--dump-dir writes one process's batch, and this launch has 2"),
        (
            ppo,
            dict(seed=2**32 - 1),
            "--seed is 4294967295: it must be in [0, 4294967294] (each of the 2 processes seeds",
        ),
    ],
)
def test_bad_launch_is_refused_in_one_line(monkeypatch, script, flags, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError) as error:
        script.check_args(script.Args(**flags))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_launch_number_is_bounded_by_the_most_processes_a_launch_holds():
    """Each of torchrun's numbers is read as ASCII digits, then bounded: a launch of MAX_PROCESSES passes (its last
    rank too), one more process is refused as too large, not as "not a whole number", and so is a 10-digit number
    (whatever the variable, a size or a rank); a digit int() refuses ('²') is not a whole number."""
    launch = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    most = dist.MAX_PROCESSES
    dist.check_environment(dict(launch, WORLD_SIZE=str(most), RANK=str(most - 1), LOCAL_RANK="0"))
    for name, value in [("WORLD_SIZE", str(most + 1)), ("LOCAL_WORLD_SIZE", "1000000000"), ("RANK", "0000000001")]:
        environ = {**launch, "WORLD_SIZE": "2", name: value}
        with pytest.raises(UsageError, match=f"{name} is {value}: more processes than a launch holds"):
            dist.check_environment(environ)
    with pytest.raises(UsageError, match="WORLD_SIZE is '²': torchrun sets it to a whole number"):
        dist.check_environment(dict(launch, WORLD_SIZE="²"))


def test_a_launch_is_checked_in_both_directions():
    """A size of 1 passes and 0 does not; a rank one below its size passes and the size itself does not; a node as
    large as the launch passes and a larger one does not."""
    launch = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="4")
    dist.check_environment(dict(launch, RANK="3", LOCAL_WORLD_SIZE="4", LOCAL_RANK="3"))
    dist.check_environment(dict(WORLD_SIZE="1", RANK="0"))
    for environ, message in [
        (dict(launch, WORLD_SIZE="0"), "WORLD_SIZE is 0: a launch has at least 1 process"),
        (dict(launch, RANK="4"), "RANK is 4, not below WORLD_SIZE 4"),
        (dict(launch, LOCAL_WORLD_SIZE="2", LOCAL_RANK="2"), "LOCAL_RANK is 2, not below LOCAL_WORLD_SIZE 2"),
        (dict(launch, LOCAL_WORLD_SIZE="5"), "LOCAL_WORLD_SIZE 5 is more than WORLD_SIZE 4"),
    ]:
        with pytest.raises(UsageError, match=message):
            dist.check_environment(environ)


def torchrun(*argv, timeout=300, **popen):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, text=True, **popen)
    return subprocess.run(command, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_bad_launch_under_torchrun_prints_its_line_once():
    run = torchrun("grpo.py", "--prompts-per-step", "3")
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert ours == [
        "error: --prompts-per-step 3 on 2 processes would split a group (--group-size 8) across processes: "
        "make --prompts-per-step a multiple of 2"
    ], run.stderr


# ---------------------------------------------------------------------------------------------------
# Equivalence: the same prompts and completions give the same losses and updated weights on 2 processes as on 1.
# ---------------------------------------------------------------------------------------------------


def fixed_generate(model, tokenizer, prompts, max_new_tokens, temperature, eos_ids, greedy=False, chat_template=True):
    """Completions drawn from each prompt's own seed (the j-th copy of a prompt: its j-th draw), so a prompt gets
    the same completions on whichever process it lands. Some end with EOS, some do not."""
    enc = generation.encode_prompts(tokenizer, prompts, chat_template)
    rows, copies = [], {}
    for prompt in prompts:
        copies[prompt] = copies.get(prompt, -1) + 1
        generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()) * 64 + copies[prompt])
        ids = torch.randint(3, 25, (max_new_tokens,), generator=generator)  # characters: digits and signs
        length = int(torch.randint(1, max_new_tokens + 2, (), generator=generator))  # max_new_tokens + 1: no EOS
        if length <= max_new_tokens:
            ids[length - 1], ids[length:] = eos_ids[0], tokenizer.pad_token_id
        rows.append(ids)
    completion_ids = torch.stack(rows)
    return enc["input_ids"], enc["attention_mask"], completion_ids, generation.mask_after_eos(completion_ids, eos_ids)


GRPO_CONFIGS = [dict(scale_rewards="batch", loss_agg=agg) for agg in grpo.LOSS_AGGREGATIONS] + [
    dict(scale_rewards="group", num_iterations=2),
    dict(scale_rewards="none", importance_level="sequence"),
]
PPO_CONFIGS = [dict(num_steps=2, target_kl=0.1, kl_horizon=10)]  # the controller moves kl_coef by N / horizon
BASE = dict(
    # 3 prompts a process (not as many as the 2 processes), in groups of 4, micro-batches of 5 (uneven: 5, 5, 2)
    grpo=dict(num_steps=1, prompts_per_step=6, group_size=4, micro_batch_size=5),
    ppo=dict(num_steps=1, prompts_per_step=8, num_minibatches=2, update_epochs=2, micro_batch_size=2),
)


def one_process_minibatches(num_minibatches, world=2):
    """randperm for one process whose minibatches are the union of `world` processes' ones (each shuffling its
    slice of the batch in reverse); the processes' randperm is then reversed(range(n))."""

    def randperm(n, **kwargs):
        share = n // world
        size = share // num_minibatches
        local = torch.arange(share).flip(0)
        return torch.cat(
            [r * share + local[k * size : (k + 1) * size] for k in range(num_minibatches) for r in range(world)]
        )

    return randperm


def run_updates(script, task, configs, out_dir, patch=setattr):
    """Run each config with the fixed completions; save each optimizer step's loss (this process's share) and
    gradient norm (the whole batch's, before clipping)."""
    module = {"grpo": grpo, "ppo": ppo}[script]
    losses, check = [], dumps.stop_if_not_finite

    def record(step, run_dir, dump, reward, micro_terms, gradient):
        losses.append([sum(terms["loss"].item() for terms in micro_terms), dist.local(gradient).item()])
        check(step, run_dir, dump, reward, micro_terms, gradient)

    patch(generation, "generate", fixed_generate)
    patch(dumps, "stop_if_not_finite", record)
    # Each row's prompt computed on its own, on one process as on two: under FSDP the update cannot share it
    # (prompt_cache.is_sharded), and sharing adds in another order (~1e-7), which Adam's first steps magnify.
    patch(prompt_cache, "prompt_runs", lambda ids, mask: (torch.arange(len(ids)),) * 2)
    results = []
    for i, config in enumerate(configs):
        settings = dict(BASE[script], **config)
        if script == "ppo":
            randperm = lambda n, **k: torch.arange(n).flip(0)
            patch(
                torch,
                "randperm",
                randperm if dist.world_size() > 1 else one_process_minibatches(settings["num_minibatches"]),
            )
        losses.clear()
        module.main(module.Args(task=task, sample_every=0, learning_rate=5e-3, output_dir=f"{out_dir}/{i}", **settings))
        results.append(list(losses))
    torch.save(results, f"{out_dir}/losses_rank{dist.rank()}.pt")


def _process(rank, port, script, task, configs, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    run_updates(script, task, configs, out_dir)
    torch.distributed.destroy_process_group()


def final_weights(run_root):
    (run,) = os.listdir(run_root)
    weights = {}
    for folder in ("final", "critic"):
        for name in ("model.safetensors", "value_head.safetensors"):
            path = os.path.join(run_root, run, folder, name)
            if os.path.isfile(path):
                weights.update({f"{folder}/{name}/{k}": v for k, v in load_file(path).items()})
    return weights


@pytest.mark.exact
@pytest.mark.slow
@pytest.mark.parametrize("script, configs", [("grpo", GRPO_CONFIGS), ("ppo", PPO_CONFIGS)])
def test_two_processes_update_as_one(tmp_path, monkeypatch, digits_task, script, configs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    initial = load_file(os.path.join(models.resolve_model_path(TINY_MODEL), "model.safetensors"))  # built once
    torch.multiprocessing.spawn(_process, args=(port, script, digits_task, configs, str(tmp_path / "two")), nprocs=2)
    run_updates(script, digits_task, configs, str(tmp_path / "one"), monkeypatch.setattr)

    one = torch.load(tmp_path / "one" / "losses_rank0.pt")
    two = [torch.load(tmp_path / "two" / f"losses_rank{r}.pt") for r in range(2)]
    for i, config in enumerate(configs):
        # Per optimizer step: the loss (each process's is its share of the batch's: summed) and the gradient norm
        # (the same on both processes). Adam's step hardly depends on the gradient's scale: the norm checks it.
        (loss0, norm0), (loss1, norm1), (loss, norm) = (torch.tensor(r[i]).T for r in (*two, one))
        assert len(loss) > 0 and len(loss0) == len(loss)
        torch.testing.assert_close(loss0 + loss1, loss, rtol=1e-5, atol=1e-7, msg=str(config))
        torch.testing.assert_close(norm0, norm, rtol=1e-5, atol=0, msg=str(config))
        assert torch.equal(norm0, norm1)
        w1, w2 = final_weights(tmp_path / "one" / str(i)), final_weights(tmp_path / "two" / str(i))
        assert w1.keys() == w2.keys()
        moved = max((w1[k] - initial[k.split("/")[-1]]).abs().max().item() for k in w1 if k.startswith("final/"))
        assert moved > 1e-3, "the update did not move the policy: the comparison would prove nothing"
        # Relative to the norms, not element by element: Adam's first step moves an element by lr * g / (|g| + eps),
        # so an element whose gradient is ~1e-9 (where the order of the sums decides its digits) may move ~1e-6 apart
        # alone (measured: 1 element in 49152). The keys' bias is left out tensor by tensor: its gradient is nearly 0
        # (it shifts all of a query's scores alike, but for RoPE's rotation), so its steps are mostly rounding
        # (measured 1.4e-4 apart, relative).
        difference = torch.cat([(w2[key] - w1[key]).flatten() for key in w1]).norm()
        assert difference <= 1e-5 * torch.cat([w.flatten() for w in w1.values()]).norm(), config
        for key in [key for key in w1 if not key.endswith("k_proj.bias")]:
            assert (w2[key] - w1[key]).norm() <= 1e-5 * w1[key].norm(), (key, config)


# ---------------------------------------------------------------------------------------------------
# End to end under torchrun: learning, a signal to one process, resuming exactly.
# ---------------------------------------------------------------------------------------------------


def scores(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars("charts/score")]


def only_run(root):
    (run,) = os.listdir(root)
    return os.path.join(root, run)


def rank_pid(launcher, rank):
    """The pid of the torchrun worker of this rank (a child of the launcher)."""
    for _ in range(600):
        for task in os.listdir(f"/proc/{launcher.pid}/task"):
            with open(f"/proc/{launcher.pid}/task/{task}/children") as f:
                for pid in f.read().split():
                    with open(f"/proc/{pid}/environ", "rb") as env:
                        if f"RANK={rank}".encode() in env.read().split(b"\0"):
                            return int(pid)
        time.sleep(0.1)
    raise AssertionError("no worker of that rank")


def learns_then_resumes_exactly(tmp_path, flags, finals):
    """12 steps under torchrun with a checkpoint at step 8: the score rises; resumed from step 8 (the first run's
    `finals` folders moved aside), the run ends with the same weights and the same scores."""
    run = torchrun(*flags, "--output-dir", str(tmp_path / "a"), "--save-every", "8")
    assert run.returncode == 0, run.stderr[-3000:]
    a = only_run(tmp_path / "a")
    score = scores(a)
    assert len(score) == 12 and sum(score[-3:]) / 3 > sum(score[:3]) / 3 + 0.25, score
    straight = final_weights(tmp_path / "a")
    for name in finals:
        os.rename(os.path.join(a, name), os.path.join(tmp_path, name))

    run = torchrun(*flags, "--resume", os.path.join(a, "checkpoint"))
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = final_weights(tmp_path / "a")
    assert resumed.keys() == straight.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key
    assert scores(a) == score


GRPO_FLAGS = ["grpo.py", "--num-steps", "12", "--prompts-per-step", "4", "--group-size", "4", "--learning-rate", "5e-3"]


@pytest.mark.slow
def test_grpo_under_torchrun_learns_and_resumes(tmp_path, digits_task):
    flags = [*GRPO_FLAGS, "--task", digits_task, "--sample-every", "0"]
    learns_then_resumes_exactly(tmp_path, flags, ["final"])


@pytest.mark.slow
def test_a_signal_to_one_process_stops_all_at_the_same_step(tmp_path, digits_task):
    """The processes vote on stopping after each step: a signal that reaches one of them just after the vote is
    acted on at the next one, by all, never by that process alone (it would wait forever for the others)."""
    with open(tmp_path / "stderr.txt", "w+") as err:  # a file, not a pipe that could fill while stdout is read
        launcher = torchrun(
            *GRPO_FLAGS,
            "--task",
            digits_task,
            "--sample-every",
            "1",
            "--output-dir",
            str(tmp_path / "runs"),
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
        workers = [rank_pid(launcher, rank) for rank in (0, 1)]  # torchrun starts them outside its process group

        def kill_all():
            for pid in (launcher.pid, *workers):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        watchdog = threading.Timer(600, kill_all)  # a hang fails this test, never the whole suite
        watchdog.start()
        try:
            for line in launcher.stdout:
                if line.startswith("step 3 |"):  # rank 0 printed step 3: SIGTERM to rank 1 alone
                    os.kill(workers[1], signal.SIGTERM)
                    break
            launcher.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            kill_all()
            launcher.communicate()
            raise AssertionError("the processes did not stop within 120 s of the signal") from None
        finally:
            watchdog.cancel()
        err.seek(0)
        stderr = err.read()
    assert launcher.returncode != 0 and "stopped by a signal to another process after step" in stderr, stderr[-3000:]
    step = checkpoints.read_state(os.path.join(only_run(tmp_path / "runs"), "checkpoint"))[0]["step"]
    assert 3 <= step < 12
    assert f"stopped by a signal to another process after step {step}; resume with: torchrun" in stderr


@pytest.mark.slow
def test_ppo_under_torchrun_learns_and_resumes(tmp_path, digits_task):
    flags = [
        "ppo.py",
        "--task",
        digits_task,
        "--num-steps",
        "12",
        "--prompts-per-step",
        "8",
        "--learning-rate",
        "5e-3",
        "--sample-every",
        "0",
        "--target-kl",
        "0.1",
    ]
    learns_then_resumes_exactly(tmp_path, flags, ["final", "critic"])
