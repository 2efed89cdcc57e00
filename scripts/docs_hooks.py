"""The documentation site's own parts (mkdocs hooks, named in mkdocs.yml), and the link check.

- The home page is README.md (the repository's front page) and the changelog CHANGELOG.md, their links
  turned into the site's.
- Marker lines become references made from the code, so they cannot drift from it: docs/cli.md's, every
  command and option of the parser `multicard` itself parses with (multicard.cli.main.build_parser);
  docs/configuration.md's, every config key with its type, default and comment (base/config/).
- Links from a page to repository files outside docs/ (examples, configs, benchmarks) become the file's
  path in code, since the site holds only the docs.
- `check_links`: every internal link and anchor of README.md, CHANGELOG.md and docs/ resolves; external
  links are listed, not fetched (`python scripts/docs_hooks.py` prints them). tests/test_docs.py runs it.
"""

from __future__ import annotations

import argparse
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}  # site page: the repository file it shows
CLI_MARKER = "<!-- the command-line reference: made from multicard's parser when the site is built -->"
CONFIG_MARKER = "<!-- every config key: made from multicard's config classes when the site is built -->"
_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])+)\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


# ------------------------------------------------------------ Markdown: links, headings, anchors


def segments(text: str) -> Iterator[tuple[int, bool, str]]:
    """(first line number, fenced, text) of the runs of a Markdown text: prose, and fenced code blocks
    (with their fences)."""
    run: list[str] = []
    start, fenced = 1, False
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        fence = _FENCE.match(line.lstrip()) is not None
        if fence and not fenced:  # a block opens: the prose before it ends
            if run:
                yield start, False, "".join(run)
            run, start = [], number
        run.append(line)
        if fence and fenced:  # a block closes with this line
            yield start, True, "".join(run)
            run, start = [], number + 1
        fenced ^= fence
    if run:
        yield start, fenced, "".join(run)


