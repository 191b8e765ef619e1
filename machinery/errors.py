"""The error every layer raises on bad input, at the bottom of the imports: every other file may import it.

A UsageError reaches the user as one line saying what to change (bookkeeping.run_main), never as a traceback.
"""


class UsageError(Exception):
    """Bad input from the user: reported as one line saying what to change, never as a traceback."""


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM before the training loop took over the signals: nothing was saved (bookkeeping.run_main).

    `received` keeps each such signal: code that swallows every exception (a C extension clearing the error it was
    handed while loading) would otherwise lose it; the loop's StopSignal raises it again when it takes over."""

    received = []

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def shorten(value, limit=200):
    """repr(value) on one line, cut to about `limit` characters, for error messages."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # a list nested 100,000 deep, an int of more than 4300 digits
        text = f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message, limit=200):
    """An exception's message (or any text) on one line, cut to about `limit` characters."""
    text = " ".join(str(message).split()) or "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."
