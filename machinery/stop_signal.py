"""The guard that stops a run cleanly on a signal: SIGINT, SIGTERM or SIGHUP finish the step, save a checkpoint
(checkpoints.py) and exit with the command that resumes the run."""

import os
import shlex
import signal
import sys

from machinery import distributed as dist
from machinery.errors import Interrupted
from machinery.run_folder import release_locks


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
