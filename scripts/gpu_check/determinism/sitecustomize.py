"""Deterministic CUDA kernels for the GPU check's bitwise resume rows (proofs.py puts this folder
on PYTHONPATH; Python imports `sitecustomize` at start-up). multicard has no such switch: its
default of no cuDNN autotuning repeats algorithm choices, not kernels with atomics.

It then runs tests/faults/sitecustomize.py (inert unless MULTICARD_FAULT is set), which the
interrupted run uses to slow its steps so that the signal lands mid-run.
"""

import runpy
from pathlib import Path

import torch

torch.backends.cudnn.benchmark = False
torch.backends.cudnn.deterministic = True
torch.use_deterministic_algorithms(True, warn_only=True)  # an op without such a kernel warns and shows in the log

runpy.run_path(str(Path(__file__).resolve().parents[3] / "tests" / "faults" / "sitecustomize.py"))
