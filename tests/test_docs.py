"""The documentation: its links and anchors resolve, the site builds with --strict, and its generated
references say what the code says (the API reference's `multicard.Run` arguments and defaults are the
signature's; the command-line reference holds every command and option of the parser)."""

from __future__ import annotations

import ast
import html
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import multicard
from multicard.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)
FENCED = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)


def test_links_and_anchors_of_readme_and_docs_resolve():
    problems, external = hooks.check_links()
    assert not problems, "\n".join(problems)
    assert all(re.match(r"^(https?://[^/\s]+|mailto:)", url) for url in external), external


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "CHANGELOG.md").write_text("# Changelog\n")
    (tmp_path / "docs" / "guide.md").write_text("# A guide\n\n## Its `first` part\n\nSee [the top](#a-guide).\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/guide.md#its-first-part) [gone](docs/nosuch.md) [bad anchor](docs/guide.md#second)\n"
        "`[in code](docs/nosuch.md)` [out](https://example.org/x)\n\n```\n[in a block](docs/nosuch.md)\n```\n"
    )
    problems, external = hooks.check_links(tmp_path)
    assert problems == [
        "README.md:1: docs/nosuch.md: no such file in the repository",
        "README.md:1: docs/guide.md#second: no heading with the anchor #second",
    ]
    assert external == ["https://example.org/x"]


def test_links_to_repository_files_become_paths_on_the_site():
    text = "[seed](../examples/seed) and [guide](data.md#packing) [`configs/demo.yaml`](../configs/demo.yaml)"
    assert hooks.for_the_site(text, "docs") == (
        "seed (`examples/seed`) and [guide](data.md#packing) `configs/demo.yaml`"
    )
    assert hooks.for_the_site("[guide](docs/data.md) [log](CHANGELOG.md)", ".") == (
        "[guide](data.md) [log](changelog.md)"
    )


def code_blocks() -> list[tuple[Path, str, str, str]]:
    """(page, language, fence attributes, code) of every fenced block with a language in the docs."""
    return [(page, *block.groups()) for page in hooks.pages() for block in FENCED.finditer(page.read_text())]


def test_titled_code_blocks_are_files_a_test_runs():
    """A block with a file name (title="NAME") is a complete file: a test reads it from its page by that name."""
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py")
    titled = [
        (page.name, m.group(1)) for page, _, attrs, _ in code_blocks() if (m := re.search(r'title="([^"]+)"', attrs))
    ]
    assert titled, "the quick start's files are titled blocks"
    untested = [f"{page}: {title}" for page, title in titled if f'"{title}"' not in tests]
    assert not untested, f"titled blocks no test runs: {untested}"


def test_python_fragments_are_python():
    for page, language, _, code in code_blocks():
        if language == "python":
            ast.parse(code, filename=f"{page.name}'s block")


# ------------------------------------------------------------ the site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as `make docs` builds it, with --strict: any warning (a broken link or anchor, a page
    missing from the navigation, a docstring the reference cannot read) fails the build."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    return out


def text_of(page: str) -> str:
    """What a browser shows of a piece of HTML: its text, tags dropped, entities read."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.slow
def test_api_reference_lists_every_argument_of_run_with_the_codes_default(site):
    """The signature the reference shows for multicard.Run, read back from the built page, against the
    class's own: the same arguments, kinds and defaults, whatever arguments Run has."""
    page = (site / "api.html").read_text()
    heading = page.index('id="multicard.Run"')
    shown_text = text_of(page[heading : page.index("</pre>", heading)])
    signature = shown_text[shown_text.index("Run(") :]
    shown = ast.parse(f"def {signature.strip()}: pass").body[0].args
    code = inspect.signature(multicard.Run).parameters
    positional = [a.arg for a in shown.args]
    keyword = [a.arg for a in shown.kwonlyargs]
    assert positional == [n for n, p in code.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert keyword == [n for n, p in code.items() if p.kind is p.KEYWORD_ONLY]
    defaults = dict(zip(positional[len(positional) - len(shown.defaults) :], shown.defaults, strict=True))
    defaults.update({a.arg: d for a, d in zip(shown.kwonlyargs, shown.kw_defaults, strict=True) if d is not None})
    for name, parameter in code.items():
        if parameter.default is inspect.Parameter.empty:
            assert name not in defaults, f"the reference gives {name} a default the code does not have"
        else:
            assert name in defaults, f"the reference shows no default for {name}"
            assert ast.literal_eval(defaults[name]) == parameter.default, name


@pytest.mark.slow
def test_api_reference_holds_the_public_names_of_each_package(site):
    import multicard.checkpoint
    import multicard.data
    import multicard.strategy

    page = (site / "api.html").read_text()
    for package in (multicard.data, multicard.strategy, multicard.checkpoint):
        missing = [n for n in package.__all__ if f'id="{package.__name__}.{n}"' not in page and n != "shard_format"]
        assert not missing, f"{package.__name__}: {missing}"
    for method in ("setup", "loader", "epochs", "backward", "step", "log", "evaluate", "state"):
        assert f'id="multicard.Run.{method}"' in page
    assert 'id="multicard.Scores.mean"' in page


@pytest.mark.slow
def test_cli_reference_lists_every_command_and_option(site):
    page = (site / "cli.html").read_text()
    parser = build_parser()
    for name, command in parser.commands.items():
        start = page.index(f'id="multicard-{name}"')
        following = [page.find(f'id="multicard-{other}"', start + 1) for other in parser.commands if other != name]
        section = text_of(page[start : min([i for i in following if i > start], default=len(page))])
        for action in command._actions:
            if "-h" in action.option_strings:
                continue  # every command's --help: the page's text says it once
            for flag in action.option_strings:
                assert flag in section, f"multicard {name} {flag}"
            if action.help:
                assert " ".join(action.help.split()) in " ".join(section.split()), f"multicard {name}: {action.help}"


@pytest.mark.slow
def test_home_page_is_the_readme(site):
    home = text_of((site / "index.html").read_text())
    first = (ROOT / "README.md").read_text().split("\n\n")[1].split()[:8]
    assert " ".join(first) in " ".join(home.split())


@pytest.mark.slow
def test_configuration_reference_lists_every_key_with_its_default(site):
    from multicard.base.config import Config, to_dict

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            is_section = isinstance(value, dict) and key not in ("kwargs",)
            out.update(flat(value, f"{prefix}{key}.") if is_section else {prefix + key: value})
        return out

    page = text_of((site / "configuration.html").read_text())
    keys = flat(to_dict(Config()))
    assert len(keys) > 100
    for key, default in keys.items():
        shown = default if isinstance(default, str) else json.dumps(default)
        assert re.search(rf"^{re.escape(key)}\n.*\n{re.escape(shown)}\n", page, re.M), f"{key} = {shown}"
