"""The README's verification snippet runs as printed, on a dump from a real run, for each GRPO variant."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippet():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Verify your implementation against this one", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--beta", "0.1", "--num-iterations", "2"],
        ["--importance-level", "sequence", "--loss-agg", "token-mean", "--num-iterations", "2"],
        ["--bias-corrected-kl", "--beta", "0.1", "--num-iterations", "2"],
    ],
)
def test_readme_verification_snippet_runs_on_a_real_dump(tmp_path, flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    run = [
        sys.executable,
        os.path.join(ROOT, "grpo.py"),
        "--num-steps",
        "1",
        "--prompts-per-step",
        "3",
        "--group-size",
        "4",
        "--dump-dir",
        "dumps",
        "--output-dir",
        "runs",
        "--sample-every",
        "0",
        *flags,
    ]
    subprocess.run(run, cwd=tmp_path, env=env, check=True, capture_output=True)
    (tmp_path / "verify.py").write_text(readme_snippet())
    out = subprocess.run([sys.executable, "verify.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "match to 1e-6" in out.stdout
