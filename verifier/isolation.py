"""verify.py's checks run in a child process, so that nothing an adapter does can end verify silently.

An adapter runs in the process it is checked in: `os._exit(0)`, a crash of a peer's C extension or the kernel's
out-of-memory killer would end that process with no table and a status that may read as a pass. Here the parent
only relays the child's output and records which adapter call is running; the child's exit status is the one its
report sends last. A child that ends without sending it is one line naming the adapter call it ended in, and exit
status 3; where no adapter call was running, 128 + N for a signal N (137: killed, out of memory?), else its own.
A fork, not a new interpreter: nothing is imported or loaded twice, and starting costs nothing.
"""

import io
import multiprocessing
import signal
import sys

import torch

from verifier import calls
from verifier.report import ADAPTER_MISTAKE, INTERRUPTED


class _Relay(io.TextIOBase):
    """The child's stdout or stderr, sent to the parent as it is written."""

    def __init__(self, conn, kind):
        self.conn, self.kind = conn, kind

    def writable(self):
        return True

    def write(self, text):
        self.conn.send((self.kind, str(text)))
        return len(text)


def _child(target, opts, conn, threads):
    if threads:  # a fork of a process whose OpenMP pool ran on several threads hangs on its first parallel op
        torch.set_num_threads(threads)
    sys.stdout, sys.stderr = _Relay(conn, "out"), _Relay(conn, "err")
    calls.watch = lambda what: conn.send(("at", what))
    code = target(opts)
    conn.send(("done", code))


def run(target, opts, threads=None):
    """target(opts) -> exit status, in a forked child; `threads`: the child's torch threads (1 where this process
    has run torch on several: forking its OpenMP pool otherwise hangs)."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(target, opts, writer, threads))
    child.start()
    writer.close()
    at, code, interrupts = None, None, 0
    while True:
        try:
            kind, payload = reader.recv()
        except EOFError:
            break
        except KeyboardInterrupt:  # the child got the same Ctrl-C: it says where it was, then ends
            interrupts += 1
            if interrupts > 1:
                child.kill()
                print("interrupted: no result", file=sys.stderr)
                return INTERRUPTED
            continue
        if kind == "done":
            code = payload
        elif kind == "at":
            at = payload
        else:
            (sys.stdout if kind == "out" else sys.stderr).write(payload)
    child.join()
    if code is not None:
        return code
    status = child.exitcode
    how = f"exit status {status}" if status >= 0 else f"killed by {signal.Signals(-status).name}"
    if at is None:
        print(f"error: verify's process ended before its report ({how}): no result", file=sys.stderr)
        return 128 - status if status < 0 else max(status, 1)
    print(
        f"error: {at} ended verify's process ({how}; os._exit, a crash or a kill): no result, and no exit status 0",
        file=sys.stderr,
    )
    return ADAPTER_MISTAKE
