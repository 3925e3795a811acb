"""
The errors a run ends with in one line, and what a damaged file is: the command line prints a UsageError as its
one line, without a traceback.
"""


class UsageError(Exception):
    """A mistake or a problem the user can fix: the command line prints it as one line, without a traceback."""


class DataError(UsageError):
    """Training data that cannot be read, or holds what no model can train on, found as the stream reaches it."""


class BadFile(Exception):
    """What is wrong with a file's contents, without its name: the caller says which file and what to do about it."""
