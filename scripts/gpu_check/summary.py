"""Summarise a GPU check: OUT/summary.json and OUT/summary.md (a short report), from what the
steps left in WORK: preflight/preflight.json (versions, GPU), steps.jsonl (each step's outcome,
seconds and limit), throughput/throughput.json, proofs/proofs.json, cuda_tests.xml (pytest's
JUnit report), matrix/matrix.json, gpu_decode/gpu_decode.json, plan_check/plan_check.json.

Standard library only, and every file and value may be missing or None (a step cut short, a
number not measured): it always writes both files. gpu_check.sh runs it after every step (with
--step NAME: it prints that step's outcome line) and at the end (--print: the whole summary).

A step passes on evidence alone: one that exited 0 (status "ran" in steps.jsonl) passed, was
skipped or failed as its result file says, and failed without one. Exit 1 when something failed,
5 when nothing was checked (no step after the preflight passed: every one skipped), else 0.

    python scripts/gpu_check/summary.py WORK OUT [--print] [--step NAME]
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

FAILED, NOTHING_CHECKED = 1, 5  # gpu_check.sh's exit codes (its header)
RESULTS = {  # each step → the result file it writes in WORK (preflight's is the environment)
    "preflight": "preflight/preflight.json",
    "throughput": "throughput/throughput.json",
    "proofs": "proofs/proofs.json",
    "cuda_tests": "cuda_tests.xml",
    "matrix": "matrix/matrix.json",
    "gpu_decode": "gpu_decode/gpu_decode.json",
    "plan_check": "plan_check/plan_check.json",
}
OUTCOMES = ("passed", "skipped", "failed")
TARGETS = {  # name → (what, comparison, bound)
    "mfu": ("resnet18_cifar bf16 model FLOP utilisation", ">=", 0.30),
    "loader_share": ("device loader share of step time", "<=", 0.03),
    "vs_single": ("dp and ddp on one GPU, img/s over single", ">=", 0.95),
}


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill: the others still count
    return steps


def num(value: Any, spec: str = ",.0f", suffix: str = "") -> str:
    """`value` formatted, or n/a for None or anything not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def cuda_tests(report: Path) -> dict:
    """Counts and the names of failed and skipped tests (with the skip reasons)."""
    if not report.is_file():
        return {"status": "missing", "reason": f"{report.name} was not written"}
    try:
        cases = list(ET.parse(report).getroot().iter("testcase"))
    except ET.ParseError as exc:
        return {"status": "failed", "reason": f"{report.name} is not readable XML ({exc})"}
    out: dict = {"passed": 0, "failed": [], "skipped": []}
    for case in cases:
        if case.get("name") is None:  # the test running when pytest was interrupted (SIGINT at the limit)
            out["interrupted"] = True
            continue
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
    values: dict[str, Any] = {}
    if isinstance(throughput, dict) and throughput.get("status") == "passed":
        values["mfu"], values["loader_share"] = throughput.get("mfu"), throughput.get("loader_share")
    runs = (matrix or {}).get("runs") or []
    ratios = [r.get("vs_single") for r in runs if r.get("strategy") != "single" and r.get("vs_single")]
    if (matrix or {}).get("gpus") == 1 and ratios:
        values["vs_single"] = min(ratios)
    out = []
    for key, (what, op, bound) in TARGETS.items():
        value = values.get(key)
        met = None if not isinstance(value, int | float) else (value >= bound if op == ">=" else value <= bound)
        out.append({"target": key, "what": what, "bound": f"{op} {bound}", "value": value, "met": met})
    return out


def status_line(result: dict | None, name: str) -> str | None:
    """The line for a result that did not pass (None when it passed)."""
    if not isinstance(result, dict):
        return f"not run ({name} missing)"
    if result.get("status") != "passed":
        return f"{result.get('status', '?')}: {result.get('reason', '')}"
    return None


