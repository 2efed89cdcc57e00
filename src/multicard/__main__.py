import gc
import os
import sys

from multicard.base.errors import ExitCode
from multicard.cli.main import main
from multicard.runtime.environment import LAUNCHER_PID
from multicard.runtime.exits import end_in_time

if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a bug: its traceback is printed, then the process must end all the same
        end_in_time(ExitCode.INTERNAL)
        raise
    if os.environ.get(LAUNCHER_PID) == str(os.getpid()):
        # This process was the launcher: its workers have ended and its files are closed. It skips
        # the interpreter's and C++'s teardown, where the rendezvous store's thread can abort the
        # process ("terminate called without an active exception", pytorch#128821), seen once
        # after a stop here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Interpreter shutdown would walk every object torch's modules made (~0.7 s per process on
    # our CPUs); frozen, they are left to the OS. Exit handlers and thread joins still run.
    gc.freeze()
    end_in_time(code)  # a thread the user's code left running must not keep the process alive
    raise SystemExit(code)
