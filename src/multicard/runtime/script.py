"""A user's script run in this process as `python SCRIPT ARGS` runs it (`multicard run`, in one
process or in each worker), so that the process can then end as every multicard process ends
(exits.run_to_the_end) rather than in the interpreter's finalization.

What the script sees is what `python SCRIPT` gives it: sys.argv (its path as typed, then its
arguments), `__name__ == "__main__"` in a module of its own that stays sys.modules["__main__"]
(pickling its classes works, also in exit handlers), `__file__` as an absolute path, and its folder
(symbolic links resolved) first on sys.path in place of the entry's, so its sibling modules import
from any working directory. A folder or zip file with a __main__.py runs as `python FOLDER` runs it.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types
import zipfile
from importlib.machinery import SourceFileLoader


def run_script(path: str, args: list[str]) -> None:
    """Run the script at `path` (a Python file, or a folder or zip file with a __main__.py) with
    `args` as its arguments, in this process; what it raises (SystemExit included) propagates."""
    sys.argv = [path, *args]
    if os.path.isdir(path) or zipfile.is_zipfile(path):
        _set_path_entry(None)  # runpy puts the folder or zip file first, as python does
        runpy.run_path(path, run_name="__main__")
        return
    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # as python: not normalised
    _set_path_entry(os.path.dirname(os.path.realpath(filename)))
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=filename, __cached__=None, __builtins__=builtins, __loader__=SourceFileLoader("__main__", filename)
    )
    sys.modules["__main__"] = main
    with io.open_code(filename) as f:
        code = compile(f.read(), filename, "exec", dont_inherit=True)  # not this module's __future__ flags
    exec(code, main.__dict__)


def from_the_script(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` from the script's own first frame on, where run_script ran it: its traceback then reads
    as under `python SCRIPT`, without the frames of multicard's entry above it (none at all for a
    script python cannot compile: python shows only where); else `tb` itself."""
    entry = tb
    while entry is not None:
        if entry.tb_frame.f_code is run_script.__code__:
            return entry.tb_next
        entry = entry.tb_next
    return tb


def _set_path_entry(folder: str | None) -> None:
    """sys.path[0], which python set to the entry's folder (the console script's, or the working
    directory under `python -m`), becomes the script's `folder`; None: removed. Under `python -P`
    (PYTHONSAFEPATH) python puts none there, for a script neither."""
    if sys.version_info >= (3, 11) and sys.flags.safe_path:  # -P came with 3.11 (3.10 has no such flag)
        return
    if folder is None:
        del sys.path[0]
    else:
        sys.path[0] = folder
