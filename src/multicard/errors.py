"""Errors that end a run with a one-line message and a documented exit code (see README)."""

from __future__ import annotations


class MulticardError(Exception):
    """Base class: an expected failure, reported in one line without a traceback."""

    exit_code = 1


class UserError(MulticardError):
    """Bad input (config, command line, paths, devices): the message says what to change."""

    exit_code = 2


class TrainingDiverged(MulticardError):
    """The loss became NaN or infinite; every rank agrees before raising it."""

    exit_code = 3
