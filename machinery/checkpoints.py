"""What a run writes to disk, and reads back: the final models, checkpoints and resuming from them, and the
guard that stops a run cleanly on a signal (it saves a checkpoint). Batch dumps and the NaN stop: dumps.py.

Nothing here changes what a run computes; a resumed run is the uninterrupted one, bit for bit on CPU.
Under torchrun every process calls these alike: the shards are gathered and rank 0 alone writes, in the same
format as one process (distributed.py); a checkpoint resumes with the number of processes that wrote it.
"""

import dataclasses
import fcntl
import json
import math
import os
import random
import shlex
import shutil
import signal
import sys

import numpy as np
import torch
from safetensors import SafetensorError

from machinery import distributed as dist
from machinery.errors import Interrupted, UsageError, shorten

# Args that may differ between a checkpoint and the run resuming it: they do not change the trajectory.
RESUMABLE_CHANGES = {
    "num_steps",
    "resume",
    "save_every",
    "sample_every",
    "eval_every",
    "dump_dir",
    "output_dir",
    "lora_merged",
    "threads",
}
# A branch (--resume into another --output-dir: a new run folder, the checkpoint's left as it is) may change every
# other flag too, a variant's switched on: these fix what the checkpoint holds, the models and their shapes, the data
# and its seed, and what the restored optimizer, schedule and KL controller carry (a new value there would be
# overwritten by the checkpoint's, silently). --vf-coef may change, but not between 0 (no critic) and above.
BRANCH_FIXED = set(
    "model task seed critic_model lora_rank lora_alpha lora_dropout lora_target_modules "
    "learning_rate critic_learning_rate weight_decay decay_norms_and_biases warmup_steps kl_coef".split()
)


def branches(args):
    """Whether --resume continues into a new run folder under --output-dir (a branch) rather than in the checkpoint's
    own run folder: an --output-dir given, other than the one holding that run folder."""
    if not args.resume:
        return False
    default = next(field.default for field in dataclasses.fields(args) if field.name == "output_dir")
    run_parent = os.path.dirname(os.path.dirname(os.path.abspath(args.resume)))
    return args.output_dir != default and os.path.abspath(args.output_dir) != run_parent


def start_branch(checkpoint, run_dir):
    """A branch's new run folder starts with the TensorBoard events of the run it branches from (its writer purges
    the steps after the checkpoint), so its curves are whole, and branched_from.json naming the checkpoint. The
    checkpoint's own run folder is only read."""
    source = os.path.dirname(os.path.abspath(checkpoint))
    for name in sorted(os.listdir(source)):
        if name.startswith("events.out.tfevents.") and os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(run_dir, name))
    with open(os.path.join(run_dir, "branched_from.json"), "w", encoding="utf-8") as f:
        json.dump({"checkpoint": os.path.abspath(checkpoint)}, f)


# Bump when what a checkpoint holds changes: a checkpoint of another version is refused, not misread.
# 2: state.pt lists its files and keys, and the training data's fingerprint (version 1 had no number).
CHECKPOINT_VERSION = 2
HASHED_BYTES = 64 * 2**20  # files up to this size (configs, tokenizers, small weights) are hashed in full


def _swap_into_place(tmp, folder):
    """Replace `folder` by the finished `tmp`: at every moment one complete copy exists on disk (after a kill
    between the two renames, as folder.old and folder.tmp: find_checkpoint takes the newer complete one)."""
    old = f"{folder}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(folder):
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


