"""
The errors a run ends with in one line, and what a damaged file is: the command line prints a UsageError as its
one line, without a traceback. And the chain an error was raised in, where a library's error hides the one that says
what happened.
"""


class UsageError(Exception):
    """A mistake or a problem the user can fix: the command line prints it as one line, without a traceback."""


class DataError(UsageError):
    """Training data that cannot be read, or holds what no model can train on, found as the stream reaches it."""


class BadFile(Exception):
    """What is wrong with a file's contents, without its name: the caller says which file and what to do about it."""


def chain(error):
    """error, then the error it was raised from or during, and so on: a library wraps the error that says what happened
    (torch.save's RuntimeError an OSError, a compiler's error an out-of-memory one)."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