def throughput_lines(tp: dict | None) -> list[str]:
    if (line := status_line(tp, "throughput.json")) is not None:
        return [line]
    assert tp is not None
    mfu = num(tp.get("mfu"), ".1%") if tp.get("mfu") is not None else f"n/a ({tp.get('mfu_reason', 'not measured')})"
    return [f"{num(tp.get('img_per_s'))} img/s, {num(tp.get('step_ms'), '.2f')} ms/step, "
            f"{num(tp.get('gflop_per_image'), '.3f')} GFLOP/image, {num(tp.get('achieved_tflops'), '.1f')} TFLOP/s, "
            f"MFU {mfu}; loader {num(tp.get('loader_ms'), '.3f')} ms/batch = {num(tp.get('loader_share'), '.2%')} "
            f"of a step; peak memory {tp.get('peak_mem_mb') or 'n/a'} MB"]  # fmt: skip


def proof_lines(proofs: dict | None) -> list[str]:
    rows = (proofs or {}).get("rows")
    if not rows:
        return ["not run (proofs.json missing)"]
    out = []
    for r in rows:
        details = {k: v for k, v in r.items() if k not in ("name", "status", "reason", "wall_s")}
        said = r.get("reason") if r.get("status") != "passed" else json.dumps(details)[:160]
        seconds = f" ({num(r.get('wall_s'), '.1f', ' s')})" if r.get("wall_s") is not None else ""
        out.append(f"- {r.get('name', '?')}: {str(r.get('status', '?')).upper()}{seconds} {said}")
    return out


def test_lines(tests: dict) -> list[str]:
    if tests.get("status") == "missing" or "passed" not in tests:
        return [f"not run ({tests.get('reason', '')})"]
    cut = " (interrupted at the step's time limit: the rest did not run)" if tests.get("interrupted") else ""
    lines = [f"{tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped{cut}"]
    lines += [f"    FAILED {name}" for name in tests["failed"]]
    lines += [f"    skipped: {reason}" for reason in sorted({s.split(": ", 1)[-1] for s in tests["skipped"]})]
    return lines


def _cell(run: dict) -> str:
    if run.get("status") == "skipped":
        return "skipped"
    if run.get("status") == "failed":
        return f"FAILED ({str(run.get('reason', ''))[:60]})"
    ratio = f" ({run['vs_single']:.2f}×)" if run.get("vs_single") and run.get("strategy") != "single" else ""
    return f"{num(run.get('img_per_s'))}{ratio}" if run.get("img_per_s") else "passed"


