"""How the loops use the formulas: the adaptive KL controller as ppo.py feeds it, masking in explained
variance, what charts/learning_rate logs, NaN guards on tensors, and the perf/ timings. Expected values are
computed here, independently of the project's functions."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_explained_variance import printed_lines

import common
import grpo
import ppo
from machinery import bookkeeping, dumps, errors

EOS = 1  # the tiny tokenizer's <eos>


def logged_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


# ---------------------------------------------------------------------------------------------------
# The adaptive KL controller (Ziegler et al. 2019).
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kl, expected",
    [
        (6.6, 0.1 * (1 + 0.1 * 0.5)),
        (5.1, 0.1 * (1 - 0.15 * 0.5)),
        (7.2, 0.1 * (1 + 0.2 * 0.5)),
        (60.0, 0.1 * 1.1),
        (0.0, 0.1 * 0.9),
    ],
)
def test_adaptive_kl_coef_between_its_clips(kl, expected):
    """error = clip(kl / target - 1, -0.2, 0.2); kl_coef * (1 + error * n / horizon), with n / horizon = 0.5 so
    a wrong clip bound, a sign or an inverted ratio shows. Guards the proportional part, not only the clips."""
    kl_coef = ppo.adaptive_kl_coef(0.1, kl=kl, target_kl=6.0, n_completions=50, horizon=100)
    assert kl_coef == pytest.approx(expected, rel=1e-9)


def test_next_kl_coef_under_torchrun_is_every_processs_and_the_same_on_each():
    """Two processes of 3 completions each, their KLs far apart: given the gather of both, each process's next
    coefficient is that of the 6 completions at once (mean KL and count), so the two stay equal; one process's
    own 3 would move its coefficient elsewhere."""
    g = torch.Generator().manual_seed(0)
    args = ppo.Args(target_kl=2.0, kl_horizon=12)

    def process_batch(shift):
        old = torch.randn(3, 4, generator=g)
        mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
        return dict(old_logp=old, ref_logp=old - shift, completion_mask=mask, kl_coef=torch.tensor(0.1))

    batches = [process_batch(0.2), process_batch(1.5)]  # summed KL 0.2 and 1.5 per token
    sums = [(b["old_logp"] - b["ref_logp"]) * b["completion_mask"] for b in batches]
    both = torch.cat([s.sum(1) for s in sums])  # [6], in rank order
    expected = 0.1 * (1 + min(max(both.mean().item() / 2.0 - 1, -0.2), 0.2) * 6 / 12)
    sent = []  # what each process hands the gather: its own completions' summed KL
    alone = [ppo.next_kl_coef(b, args, gather=lambda x: sent.append(x) or x) for b in batches]
    assert torch.allclose(torch.cat(sent), both)
    gathered = [ppo.next_kl_coef(b, args, gather=lambda x: torch.cat(sent)) for b in batches]
    assert gathered[0] == gathered[1] == pytest.approx(expected, rel=1e-6)
    assert alone[0] != pytest.approx(alone[1], rel=1e-3) and all(a != pytest.approx(expected, rel=1e-3) for a in alone)


def test_ppo_loop_hands_the_controller_every_processs_completions(tmp_path, monkeypatch):
    """The loop gives next_kl_coef the gather over the processes: with a gather that adds a second process's 8
    completions (here a copy of this one's), step 1's clipped error of -0.2 moves the coefficient by 16 / 16 of it,
    not by this process's 8 / 16."""
    from machinery import distributed as dist

    monkeypatch.setattr(
        dist, "gather", lambda *xs: tuple(torch.cat([x, x]) for x in xs) if len(xs) > 1 else torch.cat([xs[0]] * 2)
    )
    flags = dict(num_steps=2, prompts_per_step=4, samples_per_prompt=2, max_new_tokens=4, update_epochs=1)
    flags.update(kl_coef=0.05, target_kl=1.0, kl_horizon=16, sample_every=0, dump_dir=str(tmp_path / "dump"))
    ppo.main(ppo.Args(**flags, output_dir=str(tmp_path / "runs")))
    step2 = load_file(str(tmp_path / "dump" / "step000002.safetensors"))
    assert step2["kl_coef"].item() == pytest.approx(0.05 * (1 - 0.2 * 16 / 16), rel=1e-6)


def first_eos_lengths(completion_ids):
    lengths = []
    for row in completion_ids.tolist():
        lengths.append(row.index(EOS) + 1 if EOS in row else len(row))
    return lengths


def summed_kl_per_completion(d):
    """k1 of the rollout's log-probs against the reference's (what the controller tracks, whatever estimator the
    penalty uses: k3 here), summed over each completion's real tokens, averaged."""
    sums = []
    for old, ref, n in zip(d["old_logp"].tolist(), d["ref_logp"].tolist(), first_eos_lengths(d["completion_ids"])):
        sums.append(sum(o - r for o, r in zip(old[:n], ref[:n])))
    return sum(sums) / len(sums)


def run_ppo_with_target(tmp_path, target_kl):
    fields = dict(
        seed=3,
        num_steps=3,
        prompts_per_step=4,
        samples_per_prompt=2,
        max_new_tokens=6,
        learning_rate=3e-2,
        kl_coef=0.05,
        kl_estimator="k3",
        target_kl=target_kl,
        kl_horizon=20,
        num_minibatches=2,
        sample_every=1,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    ppo.main(ppo.Args(**fields))
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    dumps = [load_file(str(tmp_path / "dump" / f"step{s:06d}.safetensors")) for s in (1, 2, 3)]
    return dumps, logged_scalars(run_dir)


def test_ppo_loop_feeds_the_kl_controller(tmp_path, capsys):
    """Each step's kl_coef is the controller's update from the previous step, fed the summed KL per completion
    (not the per-token mean) and the number of completions (8 = 4 prompts x 2, not the 4 prompts), compounding
    step after step; the coefficient in use is the one logged and dumped. Step 1's KL is 0 (the policy is the
    reference), so the error is clipped there; a second run sets the target just under step 2's KL, so step 3
    sees an error of +0.1, inside the clip. Guards a coefficient that is not stored back, restarts from
    --kl-coef, or is fed the wrong KL or count."""
    dumps, scalars = run_ppo_with_target(tmp_path / "a", target_kl=1.0)
    kl_2 = summed_kl_per_completion(dumps[1])
    assert summed_kl_per_completion(dumps[0]) == pytest.approx(0.0, abs=1e-6)
    assert kl_2 > 0.05, "the policy must have moved away from the reference by step 2"

    target = kl_2 / 1.1  # error at step 2: 1.1 - 1 = 0.1
    capsys.readouterr()
    dumps, scalars = run_ppo_with_target(tmp_path / "b", target_kl=target)
    # --sample-every prints the first completion of each of the first 3 prompts (rows 0, 2, 4: 2 samples a prompt)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert printed == [line for step, d in enumerate(dumps, 1) for line in printed_lines(d, step, [0, 2, 4], "scores")]
    assert summed_kl_per_completion(dumps[1]) == pytest.approx(kl_2, rel=1e-5)  # the same trajectory up to step 2
    expected = [0.05]
    for d in dumps[:2]:
        error = min(max(summed_kl_per_completion(d) / target - 1, -0.2), 0.2)
        expected.append(expected[-1] * (1 + error * 8 / 20))
    assert expected[2] == pytest.approx(0.05 * (1 - 0.2 * 0.4) * (1 + 0.1 * 0.4), rel=1e-4)
    for step, d in enumerate(dumps, 1):
        assert d["kl_coef"].item() == pytest.approx(expected[step - 1], rel=1e-5), f"kl_coef in use at step {step}"
        assert scalars["charts/kl_coef"][step] == pytest.approx(expected[step - 1], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Masking in the logged statistics.
# ---------------------------------------------------------------------------------------------------


def explained_variance_by_hand(values, returns, lengths):
    v = [x for row, n in zip(values, lengths) for x in row[:n]]
    r = [x for row, n in zip(returns, lengths) for x in row[:n]]

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    return 1 - var([a - b for a, b in zip(r, v)]) / var(r)


@pytest.mark.parametrize("padding", ["zeros", "garbage"])
def test_explained_variance_counts_real_tokens_only(padding):
    """Ragged rows, as the loop passes them: values and returns are 0 after each row's end (or anything).
    Counting the padding as data pulls both variances towards it; the expected value is taken over real tokens.
    Guards a mean or variance over every position instead of the masked ones."""
    lengths = [4, 2, 1, 3]
    values = [[0.5, 1.0, 1.5, 1.8], [2.0, 2.5, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [1.0, 0.7, 0.9, 0.0]]
    returns = [[0.8, 1.1, 1.2, 2.0], [2.6, 2.9, 0.0, 0.0], [2.5, 0.0, 0.0, 0.0], [1.3, 0.2, 1.0, 0.0]]
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    fill = 0.0 if padding == "zeros" else 37.0
    v = torch.where(mask.bool(), torch.tensor(values), torch.full((4, 4), fill))
    r = torch.where(mask.bool(), torch.tensor(returns), torch.full((4, 4), -fill))
    expected = explained_variance_by_hand(values, returns, lengths)
    assert common.explained_variance(v, r, mask).item() == pytest.approx(expected, rel=1e-5)
    # The check can fail: over every position (padding counted) the answer is another one.
    every = explained_variance_by_hand(v.tolist(), r.tolist(), [4] * 4)
    assert abs(every - expected) > 0.05


# ---------------------------------------------------------------------------------------------------
# charts/learning_rate is the rate of the step it is logged at.
# ---------------------------------------------------------------------------------------------------

SCRIPTS = {"grpo": grpo, "ppo": ppo}
QUICK = {
    "grpo": dict(prompts_per_step=2, group_size=3, max_new_tokens=4),
    "ppo": dict(prompts_per_step=4, max_new_tokens=4, num_minibatches=1),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_logged_learning_rate_is_the_one_the_step_used(script, tmp_path, monkeypatch):
    """With --warmup-steps 3 the rate of step s is lr * s / 4. The rate each optimizer step used is read from
    the optimizer at the step itself (a spy on AdamW.step); charts/learning_rate at step s must be that one."""
    used = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    args = SCRIPTS[script].Args(
        seed=1,
        num_steps=3,
        learning_rate=1e-3,
        warmup_steps=3,
        sample_every=0,
        output_dir=str(tmp_path),
        **QUICK[script],
    )
    SCRIPTS[script].main(args)
    per_step = len(used) // 3
    assert used[::per_step] == pytest.approx([1e-3 * s / 4 for s in (1, 2, 3)])  # what the updates used
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    logged = logged_scalars(run_dir)["charts/learning_rate"]
    assert [logged[s] for s in (1, 2, 3)] == pytest.approx([1e-3 * s / 4 for s in (1, 2, 3)], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Guards and timings in bookkeeping.py.
# ---------------------------------------------------------------------------------------------------


def test_one_nan_in_a_tensor_stops_the_run(tmp_path):
    """A reward tensor with a single NaN among finite values stops the run and is dumped; a finite one passes.
    Guards a check that asks whether any value is finite instead of all (one NaN row would train on)."""
    rewards = torch.tensor([0.5, float("nan"), 1.0])
    with pytest.raises(errors.UsageError, match=r"step 3: the reward is not finite.*no checkpoint was saved yet"):
        dumps.check_finite(3, "reward", rewards, str(tmp_path), {"rewards": rewards})
    dumped = load_file(str(tmp_path / "nonfinite_step3.safetensors"))["rewards"]
    assert torch.equal(dumped.isnan(), rewards.isnan()) and dumped[0] == 0.5
    dumps.check_finite(4, "reward", torch.tensor([0.5, 1.0]), str(tmp_path), {})
    assert not os.path.exists(tmp_path / "nonfinite_step4.safetensors")


class FakeWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)


def test_perf_seconds_are_cumulative_per_phase_and_tokens_per_second_over_both(monkeypatch):
    """perf/rollout_seconds and perf/train_seconds add up each phase's wall time over the run (docs/logs.md's
    "cumulative"); perf/tokens_per_second divides the tokens by the time of both phases. Guards a timer that
    keeps only the last interval, swapped phases, or a rate over one phase."""
    import time

    clock = iter([0.0, 2.0, 2.0, 5.0, 5.0, 6.5, 10.0, 10.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    timer = bookkeeping.Timer()
    for phase in ("rollout", "train", "rollout", "train"):
        with timer(phase):
            pass
    scalars = bookkeeping.perf_scalars(timer, 1200, torch.device("cpu"))
    assert scalars["perf/rollout_seconds"] == pytest.approx(3.5)
    assert scalars["perf/train_seconds"] == pytest.approx(3.5)
    assert scalars["perf/tokens_per_second"] == pytest.approx(1200 / 7)
    assert scalars["perf/peak_memory_gb"] > 0


def test_dump_metadata_holds_the_resolved_args(tmp_path):
    """metadata.json holds the Args as the run used them (the preset applied), so a verifier needs nothing else."""
    grpo.main(
        grpo.Args(
            seed=1,
            num_steps=1,
            sample_every=0,
            output_dir=str(tmp_path / "runs"),
            dump_dir=str(tmp_path / "d"),
            **QUICK["grpo"],
        )
    )
    meta = json.load(open(tmp_path / "d" / "metadata.json"))
    assert meta["script"] == "grpo"
    assert meta["args"]["beta"] == grpo.Args.beta and meta["args"]["group_size"] == 3
    assert meta["args"]["learning_rate"] == grpo.Args.learning_rate


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the kernel's VmHWM (Linux)")
def test_peak_memory_on_cpu_is_the_resident_peak_in_gib():
    """perf/peak_memory_gb on a CPU is the process's peak resident memory in GiB, the kernel's VmHWM.
    Guards a unit slip (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    import re

    with open("/proc/self/status") as f:
        hwm_kib = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))
    assert bookkeeping.peak_memory_gb(torch.device("cpu")) == pytest.approx(hwm_kib / 2**20, rel=0.05)


def test_summary_line_reports_the_first_5_and_last_10_percent(capsys):
    """The closing line is the benchmark of docs/benchmarks.md: the mean score over the first 5% and the last 10% of
    the steps (2 and 4 of 40 here). Guards an off-by-one or a wrong share in those windows."""
    import re

    scores = [0.01 * i for i in range(40)]
    bookkeeping.print_summary("grpo", {"score": scores, "length": [3.0] * 40}, 12.0, torch.device("cpu"), "final")
    first, last = re.search(r"first 5% ([\d.]+) -> last 10% ([\d.]+)", capsys.readouterr().out).groups()
    assert float(first) == pytest.approx((0.00 + 0.01) / 2, abs=5e-4)
    assert float(last) == pytest.approx((0.36 + 0.37 + 0.38 + 0.39) / 4, abs=5e-4)
