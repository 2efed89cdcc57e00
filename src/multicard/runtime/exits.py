"""How a multicard process ends on an error: one line and a documented exit code.

The command line (cli.main) and a user's script (multicard.Run's exception hook) end alike:
an expected failure (MulticardError: bad input, a divergence, an agreed stop) is one line, said
once by rank 0 when every rank met it; a lost or timed-out collective is one line naming what
happened; anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
import time
from typing import NoReturn

import torch.distributed as dist

from multicard.base.errors import ExitCode, MulticardError, Stopped
from multicard.runtime.environment import ProcessEnv, detect_env

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


# ---------------------------------------------------------------- how a process ends


PR_SET_PDEATHSIG = 1  # prctl option: a signal for this process when its parent dies
EXIT_GRACE_S = 2.0  # how long threads still running when a command is done may delay its process's end


def end_process(code: int) -> NoReturn:
    """End this process now, its output flushed, without the interpreter's shutdown: for a rank
    that failed (its peers must not see its connections close before the launcher hears of it),
    and for one whose work is done and written under fsdp, where torch's native teardown
    sometimes aborts at exit (SIGABRT, "terminate called without an active exception": a C++
    thread still joinable) — in about 1 of 5 `plan --measure` runs and once in a CI run of the
    tests — and the launcher then reports a failed rank for a job that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_in_time(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure the process ends with `code` once the command is done. The interpreter's exit
    waits for every non-daemon thread, and one that never ends (started by a dataset function,
    say) would keep the process, and a launcher waiting for it, alive forever: such threads get
    `grace_s` to end, then the process ends without them, naming them. Call it just before the
    interpreter's exit, which runs as usual meanwhile (exit handlers, threads that do end)."""
    lingering = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not lingering:
        return

    def watch() -> None:
        deadline = time.monotonic() + grace_s
        for thread in lingering:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [repr(t.name) for t in lingering if t.is_alive()]
        if alive:
            line = (
                f"multicard: warning: thread(s) {', '.join(alive)} still running {grace_s:g} s after the command "
                f"ended (started by the dataset's or model's code, not multicard's); ending the process without them"
            )
            os.write(2, f"{line}\n".encode())
            end_process(code)

    threading.Thread(target=watch, name="multicard-exit", daemon=True).start()


def die_with_launcher(env: ProcessEnv) -> None:
    """A worker of multicard's launcher gets SIGTERM when the launcher dies, however it dies
    (SIGKILL by the out-of-memory killer or a scheduler): it then stops like on any SIGTERM,
    with a checkpoint if training, at once if still starting."""
    if env.launcher_pid is not None:
        die_with_parent(env.launcher_pid)


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGTERM when its parent (`parent_pid`) dies, however it dies. Linux only;
    elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def communication_failure(exc: BaseException) -> ExitCode | None:
    """STALLED for a collective that timed out, PEER_LOST for a connection another rank dropped
    (it failed, was killed or its node went away); None if `exc` is not a communication failure."""
    text = str(exc)
    # gloo's timeouts also surface as "Application timeout caused pair closure", naming no backend.
    gloo = any(word in text for word in ("gloo", "NCCL", "pair closure"))
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and gloo)):
        return None
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return ExitCode.STALLED
    return ExitCode.PEER_LOST
