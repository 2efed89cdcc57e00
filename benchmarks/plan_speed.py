"""How long `multicard plan` takes: ResNet-50 and ViT-L/16 on 8× H100, every strategy, each a
fresh process (Python start-up and imports included), wall time against the 30 s target.

    python benchmarks/plan_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 30.0
CASES = [("resnet50", ["model.name=resnet50", "data.image_size=224"]),
         ("vit_l_16", ["model.name=vit_l_16", "data.image_size=224"])]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    worst = 0.0
    for name, overrides in CASES:
        times = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="plan-speed-") as out:
                argv = [sys.executable, "-m", "multicard", "plan", "--gpu", "h100", "--gpus", "8", "--json",
                        "--out", out, *overrides]  # fmt: skip
                start = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True)
                times.append(time.perf_counter() - start)
        worst = max(worst, max(times))
        print(f"{name} on 8× H100: median {statistics.median(times):.1f} s, max {max(times):.1f} s "
              f"({max(times) / TARGET_S:.2f} of the {TARGET_S:.0f} s target); load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)  # fmt: skip
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
