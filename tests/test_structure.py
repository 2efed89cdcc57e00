"""The source tree's shape, read with `ast`: no torch import, a second to run.

- no import cycle among multicard's modules (imports inside functions and under TYPE_CHECKING count);
- no module imports one of a layer above its own (the order of DESIGN.md's "Layers", in LAYERS);
- no module imports a `_private` name from another multicard module;
- every class is at most 200 lines, every function at most 50, and src/multicard holds a folder per
  layer and its two modules (`__init__`, `__main__`);
- every `# type: ignore` of src/multicard names its error code and says why (mypy checks the rest).

An import of `a.b.c` also runs the package `a.b`'s `__init__`: that counts as an import of `a.b`,
except from a module inside `a.b` itself (Python initializes a package before its modules). A
module that imports a name its own package's `__init__` re-exports does import that `__init__`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("multicard", "multicard_yardsticks")
MAX_FUNCTION_LINES = 50
MAX_CLASS_LINES = 200

# DESIGN.md's layers, bottom first: a module may import its own layer and those below it. Each is
# a folder of src/multicard (a module's layer is its folder's), except ROOT, multicard's own
# __init__ (the public API, with multicard.run) and __main__ (the command line's).
ROOT = "multicard"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("multicard.base",)),  # configuration, errors, atomic files, storage URLs, version, host memory
    ("runtime", ("multicard.runtime",)),  # launch and each process's context
    ("data", ("multicard.data",)),
    ("strategy", ("multicard.strategy",)),  # models and how the processes share them
    ("engine", ("multicard.engine",)),
    ("checkpoint", ("multicard.checkpoint",)),
    ("observe", ("multicard.observe",)),
    ("assembly", ("multicard.assembly",)),  # the frozen run plan, and the parts built from it
    ("run", (ROOT, "multicard.run")),  # the public API: multicard.Run, the one training loop's control
    ("recipes", ("multicard.recipes",)),  # multicard train's classifier, written on multicard.Run
    # the yardsticks are what bench measures against: they depend on nothing of bench's
    ("yardsticks", ("multicard_yardsticks",)),
    ("tools", ("multicard.tools",)),
    ("cli", ("multicard.cli", "multicard.__main__")),
]  # fmt: skip


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module or package
    line: int
    names: tuple[str, ...] = ()  # names taken from the target (`from target import ...`)

    def where(self) -> str:
        return f"{module_path(self.source).relative_to(SRC.parent)}:{self.line}"


def module_path(name: str) -> Path:
    path = SRC.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            parts = path.relative_to(SRC).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def is_package(name: str) -> bool:
    return (SRC.joinpath(*name.split(".")) / "__init__.py").is_file()


def ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every import of multicard by module `name`, wherever it is written (functions included)."""
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    yield Import(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if not ours(base):
                continue
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{base}.{n}" in known]
            for sub in submodules:
                yield Import(name, f"{base}.{sub}", node.lineno)
            others = tuple(n for n in names if n not in submodules)
            if others:
                yield Import(name, base, node.lineno, others)


def edges() -> list[Import]:
    """Imports written, and the package `__init__`s they run (see the module docstring)."""
    known = modules()
    found = []
    for name, path in known.items():
        for imp in imports_of(name, path, known):
            found.append(imp)
            parts = imp.target.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in known and not (name == parent or name.startswith(parent + ".")):
                    found.append(Import(name, parent, imp.line))
    return [e for e in found if e.target != e.source and e.target in known]


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the name that fits, layer)
    for index, (_, names) in enumerate(LAYERS):
        for prefix in names:
            fits = name == prefix or (prefix != ROOT and name.startswith(prefix + "."))
            if fits and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return best[1] if best else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected group of modules (Tarjan, then BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_cycle(min(group), graph, group) for group in groups]


