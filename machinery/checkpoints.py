"""What a run writes to disk, and reads back: the final models, checkpoints and resuming from them, and the
guard that stops a run cleanly on a signal (it saves a checkpoint). Batch dumps and the NaN stop: dumps.py.

Nothing here changes what a run computes; a resumed run is the uninterrupted one, bit for bit on CPU.
Under torchrun every process calls these alike: the shards are gathered and rank 0 alone writes, in the same
format as one process (distributed.py); a checkpoint resumes with the number of processes that wrote it.
"""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys

import torch
from safetensors import SafetensorError

from machinery import distributed as dist
from machinery import run_folder
from machinery.errors import UsageError, shorten
from machinery.run_folder import (
    FINAL_STEP,
    branches,
    check_later_results,
    final_step,
    lock_run_folder,
    release_locks,
    start_branch,
)
from machinery.state_file import (
    STATE,
    data_fingerprint,
    file_digest,
    file_manifest,
    read_state,
    rng_state,
    set_rng_state,
    state_bytes,
)
from machinery.stop_signal import StopSignal, resume_command

__all__ = ["FINAL_STEP", "StopSignal", "branches", "check_later_results", "final_step", "lock_run_folder"]
__all__ += ["release_locks", "resume_command", "start_branch"]

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


# A flag whose values were renamed: what an older version's Args meant by the old value, compared as the new one.
OLD_MEANINGS = {("gradient_checkpointing", False): "off", ("gradient_checkpointing", True): "on"}

# Bump when what a checkpoint holds changes: a checkpoint of another version is refused, not misread.
# 2: state.pt lists its files and keys, and the training data's fingerprint (version 1 had no number).
# 3: state.safetensors (state_file.py) replaces state.pt, a pickle, which could run code when read.
CHECKPOINT_VERSION = 3


# How a failed write (disk full, quota, read-only) reaches us: torch.save raises RuntimeError, safetensors its own.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failed(what, folder, error):
    """A save that could not be written (disk full, read-only, quota): one line naming what is still good."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip().splitlines()[0]
    fix = "free some disk space" if any(word in reason.lower() for word in ("space", "full", "quota")) else "fix that"
    if os.path.isfile(os.path.join(folder, STATE)):
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
        tmp = run_folder.fresh_tmp(folder)  # a link in the run folder is refused, never written through
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
        run_folder.swap_into_place(tmp, folder)
    dist.barrier()  # no process goes on (or exits) before the folder is whole


def write_state(path, state):  # a name of this module, so a test can make it fail like a full disk
    with open(path, "wb") as f:
        f.write(state_bytes(state))


def save_checkpoint(folder, script, args, models, tokenizer, step, optimizer, scheduler, sampler, **state):
    """Everything needed to continue exactly: each model by save_pretrained (loadable by transformers and vLLM
    as it is), and state.safetensors (state_file.py: tensors, and the rest as JSON) with the Args, step, optimizer,
    scheduler, prompt order, RNG states and `state` (the history, and what else the algorithm carries from step to
    step: tensors, numbers, text, and lists, tuples and dicts of these), plus what load_checkpoint checks: the
    version, the size and hash of every file, the state's keys, the training data's fingerprint.
    Atomic; a failed write (disk full) is one line naming the last good checkpoint. Under torchrun the shards
    are gathered and rank 0 writes, with world_size and each process's RNG states (rank_rng)."""
    check_weights_finite(models, folder)
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
        tmp = run_folder.fresh_tmp(folder)  # a link in the run folder is refused, never written through
        try:
            for name, model in models.items():
                model.save_pretrained(os.path.join(tmp, name), state_dict=weights[name])
                tokenizer.save_pretrained(os.path.join(tmp, name))
            state.update(version=CHECKPOINT_VERSION, files=file_manifest(tmp), data=data_fingerprint(sampler.examples))
            write_state(os.path.join(tmp, STATE), dict(state, keys=sorted(state)))
        except WRITE_ERRORS as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed(f"the checkpoint of step {step} to {folder}", folder, e) from None
        run_folder.swap_into_place(tmp, folder)
    dist.barrier()


def check_files(folder, state):
    """A UsageError naming the first file of the checkpoint that is missing, a link, outside the checkpoint, or not
    as it was saved."""
    files = state.get("files")
    real = os.path.realpath(folder)
    for name, entry in sorted(files.items()) if isinstance(files, dict) else [(None, None)]:
        ok = isinstance(name, str) and isinstance(entry, tuple) and len(entry) == 2 and type(entry[0]) is int
        path = os.path.join(folder, name) if ok else folder
        if not (ok and isinstance(entry[1], str) and os.path.realpath(path).startswith(real + os.sep)):
            raise UsageError(
                f"--resume {folder!r}: {STATE}'s list of files names {shorten(name, 60)}, not a file of the "
                "checkpoint: the checkpoint was edited or is damaged; restore it or start a new run"
            )
        size, digest = entry
        if os.path.islink(path):
            raise UsageError(f"--resume {folder!r}: {name} is a link: copy the file it points to there, or restore it")
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
    """(folder, state, the state's bytes) of the checkpoint `--resume folder` means (state None: there is none).
    A kill between the two renames of a save leaves no `folder`, but folder.tmp (complete, newer) and folder.old
    (the previous one): the newer one that passes its checks is renamed back into place, and the fallback said in
    one line. Every state is read by state_file.read_state, which runs no code."""
    state, data = read_state(folder)
    if state is not None or os.path.lexists(folder):
        return folder, state, data
    for candidate, what in ((f"{folder}.tmp", "the save in progress"), (f"{folder}.old", "the previous checkpoint")):
        try:
            if os.path.islink(candidate):
                continue
            state, data = read_state(candidate)
            if not isinstance(state, dict) or "files" not in state:
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
        return folder, state, data
    return folder, None, None


