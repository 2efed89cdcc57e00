"""How a multicard process ends on an error: one line and a documented exit code.

The command line (cli.main) and a user's script (multicard.Run's exception hook) end alike:
an expected failure (MulticardError: bad input, a divergence, an agreed stop) is one line, said
once by rank 0 when every rank met it; a lost or timed-out collective is one line naming what
happened; anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import atexit
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from multicard.base.errors import ExitCode, MulticardError, Stopped
from multicard.runtime.environment import ProcessEnv, detect_env, stopped_to_restart
from multicard.runtime.process_tree import PR_SET_PDEATHSIG, adopt_orphans, end_descendants, prctl
from multicard.runtime.script import from_the_script

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
        if env.is_main and stopped_to_restart(env):
            print(f"multicard: stopped at step {exc.step} with a checkpoint: the agent restarts the workers "
                  f"(nodes joined, or a worker failed), and the job goes on by itself", file=sys.stderr)  # fmt: skip
        elif env.is_main:  # every rank stopped alike; one line is enough
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


EXIT_GRACE_S = 2.0  # how long threads and processes still running when a command is done may delay its process's end


def run_to_the_end(command: Callable[[], int]) -> NoReturn:
    """Run `command` as the whole work of this process (the `multicard` program: cli.main.entry,
    for the installed command, `python -m multicard` and every worker multicard's launcher starts),
    then end the process with its exit code as `python` would, but without the interpreter's
    finalization (finish). What the user's code left running does not keep the process alive
    (end_in_time) or outlive it (leave_nothing_running)."""
    leave_nothing_running()
    try:
        code = command()
    except SystemExit as exc:  # --help, a usage error, or a script's own sys.exit
        code = exit_status(exc)
    except BaseException as exc:  # a bug, or a script's own exception: its traceback is the report
        code = uncaught(exc)
    finish(code)


def exit_status(exc: SystemExit) -> int:
    """The exit code `python` gives a SystemExit: its number, 0 for None, else 1 with the value said."""
    if exc.code is None:
        return ExitCode.OK
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return ExitCode.INTERNAL


def uncaught(exc: BaseException) -> int:
    """Report an exception nothing caught as `python` does: sys.last_* set (Run.close reads them),
    then sys.excepthook (a script's own, or multicard.Run's, which ends the process on multicard's
    errors with their one line and exit code); 1, or 130 for a KeyboardInterrupt."""
    exc = exc.with_traceback(from_the_script(exc.__traceback__))  # a script's: as under `python SCRIPT`
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except BaseException:  # a broken hook: python then shows the exception itself
        sys.__excepthook__(type(exc), exc, exc.__traceback__)
    return ExitCode.SIGINT if isinstance(exc, KeyboardInterrupt) else ExitCode.INTERNAL


def finish(code: int) -> NoReturn:
    """End this process as the interpreter's exit does, up to its finalization: non-daemon threads
    joined (bounded by end_in_time), exit handlers run in reverse order of registration (the
    script's, trackers', Run.close, end_leftovers), output flushed; then the process ends.

    The finalization is skipped because C++ threads that torch keeps running to the end abort it:
    a gloo worker thread (DDP's reducer keeps the process group and its threads alive past
    destroy_process_group) that frees a tensor after its last collective takes the GIL of a
    finalizing interpreter, which ends that thread by a forced unwind that std::terminate stops:
    SIGABRT, exit 134, a failed rank for a job whose work is all done (about 1 run in 6 of
    quickstart_run.py under ddp×2; the rendezvous store's thread does the same, pytorch#128821).
    Interpreter shutdown would also walk every object torch's modules made (~0.7 s per process)."""
    end_in_time(code)
    # what the interpreter's exit does first: threading's exit calls, then the joins
    threading._shutdown()  # type: ignore[attr-defined]  # private, no public twin; typeshed leaves it out
    atexit._run_exitfuncs()
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End this process now, its output flushed, without the interpreter's shutdown (see finish):
    at the end of every multicard process, and at once for a rank that failed (its peers must not
    see its connections close before the launcher hears of it). Processes the user's code left
    running end first (end_leftovers)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the user's code
            pass
    end_leftovers()
    os._exit(code & 0xFF)  # as exit(3) takes it: sys.exit(256) ends with 0, sys.exit(-1) with 255


_leaving = threading.Lock()


def leave_nothing_running() -> None:
    """No process the user's code started outlives this one: those it left below this process end
    when it ends (end_leftovers: an exit handler, registered once and early, so that it runs after
    those registered later, a tracker's that ends its own helper; end_process calls it too), and a
    process whose parent ends first comes to this one instead of init (the launcher thus ends
    what a killed worker left)."""
    if _leaving.acquire(blocking=False):
        adopt_orphans()
        atexit.register(end_leftovers)


def end_leftovers() -> None:
    """End the processes still running below this one, naming those the user's code started."""
    left = end_descendants(EXIT_GRACE_S)
    if left:
        say_line(
            f"multicard: warning: process(es) {', '.join(left)} still running when the command ended (started by "
            f"the script's, dataset's or model's code, not multicard's); ended them"
        )


def end_in_time(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure the process ends with `code` once the command is done. The interpreter's exit
    waits for every non-daemon thread, and one that never ends (started by a dataset function,
    say) would keep the process, and a launcher waiting for it, alive forever: such threads get
    `grace_s` to end, then the process ends without them (and without exit handlers, which run
    after the joins), naming them. Call it just before the joins (finish)."""
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


_watching = threading.Lock()


def die_with_launcher(env: ProcessEnv) -> None:
    """A worker of multicard's launcher ends when the launcher dies, however it dies (SIGKILL by
    the out-of-memory killer or a scheduler). It gets SIGTERM then and stops as on any SIGTERM,
    with a checkpoint if training, at once if still starting; if it has not ended within the stop
    time the launcher would have given it (its --stop-timeout or checkpoint.stop_timeout_s), or at
    once where its code ignores SIGTERM, it ends without, and what it started with it."""
    if env.launcher_pid is None:
        return
    die_with_parent(env.launcher_pid)
    leave_nothing_running()
    if _watching.acquire(blocking=False):  # once per process (a script's Run calls this again)
        threading.Thread(target=_outlive, args=(env,), name="multicard-launcher-watch", daemon=True).start()


def _outlive(env: ProcessEnv) -> None:
    """The watch of die_with_launcher: from the launcher's death (the SIGTERM it brings), the stop
    time, then the end."""
    assert env.launcher_pid is not None
    wait_for_exit(env.launcher_pid)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # nothing will stop it
        line = f"the launcher (pid {env.launcher_pid}) has gone and this worker ignores SIGTERM"
    else:
        time.sleep(env.stop_timeout_s)  # the stop's time, as the launcher would have given it
        line = (
            f"the launcher (pid {env.launcher_pid}) has gone and this worker did not stop within "
            f"{env.stop_timeout_s:g} s of its SIGTERM"
        )
    say_line(f"multicard: error (rank {env.rank}): {line}; ending it without a checkpoint (the last one written stays)")
    end_process(ExitCode.SIGTERM)


def wait_for_exit(pid: int) -> None:
    """Until process `pid` (this one's parent) has ended: asleep on a pidfd where the kernel has
    them, else checking every half second."""
    if os.getppid() != pid:  # gone already (and its pid may be another process's by now)
        return
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3 (or not Linux), or gone meanwhile
        while os.getppid() == pid:
            time.sleep(0.5)
        return
    try:
        select.select([fd], [], [])  # readable once the process has ended
    finally:
        os.close(fd)


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGTERM when its parent (`parent_pid`) dies, however it dies. Linux only;
    elsewhere a no-op."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
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
