"""Faults injected into one rank of a real multicard job, for the stall and straggler tests.

Python imports `sitecustomize` at start-up from the path: tests put this folder on PYTHONPATH
and choose a fault with MULTICARD_FAULT (on rank MULTICARD_FAULT_RANK, default 1, from optimizer
step MULTICARD_FAULT_STEP; rank 0 is also the one process of a run without a launcher). multicard
itself has no hook for this: the fault is patched in here.

- data: the rank's data loader blocks for good;
- skip: the rank skips the metrics all-reduce the others enter, and then blocks elsewhere;
- slow-data: the rank's data loader takes MULTICARD_FAULT_MS longer per batch (a straggler);
- slow-steps: every optimizer step of the rank takes MULTICARD_FAULT_MS longer, whatever the loader
  (a short job that lasts long enough for a test to act while it runs, at little CPU); with
  MULTICARD_FAULT_ALONE_STEPS=K, a process of a job at world size 1 (an elastic job that lost its other
  nodes) takes K steps, then waits before each next one until it gets a stop signal (a node joins:
  its agent stops the workers to re-form), so the job cannot end before a returning node joins it;
  with MULTICARD_FAULT_KILL_SAVE=N, the background write of the checkpoint of step N
  (checkpoint.async_save) kills its process (SIGKILL) before it writes: a process lost while its
  durable copy was being written;
- slow-stop: as slow-steps, and the checkpoint of a stop on a signal waits MULTICARD_FAULT_STOP_S
  first, asleep (a stop that needs longer than a launcher might give it);
- slow-start: the process sleeps MULTICARD_FAULT_MS before anything else, with signals at their
  defaults (a run signalled before training starts).
When a blocking fault fires, a slow stop begins or a slow start sleeps, the file MULTICARD_FAULT_MARK
is written (the test's clock starts).
"""

import os
import threading
import time
from pathlib import Path

FAULT = os.environ.get("MULTICARD_FAULT")
# No RANK: a run without a launcher (its one process is rank 0), or a launcher (which runs no step).
ON_THIS_RANK = os.environ.get("RANK", "0") == os.environ.get("MULTICARD_FAULT_RANK", "1")


def _block() -> None:
    _mark()
    threading.Event().wait()


def _mark() -> None:
    Path(os.environ["MULTICARD_FAULT_MARK"]).write_text(str(time.time()))


def _install() -> None:
    from multicard.data.loading.device import DeviceTrainLoader

    after = int(os.environ.get("MULTICARD_FAULT_STEP", "5"))
    if FAULT in ("data", "slow-data"):
        original = DeviceTrainLoader.__iter__
        delay = float(os.environ.get("MULTICARD_FAULT_MS", "0")) / 1000

        def batches(self):
            for i, batch in enumerate(original(self)):
                if FAULT == "data" and self.sampler.epoch * 10_000 + i >= after:
                    _block()
                time.sleep(delay)
                yield batch

        DeviceTrainLoader.__iter__ = batches
    elif FAULT in ("slow-steps", "slow-stop"):
        from multicard.engine.loop import Loop  # the one step of multicard train and of a user's loop (multicard.Run)

        original_step = Loop.optimizer_step
        pause = float(os.environ.get("MULTICARD_FAULT_MS", "0")) / 1000

        alone = os.environ.get("WORLD_SIZE") == "1" and "MULTICARD_FAULT_ALONE_STEPS" in os.environ
        taken = [0]

        def step(self, *args, **kwargs):
            time.sleep(pause)
            taken[0] += 1
            if alone and taken[0] > int(os.environ["MULTICARD_FAULT_ALONE_STEPS"]):
                while not self.stop.signum:  # a condition, polled: the agent's stop when a node joins
                    time.sleep(0.02)
            return original_step(self, *args, **kwargs)

        Loop.optimizer_step = step
        if "MULTICARD_FAULT_KILL_SAVE" in os.environ:
            _die_in_a_durable_write(int(os.environ["MULTICARD_FAULT_KILL_SAVE"]))
        if FAULT == "slow-stop":
            from multicard.checkpoint import Checkpointer

            original_on_stop = Checkpointer.on_stop

            def on_stop(self, trainer, stop):
                _mark()
                time.sleep(float(os.environ["MULTICARD_FAULT_STOP_S"]))
                return original_on_stop(self, trainer, stop)

            Checkpointer.on_stop = on_stop
    elif FAULT == "skip":
        from multicard.run.logbook import Logbook  # the run's one meter: its reduction of the records

        original_reduce = Logbook.reduce

        def reduce(self):
            if self.loop.position.global_step >= after:
                _block()  # never enters the all-reduce the other ranks wait in
            return original_reduce(self)

        Logbook.reduce = reduce


def _die_in_a_durable_write(step: int) -> None:
    import signal

    from multicard.base.store import LocalStore

    original = LocalStore.write_later
    fatal = f"step-{step:09d}.pt"

    def write_later(self, name, write):
        if name == fatal and write is not None:  # the durable write, after this node's own copy
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, write)

    LocalStore.write_later = write_later


if FAULT == "slow-start" and ON_THIS_RANK:
    _mark()
    time.sleep(float(os.environ["MULTICARD_FAULT_MS"]) / 1000)
elif FAULT and ON_THIS_RANK:
    _install()