# How a failed write (disk full, quota, read-only) reaches us: torch.save raises RuntimeError, safetensors its own.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failed(what, folder, error):
    """A save that could not be written (disk full, read-only, quota): one line naming what is still good."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip().splitlines()[0]
    fix = "free some disk space" if any(word in reason.lower() for word in ("space", "full", "quota")) else "fix that"
    if os.path.isfile(os.path.join(folder, "state.pt")):
        return UsageError(
            f"could not write {what} ({reason}); the last good checkpoint is {folder}: {fix}, then resume from it"
        )
    return UsageError(f"could not write {what} ({reason}); no checkpoint was saved before: {fix} and start again")


def check_weights_finite(models, folder):
    """Never save weights that an update made NaN or inf: the copy already on disk stays the last good one."""
    for name, model in models.items():
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # torchrun: this one's
        if dist.any(not all(torch.isfinite(p).all() for p in shards)):
            checkpoint = os.path.join(os.path.dirname(folder), "checkpoint")
            last = (
                f"the last good checkpoint is {checkpoint}" if os.path.isdir(checkpoint) else "no checkpoint was saved"
            )
            raise UsageError(
                f"the {name}'s weights are not finite after the last update, so {folder} was not "
                f"written ({last}): lower --learning-rate"
            )


def save_model(model, tokenizer, folder, step=None):
    """save_pretrained (model and tokenizer) into a temporary folder, then rename: never half a model; with `step`,
    the step it was saved at beside it (FINAL_STEP: a resume never overwrites a later one, check_later_results)."""
    check_weights_finite({"model": model}, folder)
    state_dict = dist.full_state_dict(model)  # under torchrun, gathered from the shards; None: the model's own
    if dist.is_main():
        tmp = f"{folder}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            if step is not None:
                with open(os.path.join(tmp, FINAL_STEP), "w", encoding="utf-8") as f:
                    json.dump({"step": step}, f)
        except WRITE_ERRORS as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed(
                f"the model to {folder}", os.path.join(os.path.dirname(folder), "checkpoint"), e
            ) from None
        _swap_into_place(tmp, folder)
    dist.barrier()  # no process goes on (or exits) before the folder is whole


def file_digest(path):
    """(size, sha256) of a file; files over HASHED_BYTES are hashed on their first and last MiB only."""
    import hashlib

    size, digest = os.path.getsize(path), hashlib.sha256()
    with open(path, "rb") as f:
        if size <= HASHED_BYTES:
            digest.update(f.read())
        else:
            digest.update(f.read(2**20))
            f.seek(size - 2**20)
            digest.update(f.read())
    return size, digest.hexdigest()


def file_manifest(folder):
    """{relative path: (size, sha256)} of every file under `folder` but state.pt (which holds the manifest)."""
    manifest = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.relpath(path, folder) != "state.pt":
                manifest[os.path.relpath(path, folder)] = file_digest(path)
    return manifest


def data_fingerprint(examples):
    """sha256 of the training examples, in order, every field of each (a task's examples or reward_model.py's pairs,
    a `margin` as much as the prompt): a resumed run must draw its prompts from the same list, the same data."""
    import hashlib
    import json

    keys = ("prompt", "answer", "chosen", "rejected")  # then the other fields by name, but "where" (the line it is on)
    rows = []
    for example in examples:
        other = sorted([key, value] for key, value in example.items() if key not in keys and key != "where")
        rows.append([example[key] for key in keys if key in example] + ([other] if other else []))
    return hashlib.sha256(json.dumps(rows, default=repr).encode("utf-8")).hexdigest()  # repr: what JSON cannot write


def rng_state():
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder, script, args, models, tokenizer, step, optimizer, scheduler, sampler, **state):
    """Everything needed to continue exactly: each model by save_pretrained (loadable by transformers and vLLM
    as it is), and state.pt with the Args, step, optimizer, scheduler, prompt order, RNG states and `state`
    (the history, and what else the algorithm carries from step to step), plus what load_checkpoint checks:
    the version, the size and hash of every file, the keys of state.pt, the training data's fingerprint.
    Atomic; a failed write (disk full) is one line naming the last good checkpoint. Under torchrun the shards
    are gathered and rank 0 writes, with world_size and each process's RNG states (rank_rng)."""
    check_weights_finite(models, folder)
    tmp = f"{folder}.tmp"
    weights = {name: dist.full_state_dict(model) for name, model in models.items()}  # None on one process
    state.update(
        script=script,
        args=vars(args),
        rng=rng_state(),
        step=step,
        optimizer=dist.full_optimizer_state(optimizer),
        scheduler=scheduler.state_dict(),
        sampler=sampler.state_dict(),
    )
    if dist.world_size() > 1:
        state.update(world_size=dist.world_size(), rank_rng=dist.all_gather(state["rng"]))
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name, model in models.items():
                model.save_pretrained(os.path.join(tmp, name), state_dict=weights[name])
                tokenizer.save_pretrained(os.path.join(tmp, name))
            state.update(version=CHECKPOINT_VERSION, files=file_manifest(tmp), data=data_fingerprint(sampler.examples))
            torch.save(dict(state, keys=sorted(state)), os.path.join(tmp, "state.pt"))
        except WRITE_ERRORS as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed(f"the checkpoint of step {step} to {folder}", folder, e) from None
        _swap_into_place(tmp, folder)
    dist.barrier()


def read_state(folder):
    """state.pt of `folder` (None if there is none), or a UsageError if it cannot be read."""
    path = os.path.join(folder, "state.pt")
    if not os.path.isfile(path):
        return None
    try:
        return torch.load(path, weights_only=False)  # our own file: it holds Python RNG states
    except Exception as e:
        raise UsageError(
            f"--resume {folder!r}: state.pt cannot be read ({type(e).__name__}): the checkpoint is corrupt"
        ) from None