def matrix_lines(matrix: dict | None) -> list[str]:
    if not isinstance(matrix, dict):
        return ["not run (matrix.json missing)"]
    cols = [("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True)]
    lines = ["| strategy | fp32 | bf16 | fp16 | bf16 + compile |", "|---|---|---|---|---|"]
    runs = {(r.get("strategy"), r.get("precision"), r.get("compile")): r for r in matrix.get("runs") or []}
    for strategy in ("single", "dp", "ddp"):
        cells = [_cell(runs[(strategy, p, c)]) if (strategy, p, c) in runs else "—" for p, c in cols]
        lines.append(f"| {strategy} | {' | '.join(cells)} |")
    reasons = sorted({str(r.get("reason")) for r in runs.values() if r.get("status") == "skipped"})
    return lines + [f"skipped: {reason}" for reason in reasons]


def decode_lines(d: dict | None) -> list[str]:
    if (line := status_line(d, "gpu_decode.json")) is not None:
        return [line]
    assert d is not None
    cpu, gpu = (d.get("cpu") or {}).get("img_per_s"), (d.get("gpu") or {}).get("img_per_s")
    return [f"{d.get('photos')} photos ({d.get('root')}), batch {d.get('batch')}, {d.get('workers')} workers: "
            f"CPU decode {num(cpu)} img/s, GPU decode {num(gpu)} img/s "
            f"({num(d.get('gpu_over_cpu'), '.2f', '×')})"]  # fmt: skip


def plan_lines(p: dict | None) -> list[str]:
    if (line := status_line(p, "plan_check.json")) is not None:
        return [line]
    assert p is not None
    pred, meas = p.get("predicted") or {}, p.get("measured") or {}
    gib = 2**30
    return [
        f"tensor memory: planned {num((pred.get('tensor_bytes') or 0) / gib, '.2f')} GiB, max_memory_allocated "
        f"{num((meas.get('peak_bytes') or 0) / gib, '.2f')} GiB (ratio {num(p.get('memory_ratio'), '.3f')})",
        f"step: planned {num((pred.get('step_s') or 0) * 1000)} ms, measured {num((meas.get('step_s') or 0) * 1000)} "
        f"ms (ratio {num(p.get('time_ratio'), '.3f')})",
        f"largest micro-batch: planned {pred.get('largest_micro_batch')}, probed: ran up to {p.get('largest_ran')}, "
        f"first out of memory at {p.get('smallest_failed')}",
    ]


def table(s: dict) -> str:
    env = s.get("environment") or {}
    gpus = ", ".join(env.get("gpus") or []) or "no CUDA device"
    lines = [f"# GPU check {env.get('date', '')}: {gpus}", "", f"**{s['verdict']['line']}**", "",
             f"torch {env.get('torch')} (CUDA {env.get('cuda')}), torchvision {env.get('torchvision')}, "
             f"Python {env.get('python')}, omegaconf {env.get('omegaconf')}", ""]  # fmt: skip
    if env.get("failed_imports"):
        lines += [f"preflight: cannot import {k}: {v}" for k, v in env["failed_imports"].items()] + [""]
    lines += ["| step | outcome | seconds | limit s | note |", "|---|---|---|---|---|"]
    for step in s.get("steps") or []:
        lines.append(f"| {step.get('name')} | {step.get('status')} | {step.get('seconds')} | {step.get('limit_s')} "
                     f"| {step.get('reason', '')} |")  # fmt: skip
    sections = [
        ("(1) resnet18_cifar 32×32, batch 512, bf16, channels_last, compiled, device loader",
         throughput_lines(s.get("throughput"))),
        ("(2) what one GPU proves", proof_lines(s.get("proofs"))),
        ("(3) CUDA tests", test_lines(s.get("cuda_tests") or {})),
        ("(4) every GPU path, steady img/s (× single per GPU)", matrix_lines(s.get("matrix"))),
        ("(5) JPEG decode, CPU workers vs GPU (nvjpeg)", decode_lines(s.get("gpu_decode"))),
        ("(6) multicard plan vs measured: vit_b_16 224×224 bf16, one GPU", plan_lines(s.get("plan_check"))),
    ]  # fmt: skip
    for title, body in sections:
        lines += ["", f"## {title}", "", *body]
    lines += ["", "## targets", ""]
    for t in s.get("targets") or []:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"- {t['what']} {t['bound']}: {'' if t['value'] is None else t['value']} {verdict}")
    return "\n".join(lines)


def _rows_evidence(rows: list, file: str) -> tuple[str, str]:
    """A step of rows (proofs, matrix) passed when one row passed and none failed."""
    if not rows:
        return "failed", f"{file} holds no rows"
    bad = [r for r in rows if r.get("status") not in ("passed", "skipped")]
    if bad:
        return "failed", f"{len(bad)} of {len(rows)} failed, first {bad[0].get('name')}: {bad[0].get('reason', '')}"
    passed = sum(r.get("status") == "passed" for r in rows)
    if passed:
        return "passed", f"{passed} of {len(rows)} passed, {len(rows) - passed} skipped"
    return "skipped", "; ".join(sorted({str(r.get("reason", "")) for r in rows}))


def _tests_evidence(tests: dict) -> tuple[str, str]:
    if tests.get("status") == "missing":
        return "failed", f"exited 0 but {tests.get('reason')}"
    if tests.get("failed") or tests.get("status") not in OUTCOMES:
        failures = tests.get("failed") or [tests.get("reason", "")]
        return "failed", f"{len(failures)} failed, first {failures[0]}"
    if tests.get("status") == "skipped":
        return "skipped", "; ".join(sorted({x.split(": ", 1)[-1] for x in tests.get("skipped", [])})) or "no tests ran"
    return "passed", f"{tests.get('passed')} passed, {len(tests.get('skipped', []))} skipped"


def evidence(name: str, s: dict) -> tuple[str, str]:
    """What a step that exited 0 did, from its result file alone: (passed | skipped | failed, why)."""
    file = RESULTS.get(name, "its result file").rsplit("/", 1)[-1]
    if name == "cuda_tests":
        return _tests_evidence(s.get("cuda_tests") or {})
    result = s.get("environment" if name == "preflight" else name)
    if not isinstance(result, dict) or name not in RESULTS:
        return "failed", f"exited 0 but wrote no {file}"
    if name == "preflight":
        return ("passed", "") if result.get("python") else ("failed", f"{file} holds no versions")
    if name in ("proofs", "matrix"):
        return _rows_evidence(result.get("rows" if name == "proofs" else "runs") or [], file)
    if result.get("status") not in OUTCOMES:
        return "failed", f"{file} gives no outcome (status {result.get('status')!r})"
    return result["status"], str(result.get("reason") or "")


def judged(step: dict, s: dict) -> dict:
    """The step as its evidence says: the shell's own skipped, failed and timed out stand; an exit 0
    ("ran") becomes what the step's result file says."""
    if step.get("status") in ("skipped", "failed", "timed out"):
        return step
    status, reason = evidence(str(step.get("name")), s)
    return {**step, "status": status, "reason": reason}


def summarise(work: Path) -> dict:
    read = {name: cuda_tests(work / path) if name == "cuda_tests" else read_json(work / path)
            for name, path in RESULTS.items()}  # fmt: skip
    s = {"environment": read.pop("preflight"), "steps": [], **read}
    s["targets"] = targets(s["matrix"], s["throughput"])
    s["steps"] = [judged(step, s) for step in read_steps(work / "steps.jsonl")]
    s["verdict"] = verdict(s)
    return s


def failed(s: dict) -> bool:
    """Whether any step, test or row failed (skipped and not measured are not failures)."""
    results = [s.get(k) for k in ("throughput", "gpu_decode", "plan_check")]
    rows = [*((s.get("proofs") or {}).get("rows") or []), *((s.get("matrix") or {}).get("runs") or [])]
    return (
        any(step.get("status") not in ("passed", "skipped") for step in s.get("steps") or [])
        or bool((s.get("cuda_tests") or {}).get("failed"))
        or any(isinstance(r, dict) and r.get("status") == "failed" for r in [*results, *rows])
    )


def verdict(s: dict) -> dict:
    """The check's exit code and its one line: failed, nothing checked (no step after the preflight
    passed), or passed."""
    steps = s.get("steps") or []
    checked = [step["name"] for step in steps if step.get("name") != "preflight" and step.get("status") == "passed"]
    if failed(s):
        bad = [f"{step.get('name')} {step.get('status')}" for step in steps if step.get("status") not in OUTCOMES[:2]]
        return {"exit": FAILED, "line": f"FAILED: {', '.join(bad) or 'a result says failed'} (summary.md says which)"}
    if not checked:
        why = sorted({str(step.get("reason")) for step in steps if step.get("name") != "preflight"})
        return {"exit": NOTHING_CHECKED, "line": "NOTHING CHECKED: no step after the preflight passed "
                f"({'; '.join(why) or 'none ran'}); a check that ran nothing is no pass"}  # fmt: skip
    return {"exit": 0, "line": f"passed: {', '.join(checked)} (each on its result file; skips below)"}


def step_line(s: dict, name: str) -> str:
    step = next((x for x in reversed(s.get("steps") or []) if x.get("name") == name), {})
    reason = f" ({step['reason']})" if step.get("reason") else ""
    return f"-- {name}: {step.get('status', 'not recorded')} in {step.get('seconds', 0)} s{reason}"


def main(argv: list[str]) -> int:
    work, out = Path(argv[0]), Path(argv[1])
    s = summarise(work)
    text = table(s)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    (out / "summary.md").write_text(text + "\n")
    if "--step" in argv:
        print(step_line(s, argv[argv.index("--step") + 1]))
    if "--print" in argv:
        print(text)
        print(f"gpu_check: {s['verdict']['line']}")
    return s["verdict"]["exit"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
