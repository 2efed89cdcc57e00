"""Summarise a GPU check directory: summary.json, summary.md (a short table), the table on stdout.

Reads what scripts/gpu_check.sh left in OUT_DIR: cuda_tests.xml (pytest's JUnit report),
matrix/matrix.json (matrix.py), throughput/throughput.json (throughput.py),
gpu_decode/gpu_decode.json (gpu_decode.py), plan_check/plan_check.json (plan_check.py)
and steps.json (each step's exit code and seconds). Needs only torch and the standard library,
so it reports even when multicard's own dependencies are missing.

    python scripts/gpu_check/summary.py OUT_DIR
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

TARGETS = {  # name → (what, comparison, bound)
    "mfu": ("resnet18_cifar bf16 model FLOP utilisation", ">=", 0.30),
    "loader_share": ("device loader share of step time", "<=", 0.03),
    "vs_single": ("dp and ddp on one GPU, img/s over single", ">=", 0.95),
}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def environment() -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "commit": commit or None,
    }


def cuda_tests(report: Path) -> dict:
    """Counts and the names of failed and skipped tests (with the skip reasons)."""
    if not report.is_file():
        return {"status": "missing", "reason": f"{report.name} was not written"}
    out: dict = {"passed": 0, "failed": [], "skipped": []}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name', '?')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            out["failed"].append(f"{name}: {message[0][:200] if message else ''}")
        elif (skip := case.find("skipped")) is not None:
            out["skipped"].append(f"{name}: {skip.get('message', '')}")
        else:
            out["passed"] += 1
    out["status"] = "failed" if out["failed"] else "passed" if out["passed"] else "skipped"
    return out


def targets(matrix: dict | None, throughput: dict | None) -> list[dict]:
    values = {}
    if throughput and throughput.get("status") == "passed":
        values["mfu"] = throughput.get("mfu")
        values["loader_share"] = throughput.get("loader_share")
    one_gpu = matrix and matrix.get("gpus") == 1
    ratios = [r["vs_single"] for r in (matrix or {}).get("runs", []) if r["strategy"] != "single" and r["vs_single"]]
    if one_gpu and ratios:
        values["vs_single"] = min(ratios)
    out = []
    for key, (what, op, bound) in TARGETS.items():
        value = values.get(key)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out.append({"target": key, "what": what, "bound": f"{op} {bound}", "value": value, "met": met})
    return out


def _cell(run: dict) -> str:
    if run["status"] == "skipped":
        return "skipped"
    if run["status"] == "failed":
        return f"FAILED ({run['reason'][:60]})"
    ratio = f" ({run['vs_single']:.2f}×)" if run.get("vs_single") and run["strategy"] != "single" else ""
    return f"{run['img_per_s']:,.0f}{ratio}" if run["img_per_s"] else "passed"


def _not_passed(result: dict | None, name: str) -> list[str] | None:
    if result is None:
        return [f"not run ({name} missing)"]
    if result.get("status") != "passed":
        return [f"{result.get('status', '?')}: {result.get('reason', '')}"]
    return None


def _decode_lines(d: dict | None) -> list[str]:
    if (early := _not_passed(d, "gpu_decode.json")) is not None:
        return early
    assert d is not None
    cpu, gpu = d["cpu"]["img_per_s"], d["gpu"]["img_per_s"]
    return [f"{d['photos']} photos, batch {d['batch']}, {d['workers']} workers: CPU decode {cpu:,.0f} img/s, "
            f"GPU decode {gpu:,.0f} img/s ({d['gpu_over_cpu']}×)"]  # fmt: skip


def _plan_lines(p: dict | None) -> list[str]:
    if (early := _not_passed(p, "plan_check.json")) is not None:
        return early
    assert p is not None
    pred, meas = p["predicted"], p["measured"]
    return [
        f"tensor memory: planned {pred['tensor_bytes'] / 2**30:.2f} GiB, max_memory_allocated "
        f"{meas['peak_bytes'] / 2**30:.2f} GiB (ratio {p.get('memory_ratio')})",
        f"step: planned {pred['step_s'] * 1000:.0f} ms, measured {meas['step_s'] * 1000:.0f} ms "
        f"(ratio {p.get('time_ratio')})",
        f"largest micro-batch: planned {pred['largest_micro_batch']}, probed: ran up to {p.get('largest_ran')}, "
        f"first failure at {p.get('smallest_failed')}",
    ]


def table(summary: dict) -> str:
    env, tests, matrix, tp = summary["environment"], summary["cuda_tests"], summary["matrix"], summary["throughput"]
    gpus = ", ".join(env["gpus"]) or "no CUDA device"
    lines = [f"GPU check {env['date']}: {gpus}; torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}", ""]
    if tests.get("status") == "missing":
        lines.append(f"(a) CUDA tests: not run ({tests['reason']})")
    else:
        lines.append(f"(a) CUDA tests: {tests['passed']} passed, {len(tests['failed'])} failed, "
                     f"{len(tests['skipped'])} skipped")  # fmt: skip
        lines += [f"    FAILED {name}" for name in tests["failed"]]
        reasons = sorted({s.split(": ", 1)[-1] for s in tests["skipped"]})
        lines += [f"    skipped: {reason}" for reason in reasons]
    lines += ["", "(b) every GPU path, steady img/s (× single per GPU)", ""]
    if matrix is None:
        lines.append("not run (matrix.json missing)")
    else:
        cols = [("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True)]
        lines += ["| strategy | fp32 | bf16 | fp16 | bf16 + compile |", "|---|---|---|---|---|"]
        runs = {(r["strategy"], r["precision"], r["compile"]): r for r in matrix["runs"]}
        for strategy in ("single", "dp", "ddp"):
            cells = [_cell(runs[(strategy, p, c)]) if (strategy, p, c) in runs else "—" for p, c in cols]
            lines.append(f"| {strategy} | {' | '.join(cells)} |")
        reasons = sorted({r["reason"] for r in matrix["runs"] if r["status"] == "skipped"})
        lines += [f"skipped: {reason}" for reason in reasons]
    lines += ["", "(c) resnet18_cifar 32×32, batch 512, bf16, channels_last, compiled, device loader"]
    if tp is None:
        lines.append("not run (throughput.json missing)")
    elif tp.get("status") != "passed":
        lines.append(f"{tp.get('status', '?')}: {tp.get('reason', '')}")
    else:
        mfu = f"{100 * tp['mfu']:.1f}%" if tp.get("mfu") is not None else f"n/a ({tp.get('mfu_reason')})"
        lines.append(f"{tp['img_per_s']:,.0f} img/s, {tp['step_ms']} ms/step, {tp['gflop_per_image']} GFLOP/image, "
                     f"{tp['achieved_tflops']} TFLOP/s, MFU {mfu}; loader {tp['loader_ms']} ms/batch = "
                     f"{100 * tp['loader_share']:.2f}% of a step; peak memory {tp['peak_mem_mb']} MB")  # fmt: skip
    lines += ["", "(d) JPEG decode of the ImageNet sample, CPU workers vs GPU (nvjpeg)"]
    lines += _decode_lines(summary.get("gpu_decode"))
    lines += ["", "(e) multicard plan vs measured: vit_b_16 224×224 bf16, one GPU"]
    lines += _plan_lines(summary.get("plan_check"))
    lines += ["", "targets:"]
    for t in summary["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = "" if t["value"] is None else f" {t['value']}"
        lines.append(f"  {t['what']} {t['bound']}:{value} {verdict}")
    steps = summary.get("steps") or {}
    if steps:
        lines += ["", "steps: " + ", ".join(f"{k} {v['seconds']} s (exit {v['rc']})" for k, v in steps.items())]
    return "\n".join(lines)


def main() -> int:
    out = Path(sys.argv[1])
    matrix = _read_json(out / "matrix" / "matrix.json")
    throughput = _read_json(out / "throughput" / "throughput.json")
    summary = {
        "environment": environment(),
        "steps": _read_json(out / "steps.json"),
        "cuda_tests": cuda_tests(out / "cuda_tests.xml"),
        "matrix": matrix,
        "throughput": throughput,
        "gpu_decode": _read_json(out / "gpu_decode" / "gpu_decode.json"),
        "plan_check": _read_json(out / "plan_check" / "plan_check.json"),
        "targets": targets(matrix, throughput),
    }
    text = table(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(text + "\n")
    print(text)
    failed = summary["cuda_tests"].get("failed") or any(r["status"] == "failed" for r in (matrix or {}).get("runs", []))
    others = (throughput, summary["gpu_decode"], summary["plan_check"])
    return 1 if failed or any((r or {}).get("status") == "failed" for r in others) else 0


if __name__ == "__main__":
    sys.exit(main())