def check_files(folder, state):
    """A UsageError naming the first file of the checkpoint that is missing or not as it was saved."""
    for name, (size, digest) in sorted(state["files"].items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UsageError(
                f"--resume {folder!r}: {name} is missing: the checkpoint is incomplete; restore it or start a new run"
            )
        now = os.path.getsize(path)
        if now < size and name.endswith(".safetensors"):
            raise UsageError(
                f"--resume {folder!r}: {name} is {now} bytes, not the {size} saved: it was cut short; "
                "restore the checkpoint or start a new run"
            )
        if now != size or file_digest(path)[1] != digest:
            raise UsageError(f"--resume {folder!r}: {name} was changed after the save: restore it or start a new run")


def find_checkpoint(folder):
    """(folder, state) of the checkpoint `--resume folder` means (state None: there is none). A kill between the
    two renames of a save leaves no `folder`, but folder.tmp (complete, newer) and folder.old (the previous
    one): the newer one that passes its checks is renamed back into place, and the fallback said in one line."""
    state = read_state(folder)
    if state is not None or os.path.exists(folder):
        return folder, state
    for candidate, what in ((f"{folder}.tmp", "the save in progress"), (f"{folder}.old", "the previous checkpoint")):
        try:
            state = read_state(candidate)
            if state is None or "files" not in state:
                continue
            check_files(candidate, state)
        except UsageError:
            continue
        os.rename(candidate, folder)
        print(
            f"note: {folder} was missing (a save was stopped between its renames); resuming from {what}, "
            f"step {state.get('step')}, moved back from {candidate}",
            file=sys.stderr,
        )
        return folder, state
    return folder, None


def load_checkpoint(folder, script, args, task=None):
    """The state of a checkpoint written by `script`, after checking it fits these Args (and `task`'s training
    examples, when given): every way it can differ from what was saved is one line naming what is wrong."""
    branch = branches(args)  # a branch only reads the checkpoint's run folder: no lock, no check of its finals
    if not branch:
        lock_run_folder(os.path.dirname(os.path.abspath(folder)))
    folder, state = find_checkpoint(os.path.normpath(folder))
    if state is None:
        hint = (
            f", such as {os.path.join(folder, 'checkpoint')}"
            if os.path.isdir(os.path.join(folder, "checkpoint"))
            else ""
        )
        raise UsageError(
            f"--resume {folder!r} is not a checkpoint (no state.pt in it): pass a run's checkpoint folder{hint}"
        )
    if not isinstance(state, dict) or state.get("script") not in ("grpo", "ppo", "reward_model"):
        raise UsageError(
            f"--resume {folder!r}: state.pt is not a checkpoint of grpo.py, ppo.py or reward_model.py: pass a run's "
            "checkpoint folder"
        )
    if state["script"] != script:
        raise UsageError(
            f"--resume {folder!r} is a checkpoint of {state['script']}.py, not {script}.py: resume it with that script"
        )
    if state.get("world_size", 1) != dist.world_size():
        raise UsageError(
            f"--resume {folder!r} was written by {state.get('world_size', 1)} process(es), not "
            f"{dist.world_size()}: resume it with as many (each one's random state is in it)"
        )
    version = state.get("version") if isinstance(state.get("version"), int) else 1  # version 1 had no number
    if version != CHECKPOINT_VERSION:
        raise UsageError(
            f"--resume {folder!r} was written by {'an older' if version < CHECKPOINT_VERSION else 'a newer'} "
            f"version of {script}.py (checkpoint format {version}, this one reads {CHECKPOINT_VERSION}): "
            "it cannot be resumed by this one; start a new run, or resume with the version that wrote it"
        )
    missing = [key for key in state.get("keys", ["keys"]) if key not in state]
    if missing:
        raise UsageError(
            f"--resume {folder!r}: state.pt has no {missing[0]!r}: the checkpoint is damaged; "
            "restore it or start a new run"
        )
    check_files(folder, state)
    check_later_results(folder, state["step"], args.num_steps, branch)
    saved, given = state["args"], vars(args)
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    if branch and "vf_coef" in saved and (saved["vf_coef"] > 0) != (args.vf_coef > 0):
        raise UsageError(
            f"--resume {folder!r} was run with --vf-coef {saved['vf_coef']}, not {args.vf_coef}: a branch may change "
            "it, but not between 0 (no critic) and above; pass a value on the checkpoint's side"
        )
    for key, value in given.items():
        if key in RESUMABLE_CHANGES or (branch and key not in BRANCH_FIXED):
            continue
        flag = f"--{key.replace('_', '-')}"
        if key not in saved and value != defaults.get(key):  # at its default, the flag reproduces the older run
            raise UsageError(
                f"--resume {folder!r} was written before {flag} existed, so it ran as with {flag} "
                f"{defaults.get(key)}, not {value}: drop the flag, or start a new run"
            )
        if key in saved and saved[key] != value:
            why = " (a branch keeps it: it fixes what the checkpoint holds)" if branch else ""
            raise UsageError(
                f"--resume {folder!r} was run with {flag} {saved[key]}, not {value}{why}: "
                "drop the flag or pass the checkpoint's value"
                + ("" if branch else "; or branch the run with --output-dir NEW, where a variant's flags may differ")
            )
    gone = sorted(set(saved) - set(given) - RESUMABLE_CHANGES)
    if gone:
        raise UsageError(
            f"--resume {folder!r} was run with --{gone[0].replace('_', '-')}, which this version does not have: "
            "start a new run"
        )
    if saved.get("lora_merged") and not args.lora_merged:
        raise UsageError(
            f"--resume {folder!r} was run with --lora-merged: pass it again, or its final-merged model would stay at "
            "an older step than final"
        )
    check_history(folder, state)
    if task is not None and data_fingerprint(task.train) != state["data"]:
        raise UsageError(
            f"--resume {folder!r} was trained on other examples than task {task.name!r} gives now "
            f"({len(task.train)} training examples): restore the data it was trained on, or start a new run"
        )
    return state


def check_history(folder, state):
    """The history a run writes and the loop goes on with: one finite number a step up to the checkpoint's of each
    per-step list (grpo.py and ppo.py: score and length, and the tokens seen, a count; reward_model.py: its loss);
    and PPO's KL coefficient, a finite number >= 0. An edited or damaged state.pt (its own digest is not in the
    manifest) is refused here, not met as a traceback later."""
    number = lambda x: type(x) in (int, float) and math.isfinite(x)
    history, step = state.get("history"), state["step"]
    per_step = ("bt_loss",) if state.get("script") == "reward_model" else ("score", "length")
    problem = None
    if not isinstance(history, dict) or not isinstance(step, int):
        problem = "history is not a dict of lists"
    elif "score" in per_step and not (type(history.get("tokens")) is int and history["tokens"] >= 0):
        problem = f"history's token count is {shorten(history.get('tokens'), 40)}"
    else:
        for key in per_step:
            values = history.get(key)
            if not (isinstance(values, list) and len(values) == step and all(map(number, values))):
                problem = f"history's {key} is not {step} finite numbers, one a step"
                break
    if problem is None and "kl_coef" in state and not (number(state["kl_coef"]) and state["kl_coef"] >= 0):
        problem = f"the KL coefficient is {shorten(state['kl_coef'], 40)}"
    if problem:
        raise UsageError(
            f"--resume {folder!r}: state.pt's {problem}, not what a run writes: the checkpoint was edited or is "
            "damaged; restore it or start a new run"
        )


FINAL_STEP = "final_step.json"  # beside a final model: the step it was saved at
LOCKS = []  # the open lock file of this process's run folder, held until the process exits


def lock_run_folder(run_dir):
    """Hold an exclusive lock on the run folder (its .lock file) while this process runs: a second --resume of
    the same checkpoint at once is refused, instead of two runs overwriting one another's checkpoints; so is a
    run folder this process cannot write in (read-only)."""
    if not dist.is_main() or not os.path.isdir(run_dir) or any(path == run_dir for path, _ in LOCKS):
        return
    try:
        handle = open(os.path.join(run_dir, ".lock"), "a")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held by another process
        raise UsageError(
            f"the run folder {run_dir} is in use by another run (its .lock is held): wait for that run "
            "to end, or stop it, before resuming"
        ) from None
    except OSError as e:  # read-only, or not ours: the resumed run could write no checkpoint, log or model there
        raise UsageError(
            f"cannot write in the run folder {run_dir} ({e.strerror}): a resumed run writes its checkpoints, logs and "
            "final model there; make it writable, or copy the run folder somewhere writable and resume the copy"
        ) from None
    LOCKS.append((run_dir, handle))


def release_locks():  # the run is over (its summary printed, or stopped by a signal): it may be resumed now
    while LOCKS:
        LOCKS.pop()[1].close()


def final_step(folder):
    """The step a final model folder was saved at; None if it has no record (saved by an older version)."""
    try:
        with open(os.path.join(folder, FINAL_STEP), encoding="utf-8") as f:
            step = json.load(f)["step"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return step if type(step) is int and step >= 0 else None  # 1e400 (inf), "3", true: not a step


def check_later_results(folder, step, num_steps, branch=False):
    """A resume never destroys a later result: its target must lie past the checkpoint, and its run folder must
    not hold a final model (or a PPO critic) of that target or later, which the resumed run would overwrite (a
    branch writes in a new run folder: only the target is checked)."""
    if num_steps <= step:
        raise UsageError(
            f"--resume {folder!r} is at step {step}, and --num-steps {num_steps} ends there or before: "
            f"pass --num-steps above {step} to continue it"
        )
    if branch:
        return
    run_dir = os.path.dirname(os.path.abspath(folder))
    for name in ("final", "critic"):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and (final_step(path) or num_steps) >= num_steps:
            at = f"step {final_step(path)}" if final_step(path) else "an unknown step"
            fix = ", or pass a larger --num-steps" if final_step(path) else f" (its {FINAL_STEP} records no step)"
            raise UsageError(
                f"--resume {folder!r}: {path} holds the model of {at}, which resuming to --num-steps "
                f"{num_steps} would overwrite: move it away first{fix}"
            )


def restore_state(state, optimizer, scheduler, sampler):
    """Put back a checkpoint's optimizer, scheduler, prompt order and RNG states; (first step to run, history)."""
    if data_fingerprint(sampler.examples) != state["data"]:  # also when load_checkpoint was not given the task
        raise UsageError(
            "the checkpoint was trained on other examples than the task gives now: restore its data, or start a new run"
        )
    try:
        dist.load_optimizer_state(optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rank_rng"][dist.rank()] if "rank_rng" in state else state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise UsageError(
            f"the checkpoint's optimizer, schedule or RNG state does not fit this run ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): start a new run"
        ) from None
    return state["step"] + 1, state["history"]


class StopSignal:
    """SIGINT, SIGTERM and SIGHUP set a flag; the loop finishes its step, saves a checkpoint and exits.
    A second signal stops at once, with exit status 128 + signal, even while a step hangs in your reward function
    (the last checkpoint on disk stays intact: saves are atomic)."""

    def __init__(self, checkpoint_dir):
        if Interrupted.received:  # a signal during loading whose exception something swallowed: nothing was saved
            raise Interrupted(Interrupted.received[0])
        self.signal = self.name = None  # the signal this process received; why the run stops, once decided
        self.checkpoint_dir = checkpoint_dir
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal or ssh session closed
            signal.signal(sig, self._handle)
            if dist.world_size() > 1:  # restart a collective's interrupted system call (gloo aborts on EINTR)
                signal.siginterrupt(sig, False)

    def _handle(self, signum, frame):
        if self.signal is not None:
            saved = os.path.isdir(self.checkpoint_dir)
            where = f"the last checkpoint is {self.checkpoint_dir}" if saved else "no checkpoint was saved"
            print(
                f"\n{signal.Signals(signum).name} again: stopped at once, in the middle of a step; {where}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)  # not an exception: code that catches everything (a reward function) cannot hold it
        self.signal = signal.Signals(signum).name
        print(
            f"\n{self.signal}: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)",
            file=sys.stderr,
        )

    def requested(self):
        """Whether to stop after this step: a signal reached this process or, under torchrun, any other one. Every
        process decides from the one vote, never from its own flag, which a signal may set just after the vote:
        a process that stopped alone would wait forever in the next collective for the others."""
        if dist.any(self.signal is not None):
            self.name = self.signal or "a signal to another process"
        return self.name is not None

    def exit(self, step, writer, script):
        """Once the checkpoint is saved: close the logs and stop, with the command that resumes the run."""
        writer.close()
        release_locks()
        dist.finish()
        if not dist.is_main():
            raise SystemExit(1)
        command = resume_command(script, self.checkpoint_dir)
        raise SystemExit(f"stopped by {self.name} after step {step}; resume with: {command}")


def resume_command(script, checkpoint_dir):
    """The command that continues this run: its own flags (load_checkpoint wants the same Args back), then --resume."""
    flags = (
        sys.argv[1:] if os.path.basename(sys.argv[0]) == f"{script}.py" else []
    )  # [] when main() is called from Python
    kept = []
    for i, flag in enumerate(flags):
        if not (flag.startswith("--resume=") or flag == "--resume" or (i > 0 and flags[i - 1] == "--resume")):
            kept.append(flag)
    launcher = ["python"] if dist.world_size() == 1 else ["torchrun", "--nproc-per-node", str(dist.world_size())]
    return " ".join(shlex.quote(part) for part in [*launcher, f"{script}.py", *kept, "--resume", checkpoint_dir])
