"""How a multicard process ends on an error: one line and a documented exit code.

The command line (cli.main) and a user's script (multicard.Run's exception hook) end alike:
an expected failure (MulticardError: bad input, a divergence, an agreed stop) is one line, said
once by rank 0 when every rank met it; a lost or timed-out collective is one line naming what
happened; anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import os
import sys
import time

from multicard.base.errors import ExitCode, MulticardError, Stopped
from multicard.runtime.process_group import communication_failure, detect_env, end_process

EVERY_RANK_WAIT_S = 20.0  # how long a rank leaves rank 0 to say an error every rank met (see report_error)


def say_line(line: str) -> None:
    """One line to stderr in one write: ranks share the launcher's stderr, and a line printed in
    two writes (text, then newline, as print does on an unbuffered stream) can interleave with
    another rank's."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, replaced)
        print(line, file=sys.stderr)
        return
    sys.stderr.flush()
    os.write(fd, f"{line}\n".encode())


def report_error(exc: BaseException) -> int | None:
    """Say `exc` in one line (where it is multicard's to say) and return the exit code; None for
    an exception that is a bug (its traceback is the report). A rank of a job that failed alone
    ends here (see end_process), before its peers see its connections close."""
    env = detect_env()
    if isinstance(exc, Stopped):
        if env.is_main:  # every rank stopped alike; one line is enough
            print(f"multicard: {exc}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, MulticardError):
        where = f" (rank {env.rank})" if env.world_size > 1 and not exc.every_rank else ""
        if env.is_main or not exc.every_rank:  # an error every rank met: rank 0 says it
            say_line(f"multicard: error{where}: {exc}")
        if env.launched and env.world_size > 1:
            if exc.every_rank and not env.is_main:
                # Rank 0 says it and ends, then the launcher ends this rank; ending first would have
                # the launcher stop rank 0 before it could say it. Bounded: not every launcher ends the rest.
                time.sleep(EVERY_RANK_WAIT_S)
            # End now, before interpreter shutdown closes this rank's connections: a peer that
            # loses them must not exit first, or the launcher would report its error, not ours.
            end_process(exc.exit_code)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print("multicard: interrupted", file=sys.stderr)
        return ExitCode.SIGINT
    code = communication_failure(exc)
    if code is None:
        return None
    communication_failed(code)
    return code  # not reached: communication_failed ends the process


def communication_failed(code: ExitCode) -> None:
    """One line, or none where multicard's launcher reports the rank that caused it; then the end."""
    env = detect_env()
    if code == ExitCode.STALLED:
        say_line(
            f"multicard: error (rank {env.rank}): a collective waited longer than dist_timeout_s for another rank; "
            f"a rank is stuck or stopped (see the stall report, if any) — fix it or raise dist_timeout_s"
        )
    elif env.launcher_pid is None:
        say_line(
            f"multicard: error (rank {env.rank}): lost the connection to another rank, which failed or was "
            f"stopped (its own message, or the launcher's, says which)"
        )
    end_process(code)