def prose(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each run of Markdown outside fenced code blocks."""
    return ((start, chunk) for start, fenced, chunk in segments(text) if not fenced)


def _links(text: str) -> Iterator[tuple[re.Match, str]]:
    """Each inline link of a run of prose outside code spans, with its text as written (code spans in a
    link's text included): the match is made on the text with its code spans blanked."""
    blanked = re.sub(r"`[^`]*`", lambda m: "`" + re.sub(r"[^\n]", "x", m.group()[1:-1]) + "`", text)
    for match in _LINK.finditer(blanked):
        if "`" not in text[match.start(2) : match.end(2)]:  # a target inside a code span is no link
            yield match, text[match.start(1) : match.end(1)]


def markdown_links(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, text, target) of each inline link outside code (blocks and spans)."""
    for start, block in prose(text):
        for match, label in _links(block):
            yield start + block.count("\n", 0, match.start()), label, match.group(2)


def _plain(heading: str) -> str:
    """A heading's text as the page shows it: code spans, links and emphasis reduced to their text."""
    heading = _LINK.sub(lambda m: m.group(1), heading)
    heading = re.sub(r"`([^`]*)`", r"\1", heading)
    return re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", heading)


def slug(heading: str) -> str:
    """The anchor of a heading, as the site's table of contents (Python-Markdown's toc) makes it."""
    from markdown.extensions.toc import slugify

    return slugify(_plain(heading), "-")


def headings(text: str) -> list[str]:
    """The anchors of a page's headings, with toc's `_1`, `_2`... for repeated ones."""
    seen: dict[str, int] = {}
    anchors = []
    lines = [line for _, block in prose(text) for line in block.splitlines()]
    for line in lines:
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = slug(match.group(2))
        if anchor in seen:
            seen[anchor] += 1
            anchor = f"{anchor}_{seen[anchor]}"
        else:
            seen[anchor] = 0
        anchors.append(anchor)
    return anchors


# ------------------------------------------------------------ the link check


def pages(root: Path = ROOT) -> list[Path]:
    """The Markdown a reader follows links in: README.md, CHANGELOG.md and docs/."""
    return [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]


def generated(markdown: str) -> str:
    """A page with its marker lines replaced by the references made from the code."""
    if CLI_MARKER in markdown:
        from multicard.cli.main import build_parser

        markdown = markdown.replace(CLI_MARKER, cli_reference(build_parser()))
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    return markdown


def anchors_of(path: Path) -> list[str]:
    """The anchors a page offers: its headings', the generated references' included."""
    return headings(generated(path.read_text()))


def check_links(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(what is wrong, the external links) of the links in `pages`: each internal link must name a file or
    folder of the repository and each anchor a heading of the page it names; external links are listed,
    not fetched."""
    problems: list[str] = []
    external: set[str] = set()
    for page in pages(root):
        for line, _, target in markdown_links(page.read_text()):
            where = f"{page.relative_to(root)}:{line}: {target}"
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                external.add(target)
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or root not in (linked, *linked.parents):
                problems.append(f"{where}: no such file in the repository")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors_of(linked)):
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems, sorted(external)


# ------------------------------------------------------------ links as the site needs them


def site_target(target: str, page_dir: str) -> str | None:
    """Where a link of a page in `page_dir` (relative to the repository) points on the site: a docs page
    keeps its link, relative to docs/; a repository file outside docs/ has no page (None)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return target
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(page_dir, path))
    by_source = {source: page for page, source in GENERATED.items()}
    if resolved in by_source:
        resolved = f"docs/{by_source[resolved]}"
    if not resolved.startswith("docs/"):
        return None
    return posixpath.relpath(resolved, "docs") + (f"#{anchor}" if anchor else "")


def for_the_site(text: str, page_dir: str) -> str:
    """A page's Markdown with each link as the site needs it: a repository file outside docs/ is
    shown as its path (in code), the link text kept when it says more."""

    def rewrite(label: str, target: str) -> str:
        where = site_target(target, page_dir)
        if where is not None:
            return f"[{label}]({where})"
        path = posixpath.normpath(posixpath.join(page_dir, target))
        return f"`{path}`" if label.strip("`") in (path, target) else f"{label} (`{path}`)"

    pieces = []
    for _, fenced, chunk in segments(text):
        if not fenced:
            for match, label in reversed(list(_links(chunk))):
                chunk = chunk[: match.start()] + rewrite(label, match.group(2)) + chunk[match.end() :]
        pieces.append(chunk)
    return "".join(pieces)


# ------------------------------------------------------------ the command-line reference


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    name = action.metavar or (action.dest if not action.option_strings else action.dest.upper())
    return name if isinstance(name, str) else " ".join(name)


def _default(action: argparse.Action) -> str:
    nothing = action.default is None or action.default is False or action.default in (argparse.SUPPRESS, [], ())
    if nothing or not action.option_strings:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    return text % {**vars(action), "prog": prog} if "%" in text else text


def options_table(parser: argparse.ArgumentParser) -> list[str]:
    """A table per group of the parser's arguments: each flag (or positional), its value, default and help.

    argparse keeps its arguments in `_action_groups` (it has no public listing of them)."""
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"**{group.title}**", "", "| argument | value | default | meaning |", "|---|---|---|---|"]
        for action in actions:
            flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{_value(action)}`"
            value = f"`{_value(action)}`" if action.option_strings and _value(action) else ""
            lines.append(
                f"| {flags} | {_cell(value)} | {_cell(_default(action))} | {_cell(_help(action, parser.prog))} |"
            )
        lines.append("")
    return lines


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """The reference of `multicard` and each of its commands, from its parser."""
    commands: dict[str, argparse.ArgumentParser] = parser.commands  # type: ignore[attr-defined]
    summaries = {a.dest: a.help for a in parser._subparsers._group_actions[0]._choices_actions}  # type: ignore[union-attr]
    lines = [parser.description or "", "", "```", parser.format_usage().strip(), "```", ""]
    lines += ["| command | what it does |", "|---|---|"]
    lines += [f"| [`multicard {name}`](#multicard-{name}) | {_cell(summaries.get(name, ''))} |" for name in commands]
    lines += ["", "`multicard --version` prints the version; `multicard COMMAND --help` prints what is below.", ""]
    for name, sub in commands.items():
        lines += [f"## multicard {name}", "", sub.description or "", "", "```", sub.format_usage().strip(), "```", ""]
        lines += options_table(sub)
    return "\n".join(lines)


# ------------------------------------------------------------ the config reference


def _field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of a dataclass in its source: the one after it on its line, else the
    comment lines right above it."""
    import inspect
    import io
    import tokenize

    lines, _ = inspect.getsourcelines(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = re.match(r"\s+(\w+): ", line)
        if not match or line.lstrip().startswith("#"):
            continue
        above, up = [], number - 1
        while up in comments and lines[up - 1].lstrip().startswith("#"):
            above.insert(0, comments[up])
            up -= 1
        found[match.group(1)] = comments.get(number) or " ".join(above)
    return found


def _shown(value: object) -> str:
    import json

    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def config_keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every config key, in the order the config classes declare them."""
    import dataclasses
    import typing

    from multicard.base.config import Config

    rows = []

    def walk(cls: type, prefix: str) -> None:
        hints, comments = typing.get_type_hints(cls), _field_comments(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
            rows.append((prefix + f.name, name, _shown(default), comments.get(f.name, "")))

    walk(Config, "")
    return rows


def config_reference() -> str:
    """A table of every config key per section, with its type, default and the comment beside its declaration."""
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in config_keys():
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else "", []).append(row)
    lines = []
    for section, rows in sections.items():
        lines += [f"### {section or 'top level'}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [
            f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |" for key, kind, default, meaning in rows
        ]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------ mkdocs hooks


def on_files(files, config):  # mkdocs' hook
    """The home page (README.md) and the changelog (CHANGELOG.md), their links made the site's."""
    from mkdocs.structure.files import File

    for page, source in GENERATED.items():
        text = (ROOT / source).read_text()
        files.append(File.generated(config, page, content=for_the_site(text, ".")))
    return files


def on_page_markdown(markdown, page, config, files):  # mkdocs' hook
    if page.file.src_uri in GENERATED:
        return markdown  # already the site's (on_files)
    markdown = generated(markdown)
    return for_the_site(markdown, posixpath.dirname(f"docs/{page.file.src_uri}"))


if __name__ == "__main__":  # python scripts/docs_hooks.py: the link check, and the external links to check by hand
    import sys

    sys.path.insert(0, str(ROOT / "src"))
    wrong, outside = check_links()
    print("\n".join(["external links (not fetched):", *outside, *(["", "wrong links:", *wrong] if wrong else [])]))
    raise SystemExit(1 if wrong else 0)
