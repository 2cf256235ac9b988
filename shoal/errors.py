"""Errors a user can act on: the CLI prints them as one line and exits non-zero."""


class UsageError(Exception):
    """Bad input from the command line or the environment (a missing corpus, a bad path)."""
