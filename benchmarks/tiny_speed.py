"""The built-in tiny model's GRPO step: grpo.py against TRL 1.16's GRPOTrainer on the same work, side by side.

    python benchmarks/tiny_speed.py                    # 100 steps each, 3 rounds, interleaved
    python benchmarks/tiny_speed.py --steps 50 --rounds 1

Both train `tiny` on `copy` with grpo.py's defaults (16 prompts x 8 completions of up to 5 tokens, temperature 1,
rewards scaled by the batch's std, the bias-corrected k3 term at beta 0.08, seq-mean-token-mean, AdamW at 5e-4),
the same prompts in the same order (benchmarks/real_model.py's run_trl), each in its own process, on the threads
torch picks (`--threads` of grpo.py is left at auto; on an idle machine both take torch's default). A step's
seconds: grpo.py's perf/rollout_seconds + perf/train_seconds (the loop, logging included), TRL's between its
on_step_end callbacks; the first step of each run (warm-up) is left out, and the table gives the median over
the rounds. Each run's mean score over its last 10 steps is printed beside, as a check that both learn alike.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_ours(steps, work):
    """grpo.py's default run on tiny in a subprocess: {s_per_step, score}."""
    import real_model

    out = os.path.join(work, "ours")
    command = [sys.executable, "grpo.py", f"--num-steps={steps}", "--sample-every=0", f"--output-dir={out}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"grpo.py failed:\n{result.stderr[-3000:]}")
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    summary = real_model.summarise_ours(real_model.read_scalars(run_dir))
    return dict(s_per_step=summary["s_per_step"], score=summary["score"])


def run_trl(steps, work):
    """TRL's GRPOTrainer on the same work, in a subprocess: {s_per_step, score}."""
    command = [sys.executable, __file__, "--trl-once", "--steps", str(steps), "--work", work]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"TRL's run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def trl_once(steps, work):
    import real_model

    import grpo
    from machinery import models
    from machinery.tiny_model import TINY_MODEL

    flags = vars(grpo.Args())
    model_dir = models.resolve_model_path(TINY_MODEL)
    _, trl, _ = real_model.run_trl(
        model_dir, flags["seed"], steps, work, task_name=flags["task"], flags=flags, chat=False
    )
    print(json.dumps(dict(s_per_step=trl["s_per_step"], score=trl["score"])))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trl-once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.trl_once:
        return trl_once(a.steps, a.work)
    runs = {"grpo.py": [], "TRL": []}
    with tempfile.TemporaryDirectory() as work:
        for i in range(a.rounds):
            for name, fn in (("grpo.py", run_ours), ("TRL", run_trl)):
                r = fn(a.steps, os.path.join(work, f"{name}-{i}"))
                runs[name].append(r)
                last = r["score"][-10:]
                print(
                    f"round {i + 1}, {name}: {r['s_per_step'] * 1000:.1f} ms/step, last-10 score "
                    f"{sum(last) / len(last):.3f}",
                    flush=True,
                )
    ours, trl = (statistics.median(r["s_per_step"] for r in runs[n]) for n in ("grpo.py", "TRL"))
    print(f"\n`tiny`, `copy`, grpo.py's defaults, {a.steps} steps, median of {a.rounds} rounds (steps 2-{a.steps})\n")
    print("| | grpo.py | TRL GRPOTrainer | grpo.py / TRL |\n|---|---|---|---|")
    print(f"| ms per step | {ours * 1000:.1f} | {trl * 1000:.1f} | {ours / trl:.2f}x |")


if __name__ == "__main__":
    main()
