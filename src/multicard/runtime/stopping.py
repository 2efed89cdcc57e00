"""Graceful stop: SIGTERM, SIGINT, SIGHUP or SIGUSR1 asks every rank to checkpoint and exit at
an optimizer step they agree on; SIGQUIT quits at once.

- SIGTERM (schedulers, `kill`), SIGINT (Ctrl-C), SIGHUP (the terminal or SSH session went
  away) and SIGUSR1 (Slurm's warning before the time limit, `--signal=USR1@120`) all mean
  "save and stop": the job checkpoints and exits 128 + the signal (143, 130, 129, 138).
- SIGQUIT (Ctrl-\\) means "quit now, and show me where you were": every thread's stack goes to
  stderr and the process exits 131 without a checkpoint (the last one written stays).
- A second SIGINT while stopping also quits at once.

multicard's launcher passes each of these signals on to its workers and gives their stop up to
checkpoint.stop_timeout_s to end (launch.StopRelay); torch's agent alone would give it 30 s.

The handler only records the signal. Every POLL_EVERY optimizer steps the ranks start a small
max-reduction of it on the CPU and collect it one step later, so the check never stalls
training, costs one tiny collective per POLL_EVERY steps, and every rank stops after the same
step: at most POLL_EVERY + 1 steps after the signal arrives.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from multicard.base.errors import ExitCode, Stopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
HANDLED_SIGNALS = (*STOP_SIGNALS, signal.SIGQUIT)  # every signal a GracefulStop handles
POLL_EVERY = 8  # optimizer steps between agreements on a pending stop


def quit_now(signum: int, stacks: bool) -> None:
    """Exit 128 + signum at once (no checkpoint; a half-written one is never renamed into
    place), after dumping every thread's stack to stderr if asked."""
    if stacks:
        print(f"multicard: quit by {signal.Signals(signum).name} without a checkpoint; stacks follow", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    else:
        print(quit_line(signum), file=sys.stderr)
    sys.stderr.flush()
    os._exit(ExitCode.for_signal(signum))


def quit_line(signum: int) -> str:
    """What a process that quits at once, without a checkpoint, says (a worker, or the launcher)."""
    return f"multicard: quit by {signal.Signals(signum).name} without a checkpoint; the last checkpoint written stays"


class Handlers:
    """Signal handlers a multicard object installs for this process alone; `_previous` holds
    those they replaced. A process forked from this one (a user's helper, a data-loader process)
    gets those back (_forget_in_child): there, ours would only record a stop nobody acts on, and a
    plain `kill` would no longer end it."""

    _previous: dict[int, Any]


def _forget_in_child() -> None:
    for sig in HANDLED_SIGNALS:
        handler = signal.getsignal(sig)
        replaced = False
        while isinstance(owner := getattr(handler, "__self__", None), Handlers):
            handler, replaced = owner._previous.get(sig, signal.SIG_DFL), True
        if replaced:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: one set outside Python


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class StoppedBeforeTraining(Stopped):
    """A stop signal before training started (or after it ended): nothing was left to save."""

    def __init__(self, signum: int, after: bool) -> None:
        super().__init__(signum, step=0)
        self.after = after

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.after:
            return f"stopped by {name} after training ended; its checkpoints are written"
        return f"stopped by {name} before training started; nothing to save"


class BeforeTraining(Handlers):
    """Stop signals that arrive before training takes them over (a GracefulStop, or the launcher's
    relay) end the command in one line, not silently by the signal's default action."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)  # SIGINT: KeyboardInterrupt says it

    def __init__(self) -> None:
        self.handed_over = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> BeforeTraining:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise StoppedBeforeTraining(signum, after=self.handed_over)


def hand_over(previous: Any) -> None:
    """Tell a BeforeTraining whose handler `previous` is that training has taken the signals over."""
    guard = getattr(previous, "__self__", None)
    if isinstance(guard, BeforeTraining):
        guard.handed_over = True


class GracefulStop(Handlers):
    def __init__(
        self, agree_max: Callable[[int], Callable[[], int]], every: int = POLL_EVERY, announce: bool = True
    ) -> None:
        """`agree_max(v)` starts a max-reduction of v over ranks and returns its waiter;
        `announce`: say on stdout that a stop is coming (one rank does)."""
        self.agree_max = agree_max
        self.every = every
        self.announce = announce
        self.signum = 0
        self._polls = 0
        self._pending: Callable[[], int] | None = None
        self._previous: dict[int, Any] = {}
        self.ended: bool | None = None  # training over: None not yet, True complete, False left early
        self.failed = False  # it ended on an error (the process is ending with it)

    def __enter__(self) -> GracefulStop:
        for sig in HANDLED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
            hand_over(self._previous[sig])
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, Stopped):
            return  # stopping: keep handling signals until exit (a second Ctrl-C still quits at once)
        for sig, handler in self._previous.items():
            if self.ended is None or sig == signal.SIGINT:  # else a stop after training ends with its line
                signal.signal(sig, handler)
        if self._pending is not None and exc_type is None:
            self._pending()  # a clean end: complete the collective every rank started
        self._pending = None

    def training_ended(self, complete: bool, failed: bool = False) -> None:
        """From here on a stop signal has nothing left to save: it ends the process at once, with
        one line, 0 if training completed (every step and its checkpoint done), else 128 + the
        signal; `failed`: training ended on an error, which has said so (the process is ending)."""
        self.ended, self.failed = complete, failed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGQUIT:
            quit_now(signum, stacks=True)
        if self.ended is not None and signum != signal.SIGINT:
            self._after_training(signum)
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            quit_now(signum, stacks=False)  # a second Ctrl-C: do not wait for the checkpoint
        if not self.signum and self.announce:
            again = "; Ctrl-C again to quit at once, without it" if signum == signal.SIGINT else ""
            name = signal.Signals(signum).name
            print(f"multicard: {name}: stopping with a checkpoint within {self.every + 1} steps{again}", flush=True)
        self.signum = self.signum or signum

    def _after_training(self, signum: int) -> None:
        if self.failed:  # its error is being reported: end now, as the signal would
            sys.stderr.flush()
            os._exit(ExitCode.for_signal(signum))
        name = signal.Signals(signum).name
        done = "training is complete" if self.ended else "training had ended; rerun to continue it"
        if self.announce:  # one rank says it
            print(f"multicard: {name} after the last step: {done}, its checkpoints are written", file=sys.stderr)
        raise SystemExit(0 if self.ended else ExitCode.for_signal(signum))

    def poll(self) -> int:
        """Call once per optimizer step, on every rank: the signal all ranks agreed on (0: go on)."""
        agreed = 0
        if self._pending is not None:
            agreed = self._pending()
            self._pending = None
        if self._polls % self.every == 0:
            self._pending = self.agree_max(self.signum)
        self._polls += 1
        return agreed
