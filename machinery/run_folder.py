"""A run's folder, as checkpoints.py writes in it: only inside it, through no link; its lock; what a resume or a
branch may do to it (a resume never overwrites a later result; a branch starts a new folder, outside its source's).

A link anywhere in the run folder (RUN/checkpoint.tmp pointing at another folder, RUN itself a link) is refused in
one line before anything is written: a save follows a link, so it would write where the link points.
"""

import dataclasses
import fcntl
import json
import os
import shutil

from machinery import distributed as dist
from machinery.errors import UsageError

FINAL_STEP = "final_step.json"  # beside a final model: the step it was saved at
LOCKS = []  # the open lock file of this process's run folder, held until the process exits
GIVEN = set()  # the Args fields given on the command line (startup.start): an --output-dir given as its default too


def refuse_links(run_dir):
    """A UsageError if the run folder is a link, or holds one at its top level (where a run writes: checkpoint,
    its .tmp and .old, final, critic, the event files, .lock)."""
    if os.path.islink(run_dir):
        raise UsageError(
            f"the run folder {run_dir} is a link (to {os.readlink(run_dir)}): a run writes only inside its own "
            "folder, through no link; resume from the folder it points to"
        )
    if not os.path.isdir(run_dir):
        return
    for name in sorted(os.listdir(run_dir)):
        if os.path.islink(os.path.join(run_dir, name)):
            raise UsageError(
                f"the run folder {run_dir} holds a link, {name} -> {os.readlink(os.path.join(run_dir, name))}: a run "
                "writes only inside its own folder, through no link; remove the link (or put what it points to there)"
            )


def swap_into_place(tmp, folder):
    """Replace `folder` by the finished `tmp`: at every moment one complete copy exists on disk (after a kill
    between the two renames, as folder.old and folder.tmp: checkpoints.find_checkpoint takes the newer complete
    one). The run folder is checked for links first (refuse_links), and `tmp` was checked before it was written."""
    refuse_links(os.path.dirname(folder))
    old = f"{folder}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(folder):
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def fresh_tmp(folder):
    """`folder`.tmp, emptied, after refusing any link in the run folder (a link at .tmp would take the save)."""
    refuse_links(os.path.dirname(folder))
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def branches(args):
    """Whether --resume continues into a new run folder under --output-dir (a branch) rather than in the checkpoint's
    own run folder: an --output-dir given (on the command line, or other than its default), other than the one
    holding that run folder."""
    if not args.resume:
        return False
    default = next(field.default for field in dataclasses.fields(args) if field.name == "output_dir")
    run_parent = os.path.dirname(os.path.dirname(os.path.abspath(args.resume)))
    given = "output_dir" in GIVEN or args.output_dir != default
    return given and os.path.realpath(args.output_dir) != os.path.realpath(run_parent)


def check_branch_target(checkpoint, output_dir):
    """A branch's --output-dir must lie outside the source's run folder: a resume of the source replaces its
    checkpoint (and final) folders, and with them a branch inside."""
    source = os.path.realpath(os.path.dirname(os.path.abspath(checkpoint)))
    target = os.path.realpath(output_dir)
    if target == source or target.startswith(source + os.sep):
        raise UsageError(
            f"--output-dir {output_dir!r} lies inside the run folder {source} it branches from, whose next resume "
            "would replace it: pick an --output-dir outside that run folder"
        )


def start_branch(checkpoint, run_dir):
    """A branch's new run folder starts with the TensorBoard events of the run it branches from (its writer purges
    the steps after the checkpoint), so its curves are whole, and branched_from.json naming the checkpoint. The
    checkpoint's own run folder is only read (its links are not followed)."""
    source = os.path.dirname(os.path.abspath(checkpoint))
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name.startswith("events.out.tfevents.") and os.path.isfile(path) and not os.path.islink(path):
            shutil.copy2(path, os.path.join(run_dir, name))
    with open(os.path.join(run_dir, "branched_from.json"), "w", encoding="utf-8") as f:
        json.dump({"checkpoint": os.path.abspath(checkpoint)}, f)


def lock_run_folder(run_dir):
    """Hold an exclusive lock on the run folder (its .lock file) while this process runs: a second --resume of
    the same checkpoint at once is refused, instead of two runs overwriting one another's checkpoints; so is a
    run folder this process cannot write in (read-only), or one holding a link (refuse_links)."""
    if not dist.is_main() or not os.path.isdir(run_dir) or any(path == run_dir for path, _ in LOCKS):
        return
    refuse_links(run_dir)
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
