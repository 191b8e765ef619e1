"""The error every layer raises on bad input, at the bottom of the imports: every other file may import it.

A UsageError reaches the user as one line saying what to change (bookkeeping.run_main), never as a traceback.
"""


class UsageError(Exception):
    """Bad input from the user: reported as one line saying what to change, never as a traceback."""


def shorten(value, limit=200):
    """repr(value) on one line, cut to about `limit` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
