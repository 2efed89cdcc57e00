"""The GPU check's preflight (under a minute): import every module the steps use, print the
versions and the GPU, write preflight.json (the summary's environment) and skip.tsv (the steps
that cannot run here, each with the reason: a module only that step needs is missing), and exit with

    0  every module imports but those of skipped steps (and CUDA is usable, or REQUIRE_CUDA is not 1)
    3  a module cannot be imported: the message names it
    4  REQUIRE_CUDA=1 and torch sees no CUDA device

    python scripts/gpu_check/preflight.py OUT_JSON
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

MISSING, NO_CUDA = 3, 4
# Every step's script (they import the rest of multicard and torch), and the modules the steps'
# subprocesses import beyond them (`multicard train`/`eval`, fsdp, compile).
MODULES = ["torch", "torchvision", "numpy", "PIL", "yaml", "omegaconf", "rich", "multicard.cli.main",
           "multicard.cli.commands", "multicard.recipes.classifier", "multicard.strategy.fsdp", "multicard.checkpoint",
           "multicard.data.decoding.gpu_decode", "multicard.tools.plan.planner", "multicard.tools.plan.worker", "torch._dynamo",
           "torch.distributed.checkpoint", "torch.utils.flop_counter"]  # fmt: skip
STEP_SCRIPTS = ["throughput", "proofs", "matrix", "gpu_decode", "plan_check", "summary"]
# Modules one step alone needs (absent from a bare `pip install multicard`): without one, that step
# is skipped with the reason instead of the whole check stopping.
STEP_MODULES = {"pytest": "cuda_tests"}


def try_imports(names: list[str]) -> dict[str, str]:
    """missing or broken module → why, and which of `names` needed it (one entry per module)."""
    sys.path.insert(0, str(Path(__file__).parent))
    failed: dict[str, list] = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError and whatever a broken install raises at import
            culprit = getattr(exc, "name", None) or name
            failed.setdefault(culprit, [f"{type(exc).__name__}: {exc}", []])[1].append(name)
    return {module: f"{why} (needed by {', '.join(users)})" for module, (why, users) in failed.items()}


def step_skips() -> dict[str, str]:
    """step → why it is skipped (one line, no tab), for each module of STEP_MODULES that cannot be imported."""
    skips = {}
    for module, step in STEP_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # as in try_imports
            skips[step] = " ".join(f"cannot import {module}, which it needs ({type(exc).__name__}: {exc})".split())
    return skips


def versions() -> dict:
    out = {"python": platform.python_version(), "executable": sys.executable, "date": time.strftime("%Y-%m-%d %H:%M")}
    for name in ("torch", "torchvision", "numpy", "PIL", "omegaconf", "pytest"):
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module else None
    out["omegaconf_from"] = str(Path(sys.modules["omegaconf"].__file__).parent) if "omegaconf" in sys.modules else None
    try:  # torch.compile on CUDA: Triton builds a small C launcher at first use, with the C compiler
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["cc"] = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    torch = sys.modules.get("torch")
    if torch is not None:
        out["cuda"] = torch.version.cuda
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        if gpus:
            props = torch.cuda.get_device_properties(0)
            out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            out["capability"] = f"{props.major}.{props.minor}"
    return out


def main() -> int:
    out = Path(sys.argv[1])
    failed = try_imports(MODULES + STEP_SCRIPTS)
    skips = step_skips()
    env = versions()
    env["failed_imports"], env["skipped_steps"] = failed, skips
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "skip.tsv").write_text("".join(f"{step}\t{why}\n" for step, why in skips.items()))
    out.write_text(json.dumps(env, indent=1))  # last: its presence says the preflight finished
    for name, why in failed.items():
        print(f"gpu_check: error: cannot import {name}: {why}", file=sys.stderr, flush=True)
    for step, why in skips.items():
        print(f"gpu_check: {step} will be skipped: {why}", flush=True)
    said = ("failed_imports", "skipped_steps", "executable")  # said above, or too long for the line
    print("preflight: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in said))
    if failed:
        return MISSING
    if not env.get("gpus") and os.environ.get("REQUIRE_CUDA") == "1":
        print("gpu_check: error: REQUIRE_CUDA=1 but torch sees no CUDA device", file=sys.stderr)
        return NO_CUDA
    return 0


if __name__ == "__main__":
    sys.exit(main())
