"""The wheel, installed as a user installs it: not editable, into a fresh virtual environment, used from
outside the source tree. `make test` builds the sdist and the wheel from it first (MULTICARD_WHEEL names
the wheel); run alone, this file builds a wheel of its own.

Installing torch afresh would take minutes and gigabytes, so the fresh environment reads its dependencies
(torch, omegaconf, ...) from this interpreter's site-packages through a .pth file, and only multicard
from the wheel: the tests check that multicard is imported from the wheel's copy, that no path of the
source tree is on its sys.path, and that the wheel's declared dependencies are met there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multicard.base.version import __version__

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
pytestmark = pytest.mark.slow


def titled_block(page: Path, title: str) -> str:
    """The code of the block titled `title` (```lang title="NAME") on a docs page, as a reader copies it."""
    match = re.search(rf'^```\w+ title="{re.escape(title)}"\n(.*?)^```', page.read_text(), re.M | re.S)
    assert match, f"{page.name} has no block titled {title}"
    return match.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if os.environ.get("MULTICARD_WHEEL"):
        return Path(os.environ["MULTICARD_WHEEL"]).resolve()
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--quiet", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return next(out.glob("multicard-*.whl"))


def in_source_tree(path: Path) -> bool:
    """The checkout itself, its src/ (an editable install's path) or its tests/."""
    return path == ROOT or path.is_relative_to(ROOT / "src") or path.is_relative_to(ROOT / "tests")


def dependency_paths() -> list[str]:
    """This interpreter's package folders (site-packages and what its .pth files add), without the
    source tree's and without the standard library (the fresh environment has its own)."""
    stdlib = {os.path.realpath(p) for p in sys.path if p.startswith(sys.base_prefix) and "site-packages" not in p}
    keep = []
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.isdir(real) and real not in stdlib and not in_source_tree(Path(real)):
            keep.append(real)
    return keep


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> Path:
    """A new virtual environment with the wheel installed by pip (not editable), then the dependency paths."""
    env_dir = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*install, "--disable-pip-version-check", str(wheel)], check=True, timeout=300)
    packages = Path(subprocess.check_output([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                            text=True).strip())  # fmt: skip
    (packages / "dev_dependencies.pth").write_text("\n".join(dependency_paths()) + "\n")
    return env_dir


def user_env(fresh: Path) -> dict[str, str]:
    """A user's shell with the fresh environment first on PATH, nothing of this checkout in it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": f"{fresh / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(fresh)}


def run(fresh: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=user_env(fresh), capture_output=True, text=True, timeout=300)


def test_multicard_is_imported_from_the_wheels_install_not_the_source_tree(fresh, tmp_path):
    probe = (
        "import importlib.metadata as md, json, sys, multicard, multicard.cli.main\n"
        "dist = md.distribution('multicard')\n"
        "print(json.dumps({'file': multicard.__file__, 'version': multicard.__version__, 'path': sys.path,\n"
        "  'finders': [type(f).__module__ for f in sys.meta_path], 'dist_version': dist.version,\n"
        "  'dist_at': str(dist.locate_file('')), 'direct_url': dist.read_text('direct_url.json'),\n"
        "  'requires': dist.requires}))\n"
    )  # fmt: skip
    done = run(fresh, tmp_path, str(fresh / "bin" / "python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    packages = Path(seen["dist_at"]).resolve()
    assert packages.is_relative_to(fresh.resolve()), packages
    assert Path(seen["file"]).resolve().is_relative_to(packages), seen["file"]
    assert seen["version"] == seen["dist_version"] == __version__
    assert '"editable": true' not in (seen["direct_url"] or ""), "installed editable"
    source = [p for p in seen["path"] if p and in_source_tree(Path(p).resolve())]
    assert not source, f"the source tree is on the path: {source}"
    assert not [f for f in seen["finders"] if "editable" in f], seen["finders"]
    assert any(r.startswith("torch") for r in seen["requires"])


def test_the_wheels_dependencies_are_met_in_its_environment(fresh, tmp_path):
    check = (
        "import importlib.metadata as md\n"
        "from packaging.requirements import Requirement\n"
        "for line in md.requires('multicard'):\n"
        "    r = Requirement(line)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        v = md.version(r.name)\n"
        "        assert r.specifier.contains(v, prereleases=True), f'{r} but {v} is installed'\n"
        "        print(r.name, v)\n"
    )
    done = run(fresh, tmp_path, str(fresh / "bin" / "python"), "-c", check)
    assert done.returncode == 0, done.stderr
    assert {line.split()[0] for line in done.stdout.splitlines()} >= {"torch", "torchvision", "omegaconf", "rich"}


def test_installed_command_prints_its_help_and_version(fresh, tmp_path):
    helped = run(fresh, tmp_path, "multicard", "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("train", "run", "eval", "export", "plan", "bench", "verify", "pack", "input-split", "report"):
        assert re.search(rf"^\s+{command}\s", helped.stdout, re.M), command
    assert "multicard.Run" in helped.stdout
    version = run(fresh, tmp_path, "multicard", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"multicard {__version__}")


def test_quickstart_commands_run_from_the_wheel(fresh, tmp_path):
    """docs/quickstart.md's first_run.sh: train on the embedded data, evaluate the best checkpoint, export it."""
    (tmp_path / "first_run.sh").write_text(titled_block(QUICKSTART, "first_run.sh"))
    done = run(fresh, tmp_path, "bash", "-e", "first_run.sh")
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"top1"')))
    assert scores["samples"] == 256 and 0 <= scores["top1"] <= 100
    assert (tmp_path / "runs" / "first" / "model.pt").stat().st_size > 0
    assert (tmp_path / "runs" / "first" / "config.yaml").exists()


def test_quickstart_script_runs_from_the_wheel(fresh, tmp_path):
    """docs/quickstart.md's quickstart_run.py, a complete multicard.Run script: it learns, then a second
    run of it resumes from its checkpoint and finds the run complete."""
    (tmp_path / "quickstart_run.py").write_text(titled_block(QUICKSTART, "quickstart_run.py"))
    done = run(fresh, tmp_path, str(fresh / "bin" / "python"), "quickstart_run.py")
    assert done.returncode == 0, done.stderr[-3000:]
    mse = float(re.search(r"validation MSE ([0-9.]+) over 512 points", done.stdout).group(1))
    assert mse < 0.05, done.stdout  # sin(x) on [-3, 3] has a variance of about 0.5: it learned
    again = run(fresh, tmp_path, str(fresh / "bin" / "python"), "quickstart_run.py")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    assert f"validation MSE {mse:.4f}" in again.stdout
