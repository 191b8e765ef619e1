"""The README and the docs pages: the verification snippet of docs/verify.md runs as printed, on a dump from a real
run, for each GRPO variant; every relative link of README.md and docs/*.md points at a file (and a heading) that
exists; the README is a newcomer's page, at most 300 lines, whose first two commands are the quick start's."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import doc_figures  # noqa: E402

QUICK_START = [
    "pip install torch==2.13.0 -r requirements.txt && python grpo.py",
    "pip install torch==2.13.0 -r requirements.txt && python -m pytest -q",
]


def read(path):
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def verification_snippet():
    return re.search(r"```python\n(.*?)```", read("docs/verify.md"), flags=re.DOTALL).group(1)


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
    (tmp_path / "verify.py").write_text(verification_snippet())
    out = subprocess.run([sys.executable, "verify.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "match to 1e-6" in out.stdout


def without_code_blocks(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def prose(text):
    """The text without its code blocks and inline code spans, where a link is not a link."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(text):
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces to hyphens, and a
    repeated one numbered -1, -2, ..."""
    seen, result = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code_blocks(text), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        result.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return result


def test_anchors_are_githubs():
    text = '# A real model on this CPU: SmolLM2-135M-Instruct\n## "Done" means it\n## `verify.py`\n## Tasks\n## Tasks\n'
    assert anchors(text) == {"a-real-model-on-this-cpu-smollm2-135m-instruct", "done-means-it", "verifypy", "tasks"} | {
        "tasks-1"
    }


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    pages = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) > 10
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(read(page))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, path)):
                broken.append(f"{page}: {target} (no file {path})")
            elif anchor and path.endswith(".md") and anchor not in anchors(read(path)):
                broken.append(f"{page}: {target} (no heading #{anchor} in {path})")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_starts_with_the_quick_start():
    text = read("README.md")
    assert text.count("\n") <= 300
    blocks = re.findall(r"^```\w*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert commands[:2] == QUICK_START


def test_the_readme_links_every_docs_page():
    text = read("README.md")
    missing = [
        p for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) if f"](docs/{os.path.basename(p)})" not in text
    ]
    assert not missing, missing


def test_the_readme_states_its_share_of_changed_lines_in_the_sentence_the_generator_reads():
    """The README's figures for `diff grpo.py ppo.py` describe the shipped files: benchmarks/doc_figures.py --check
    compares them with the code before a release. Here only that the sentence is there to compare: a fork that
    changes grpo.py changes its own share of lines, not the README's."""
    marked, total, share, main = doc_figures.readme_shares(read("README.md"))
    assert 0 < marked < total and share == round(100 * marked / total) and 0 < main <= 100


def test_the_share_of_changed_lines_counts_what_gnu_diff_marks():
    a = ["def main(x):", "    return x", "", "y = 1", "z = 2"]
    b = ["def main(x):", "    return -x", "", "y = 1", "z = 3"]
    # diff marks 2 lines of each of the two 5-line texts: 4 of 10; of main's 3 lines each, 2 of 6
    assert doc_figures.marked_lines(a, b) == 4 and doc_figures.changed_share(a, b) == 4 / 10
    assert doc_figures.main_lines(a) == ["def main(x):", "    return x", ""]
    assert doc_figures.changed_share(doc_figures.main_lines(a), doc_figures.main_lines(b)) == 2 / 6


def test_the_shares_are_rounded_to_the_nearest_percent(tmp_path):
    """6 of 14 lines changed (42.9%) and, in main, 4 of 6 (66.7%): 43 and 67, not 42 and 66; 2 of 6 (33.3%): 33,
    not 34."""
    texts = {
        "a.py": ["import x", "s0 = 0", "s1 = 0", "def main():", "    p", "    q", "z = 0"],
        "b.py": ["import x", "s0 = 0", "s1 = 0", "def main():", "    r", "    s", "z = 1"],
        "c.py": ["def main():", "    p", "x = 0"],
        "d.py": ["def main():", "    r", "x = 0"],
    }
    for name, lines in texts.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    assert doc_figures.shares(str(tmp_path / "a.py"), str(tmp_path / "b.py"))[2:] == (43, 67)
    assert doc_figures.shares(str(tmp_path / "c.py"), str(tmp_path / "d.py"))[2:] == (33, 50)
    # a moved line: difflib and GNU diff may mark different lines; the count is GNU diff's, `grep -c '^[<>]'`
    a, b = ["x", "y", "z", "w"], ["y", "z", "w", "x"]
    out = subprocess.run(["diff", "-", os.devnull], input="", capture_output=True, text=True)  # diff is there
    assert out.returncode == 0 and doc_figures.marked_lines(a, b) == 2