def shortest_cycle(start: str, graph: dict[str, set[str]], group: set[str]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


# ---------------------------------------------------------------- the checks


def test_every_module_has_a_layer():
    missing = sorted(name for name in modules() if layer_of(name) is None)
    assert not missing, "modules without a layer (add them to LAYERS):\n" + "\n".join(missing)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for e in edges():
        graph[e.source].add(e.target)
    found = [" → ".join(cycle) for cycle in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for e in edges():
        mine, theirs = layer_of(e.source), layer_of(e.target)
        if mine is not None and theirs is not None and theirs > mine:
            upward.append(f"{e.where()} {e.source} ({LAYERS[mine][0]}) imports {e.target} ({LAYERS[theirs][0]})")
    assert not upward, "imports of a layer above:\n" + "\n".join(sorted(set(upward)))


def test_no_private_name_is_imported_from_another_module():
    private = [
        f"{e.where()} {e.source} imports {n} from {e.target}"
        for e in edges()
        for n in e.names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not private, "private names imported:\n" + "\n".join(private)


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def test_every_class_is_at_most_200_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and lines(node) > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}: {lines(node)} lines")
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


def test_the_package_holds_a_folder_per_layer_and_its_two_modules():
    """A newcomer sees the layers: src/multicard holds folders, one per layer of LAYERS, and two
    modules (the package's `__init__`, the public API, and `__main__`, the command line's)."""
    top = sorted(p.name for p in (SRC / "multicard").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    folders = {n.split(".")[1] for _, names in LAYERS for n in names if n.startswith("multicard.")} - {"__main__"}
    assert top == sorted([*folders, "__init__.py", "__main__.py"]), top
    assert len(top) <= 14, top


def test_every_function_is_at_most_50_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}: {lines(node)} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_checks_see_a_cycle_an_upward_import_and_a_private_name():
    """The readers above on a made-up graph and map: they are not blind."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    cli, tool, engine = "multicard.cli.main", "multicard.tools.plan.planner", "multicard.engine.loop"
    recipe, api, assembly = "multicard.recipes.classifier", "multicard.run.run", "multicard.assembly.parts"
    assert layer_of(cli) > layer_of(tool) > layer_of(recipe) > layer_of(api) > layer_of(assembly) > layer_of(engine)
    assert layer_of("multicard.nowhere") is None and layer_of("multicard") == layer_of("multicard.run")
    assert layer_of("multicard.data.loading.sampling") == layer_of("multicard.data")


def test_one_module_runs_backward():
    """The loop (multicard.engine.loop) is the one place a backward pass is written: a user's loop and
    `multicard train`'s recipe (multicard.Run's `run.backward`, not a backward pass of its own) and
    every tool that times a step go through it. (The yardsticks, hand-written loops that bench
    compares with, are another package.)"""
    callers = set()
    for name, path in modules().items():
        if not name.startswith("multicard."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                if receiver(node.func) != "run":
                    callers.add(name)
    assert callers == {"multicard.engine.loop"}, callers


def public_names(package: str) -> set[str]:
    """The names a package's `__init__` declares in `__all__`."""
    for node in ast.parse(module_path(package).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_tools_and_the_command_line_use_the_data_layer_through_its_public_surface():
    """tools/ and cli/ import `multicard.data`, the package, and only the names its `__all__`
    declares — never a module of its stage folders (sources, decoding, augmentation, loading)."""
    surface = public_names("multicard.data")
    assert {"read_splits", "build_data", "shard_format"} <= surface
    known, inside = modules(), []
    for name, path in known.items():
        if not name.startswith(("multicard.tools", "multicard.cli")):
            continue
        for imp in imports_of(name, path, known):
            if imp.target.startswith("multicard.data."):
                inside.append(f"{imp.where()} imports {imp.target}")
            elif imp.target == "multicard.data" and set(imp.names) - surface:
                inside.append(f"{imp.where()} imports {sorted(set(imp.names) - surface)}: not in its __all__")
    assert not inside, "imports of the data layer's insides:\n" + "\n".join(inside)


def calls_of(*functions: str) -> dict[str, dict[str, int]]:
    """For each of `functions` (called by its bare or dotted name): the modules of multicard that
    call it, with how often."""
    found: dict[str, dict[str, int]] = {function: {} for function in functions}
    for name, path in modules().items():
        if not name.startswith("multicard."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called in found:
                    found[called][name] = found[called].get(name, 0) + 1
    return found


def test_a_run_is_assembled_in_one_place():
    """The checkpointer and the sinks of a run (console, metrics.jsonl, TensorBoard, trackers) are
    made by the assembly alone (assembly/parts.py: multicard.Run takes them from it, and train, bench,
    verify and plan run on multicard.Run), and a training run's preflight is called from two places:
    multicard's launcher, and the assembly of a run that no launcher of multicard's checked."""
    made = ("Checkpointer", "Reporter", "TrainingLog", "TensorBoardLog", "TrackerLog")
    calls = calls_of(*made, "preflight", "check_training_run")
    assert {cls: calls[cls] for cls in made} == {cls: {"multicard.assembly.parts": 1} for cls in made}, calls
    assert calls["preflight"] == {"multicard.cli.main": 1, "multicard.assembly.parts": 1}
    assert calls["check_training_run"] == {"multicard.assembly.preflight": 1}


def test_tools_and_the_command_line_drive_training_through_the_public_api():
    """tools/ and cli/ import nothing of the engine or the assembly (the launcher's checks,
    assembly/preflight.py, aside: they are made before any worker exists), and take multicard.Run,
    its callbacks and the recipes from their packages' public names (`multicard.run`,
    `multicard.recipes`), never from a module inside."""
    known, inside = modules(), []
    for name, path in known.items():
        if not name.startswith(("multicard.tools", "multicard.cli")):
            continue
        for imp in imports_of(name, path, known):
            target = imp.target
            if target == "multicard.assembly.preflight" and name.startswith("multicard.cli"):
                continue
            if target.startswith(("multicard.engine", "multicard.assembly", "multicard.run.", "multicard.recipes.")):
                inside.append(f"{imp.where()} imports {target}")
            for package in ("multicard.run", "multicard.recipes"):
                if target == package and set(imp.names) - public_names(package):
                    inside.append(f"{imp.where()} imports {sorted(set(imp.names) - public_names(package))}")
    assert not inside, "imports past the public API:\n" + "\n".join(inside)


def receiver(func: ast.Attribute) -> str | None:
    """The last name of what a method is called on: `run` for run.backward(...), self.run.step(...)."""
    value = func.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None


def scopes_calling(*methods: str) -> dict[str, set[str]]:
    """For each method (`name`, or `receiver.name`: called on a thing of that name): the classes
    (module.Class) or functions (module.function) of multicard whose code calls it."""
    found: dict[str, set[str]] = {m: set() for m in methods}
    for name, path in modules().items():
        if not name.startswith("multicard."):
            continue
        for top in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(top, (ast.ClassDef, ast.FunctionDef)):
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    for key in (node.func.attr, f"{receiver(node.func)}.{node.func.attr}"):
                        if key in found:
                            found[key].add(f"{name}.{top.name}")
    return found


def test_one_meter_one_evaluator_and_one_training_loop_control():
    """One class keeps a run's statistics and writes its records (run/logbook.py: the Logbook that
    run.log feeds, `multicard train`'s recipe too), one function evaluates (run/evaluation.py:
    evaluate_sums, behind run.evaluate and `multicard eval`), and one class controls the training
    loop (run/training.py: Training ends the steps, advances the epochs and tells the callbacks)."""
    classes = [node for path in SRC.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)]  # fmt: skip
    assert not {c.name for c in classes} & {"Trainer", "TrainMeter", "Runtime"}
    records = {c.name for c in classes for f in c.body if getattr(f, "name", None) in ("step_record", "epoch_record")}
    assert records == {"Logbook"}, records
    calls = scopes_calling("step_record", "epoch_record", "loop.end_step", "count_step", "on_epoch_end", "eval")
    assert calls["step_record"] | calls["epoch_record"] == {"multicard.run.training.Training"}, calls
    assert calls["loop.end_step"] == {"multicard.run.training.Training"}, calls
    assert calls["count_step"] == {"multicard.run.stepping.Steps"}, calls  # Training's steps
    # the loop's epoch ends: told by Training, and passed on by callbacks that wrap others (trackers)
    assert {c for c in calls["on_epoch_end"] if not c.startswith("multicard.observe.")} == {
        "multicard.run.training.Training"}, calls  # fmt: skip
    # a model in evaluation mode: the evaluator, and the size check of a model before training
    assert calls["eval"] == {"multicard.run.evaluation.evaluate_sums", "multicard.strategy.models.check_input_size"}


def test_tools_use_the_strategies_and_checkpoints_through_their_packages():
    """The tools take what they use of the strategies and the checkpoints from the packages'
    public surface (`multicard.strategy`, `multicard.checkpoint`), never from a module inside."""
    tools = layer_of("multicard.tools")
    deep = [
        f"{e.where()} {e.source} imports {e.target}"
        for e in edges()
        if layer_of(e.source) == tools and e.target.startswith(("multicard.strategy.", "multicard.checkpoint."))
    ]
    assert not deep, "import these through the package instead:\n" + "\n".join(deep)


def test_the_strategy_packages_lazy_names_are_its_public_names():
    """multicard.strategy loads its names lazily from a map: the map and `__all__` say the same."""
    import multicard.strategy as strategy

    assert set(strategy.__all__) == set(strategy._HOME)
    for name in strategy.__all__:
        assert getattr(strategy, name) is not None


KIND_CALLS = ("is_url", "is_remote")  # what asks whether a location is a URL
KIND_ATTRIBUTES = ("remote", "round_trips")  # what asks which kind a store is
STORE_KINDS = ("LocalStore", "ObjectStore")


class _KindQuestions(ast.NodeVisitor):
    """Where a module asks whether storage is local or a URL: the innermost function (or class, or the
    module) of each call of KIND_CALLS, read of KIND_ATTRIBUTES, or isinstance of a store class."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.places: set[str] = set()

    def _enter(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        of = ast.walk(node.args[1]) if len(node.args) > 1 else ()
        kinds = {getattr(n, "id", getattr(n, "attr", None)) for n in of}
        if called in KIND_CALLS or (called == "isinstance" and kinds & set(STORE_KINDS)):
            self.places.add(".".join(self.scope) or "<module>")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in KIND_ATTRIBUTES and isinstance(node.ctx, ast.Load):
            self.places.add(".".join(self.scope) or "<module>")
        self.generic_visit(node)


def kind_questions(source: str) -> set[str]:
    finder = _KindQuestions()
    finder.visit(ast.parse(source))
    return finder.places


def test_at_most_3_places_branch_on_local_vs_url_storage():
    """Storage is one interface (base/store.py), local paths and URLs behind the same methods, so
    at most 3 places ask which kind a location or store is: the parser of locations, the store's factory,
    and the packed shards' reader (whole shards where each read is a round trip). The checkpointer, the pack
    tool and the config hold no twin of local and remote code."""
    places = sorted(f"{name}.{place}" for name, path in modules().items() if name.startswith("multicard.")
                    for place in kind_questions(path.read_text(encoding="utf-8")))  # fmt: skip
    assert len(places) <= 3, "places that branch on local vs URL storage:\n" + "\n".join(places)
    assert places == ["multicard.base.locations.check_location", "multicard.base.store.open_store",
                      "multicard.data.sources.shards.ShardSamples.__init__"], places  # fmt: skip


def test_the_storage_branch_check_sees_each_way_of_asking():
    made_up = (
        "def a(p):\n    return is_url(p)\n"
        "class B:\n    def c(self):\n        return self.remote\n"
        "def d(s):\n    def e():\n        return isinstance(s, (LocalStore, int))\n    return e\n"
        "x = store.round_trips\n"
        "class F:\n    round_trips = True\n"
    )
    assert kind_questions(made_up) == {"a", "B.c", "d.e", "<module>"}


# `# type: ignore[code]  # why` (or `[code, code]`); the reason is the text after the second # (not a noqa).
EXPLAINED_IGNORE = re.compile(r"# *type: *ignore\[[a-z-]+(, *[a-z-]+)*\] +# *(?!noqa)\S")


def unexplained_ignores(source: str) -> list[int]:
    """Lines of comments that silence mypy without naming the error or saying why."""
    comments = (t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT)
    return [t.start[0] for t in comments if re.match(r"# *type: *ignore", t.string)
            and not EXPLAINED_IGNORE.match(t.string)]  # fmt: skip


def test_every_type_ignore_names_its_error_code_and_why():
    found = [f"{path.relative_to(SRC.parent)}:{line}" for name, path in modules().items()
             if name.startswith("multicard.") for line in unexplained_ignores(path.read_text(encoding="utf-8"))]
    assert not found, "type: ignore without [code]  # why:\n" + "\n".join(found)


def test_the_ignore_check_tells_an_explained_ignore_from_the_others():
    made_up = (
        "a = f()  # type: ignore\n"
        "b = f()  # type: ignore[arg-type]\n"
        "c = f()  # type: ignore[arg-type]  # f's stub is wrong\n"
        "d = f()  # type: ignore[arg-type, union-attr]  # f's stub is wrong  # noqa: E501\n"
        "e = '# type: ignore'  # a string, not a comment\n"
        "g = f()  # type: ignore[arg-type]  # noqa: E501\n"
    )
    assert unexplained_ignores(made_up) == [1, 2, 6]