def check_unchanged(state):
    """After the weights were read (startup.resume): the checkpoint is still the one whose state was read, file for
    file, so the run continues one consistent step, never step k's optimizer on step k+1's weights (a branch of a
    run that saved meanwhile is refused, saying so)."""
    folder, digest = state["read_from"]
    try:
        with open(os.path.join(folder, STATE), "rb") as f:
            same = hashlib.sha256(f.read()).hexdigest() == digest
    except OSError:
        same = False
    if not same:
        raise UsageError(
            f"--resume {folder!r} was replaced by a newer save while this run read it (its run is still going?): "
            "the weights read may be of another step than its state; start again, or branch from a copy of it"
        )
    check_files(folder, state)


def load_checkpoint(folder, script, args, task=None):
    """The state of a checkpoint written by `script`, after checking it fits these Args (and `task`'s training
    examples, when given): every way it can differ from what was saved is one line naming what is wrong."""
    branch = branches(args)  # a branch only reads the checkpoint's run folder: no lock, no check of its finals
    if not branch:  # it writes in the checkpoint's run folder: inside it only, through no link
        run_folder.refuse_links(os.path.dirname(os.path.abspath(folder)))
        lock_run_folder(os.path.dirname(os.path.abspath(folder)))
    folder, state, data = find_checkpoint(os.path.normpath(folder))
    if state is None:
        hint = (
            f", such as {os.path.join(folder, 'checkpoint')}"
            if os.path.isdir(os.path.join(folder, "checkpoint"))
            else ""
        )
        raise UsageError(
            f"--resume {folder!r} is not a checkpoint (no {STATE} in it): pass a run's checkpoint folder{hint}"
        )
    if branch:  # outside the source's run folder, which the source's next resume would replace
        run_folder.check_branch_target(folder, args.output_dir)
    if not isinstance(state, dict) or state.get("script") not in ("grpo", "ppo", "reward_model"):
        raise UsageError(
            f"--resume {folder!r}: {STATE} is not a checkpoint of grpo.py, ppo.py or reward_model.py: pass a run's "
            "checkpoint folder"
        )
    if state["script"] != script:
        raise UsageError(
            f"--resume {folder!r} is a checkpoint of {state['script']}.py, not {script}.py: resume it with that script"
        )
    if state.get("world_size", 1) != dist.world_size():
        raise UsageError(
            f"--resume {folder!r} was written by {shorten(state.get('world_size', 1), 40)} process(es), not "
            f"{dist.world_size()}: resume it with as many (each one's random state is in it)"
        )
    version = state.get("version") if type(state.get("version")) is int else 1  # version 1 had no number
    if version != CHECKPOINT_VERSION:
        raise UsageError(
            f"--resume {folder!r} was written by {'an older' if version < CHECKPOINT_VERSION else 'a newer'} "
            f"version of {script}.py (checkpoint format {version}, this one reads {CHECKPOINT_VERSION}): "
            "it cannot be resumed by this one; start a new run, or resume with the version that wrote it"
        )
    keys = state.get("keys", ["keys"])
    missing = [key for key in keys if key not in state] if isinstance(keys, list) else ["keys"]
    if not missing and not (type(state["step"]) is int and state["step"] >= 0 and isinstance(state["args"], dict)):
        missing = ["step" if type(state["step"]) is not int else "args"]
    if missing:
        raise UsageError(
            f"--resume {folder!r}: {STATE} has no {shorten(missing[0], 40)} as a run writes it: the checkpoint is "
            "damaged; restore it or start a new run"
        )
    state["read_from"] = (folder, hashlib.sha256(data).hexdigest())  # check_unchanged, once the weights are read
    check_files(folder, state)
    check_later_results(folder, state["step"], args.num_steps, branch)
    saved, given = {key: OLD_MEANINGS.get((key, value), value) for key, value in state["args"].items()}, vars(args)
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    if branch and type(saved.get("vf_coef", 0.0)) is not float:
        saved["vf_coef"] = math.nan  # not what a run writes: refused below
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
            at_default = value == defaults.get(key)  # no flag given: "drop the flag" would mean nothing
            fix = f"pass {flag} {saved[key]}" if at_default else "drop the flag or pass the checkpoint's value"
            raise UsageError(
                f"--resume {folder!r} was run with {flag} {str(saved[key])[:80]}, not "
                f"{value}{why}: {fix}"
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
    and PPO's KL coefficient, a finite number >= 0. An edited or damaged state (its own digest is not in the
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
            f"--resume {folder!r}: {STATE}'s {problem}, not what a run writes: the checkpoint was edited or is "
            "damaged; restore it or start a new run"
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
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError, IndexError) as e:  # a crafted state too
        raise UsageError(
            f"the checkpoint's optimizer, schedule or RNG state does not fit this run ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): start a new run"
        ) from None
    return state["step"] + 1, state["history"]
