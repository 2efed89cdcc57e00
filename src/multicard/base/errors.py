"""Errors that end a run with a one-line message, and the exit codes they map to (see README)."""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    """Every exit code multicard documents; the CLI, the launcher and bench use these names."""

    OK = 0
    INTERNAL = 1  # a bug: the traceback is shown
    BAD_INPUT = 2  # one line saying what to change
    DIVERGED = 3  # NaN/inf loss, agreed by all ranks
    VERIFY_FAILED = 4  # `multicard verify` found a difference
    STALLED = 5  # no rank progressed for debug.stall_s (debug.on_stall=abort), or a collective timed out
    PEER_LOST = 6  # this rank lost its connection to another, which failed or was killed
    NODES_LOST = 7  # an elastic job lost nodes and could not re-form (below MIN, or its rendezvous host gone)
    SIGHUP = 128 + signal.SIGHUP  # 129: the terminal or SSH session went away
    SIGINT = 128 + signal.SIGINT  # 130: Ctrl-C
    SIGQUIT = 128 + signal.SIGQUIT  # 131: quit at once, stacks dumped, no checkpoint
    ABORTED = 128 + signal.SIGABRT  # 134: a rank aborted in native code (most often ranks in different collectives)
    KILLED = 128 + signal.SIGKILL  # 137: a worker was killed (often the out-of-memory killer)
    SIGUSR1 = 128 + signal.SIGUSR1  # 138: Slurm's warning before the time limit
    SIGTERM = 128 + signal.SIGTERM  # 143: a scheduler or `kill`

    @classmethod
    def for_signal(cls, signum: int) -> ExitCode:
        return cls(128 + signum)


# Codes of workers that have printed their own one-line reason: the launcher adds nothing.
SELF_REPORTED = frozenset(
    {
        ExitCode.BAD_INPUT,
        ExitCode.DIVERGED,
        ExitCode.STALLED,
        ExitCode.SIGHUP,
        ExitCode.SIGINT,
        ExitCode.SIGQUIT,
        ExitCode.SIGUSR1,
        ExitCode.SIGTERM,
    }
)
# A run that stopped on one of these signals wrote a checkpoint; the same command resumes it.
STOPPED_BY_SIGNAL = frozenset({ExitCode.SIGHUP, ExitCode.SIGINT, ExitCode.SIGUSR1, ExitCode.SIGTERM})


class MulticardError(Exception):
    """Base class: an expected failure, reported in one line without a traceback."""

    exit_code = ExitCode.INTERNAL
    # Every rank meets it alike (bad settings read by every rank): rank 0 alone says it, without "(rank R)".
    every_rank = False


class UserError(MulticardError):
    """Bad input (config, command line, paths, devices): the message says what to change."""

    exit_code = ExitCode.BAD_INPUT


class NodesLost(MulticardError):
    """The job lost nodes and could not go on: fewer than its fewest nodes came back within the
    rendezvous timeout, or the node hosting the rendezvous was lost. Its checkpoints stay."""

    exit_code = ExitCode.NODES_LOST


class TrainingDiverged(MulticardError):
    """The loss became NaN or infinite; every rank agrees before raising it."""

    exit_code = ExitCode.DIVERGED


class Stopped(MulticardError):
    """The run stopped on a signal after the agreed step; exit code 128 + signal number.

    `checkpoint` is the checkpoint written at the stop, filled in by whoever wrote it.
    """

    def __init__(self, signum: int, step: int) -> None:
        super().__init__()
        self.signum = signum
        self.step = step
        self.checkpoint: str | None = None
        self.save_s: float | None = None  # how long the stop's checkpoint took, its upload included
        self.exit_code = ExitCode.for_signal(signum)

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return f"stopped by {name} at step {self.step}; run the same command to resume"
        took = f" (the save took {self.save_s:.1f} s)" if self.save_s is not None else ""
        return (
            f"stopped by {name} at step {self.step}; checkpoint {self.checkpoint} written; "
            f"run the same command to resume{took}"
        )
