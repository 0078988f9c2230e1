"""The layout shows the architecture: no import circle in src/unison (type-only imports count too),
and no module over ~450 lines without a reason stated in its docstring."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "unison"
MAX_LINES = 450
#: Modules allowed past MAX_LINES: each says why in its docstring, "Long on purpose: ..." (checked below).
LONG_ON_PURPOSE = {"unison.launch.launcher", "unison.data.stream"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The unison modules `path` imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n in modules and n != here)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: imports(path, modules) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_src_unison_has_no_import_circle():
    assert circles(import_graph()) == []


def test_modules_stay_small_or_say_why():
    too_long = {}
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long[module_name(path)] = lines
    unexplained = sorted(set(too_long) - LONG_ON_PURPOSE)
    assert not unexplained, f"over {MAX_LINES} lines, not in LONG_ON_PURPOSE: {unexplained} ({too_long})"
    for name in sorted(set(too_long) & LONG_ON_PURPOSE):
        path = PACKAGE.joinpath(*name.split(".")[1:]).with_suffix(".py")
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Long on purpose" in docstring, f"{name} ({too_long[name]} lines) does not say why it is long"


def package_of(module: str) -> str | None:
    """The sub-package of unison a module belongs to (`unison.data.loader` -> `data`); None for a
    top-level module (`unison.learner`), which is no package of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def package_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports that make the arrow."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a and b and a != b:
                arrows.setdefault((a, b), []).append(f"{module} -> {target}")
    return arrows


def test_the_package_checker_finds_two_packages_importing_each_other():
    graph = {"unison.data.a": {"unison.distributed.b"}, "unison.distributed.b": {"unison.data.c"}}
    graph["unison.data.c"] = set()
    arrows = package_arrows(graph)
    assert ("data", "distributed") in arrows and ("distributed", "data") in arrows


def test_no_two_packages_import_each_other():
    """The packages form layers (data, distributed, checkpoint, callbacks, launch): an import from a
    lower one back up to a higher one, anywhere in a module (type-only and function-level too), would
    make two packages that can only be understood together."""
    arrows = package_arrows(import_graph())
    both_ways = sorted(
        f"{a} <-> {b}: {arrows[(a, b)][:2]} / {arrows[(b, a)][:2]}"
        for a, b in arrows
        if a < b and (b, a) in arrows
    )
    assert both_ways == []


def test_the_environment_contract_is_named_in_one_module():
    """Every variable a launcher and its workers pass each other (`*_ENV = "..."`) is defined in
    unison/env_names.py alone; the modules that set or read one import it from there."""
    elsewhere = [
        f"{path.relative_to(SRC)}: {target.id}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "env_names.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.endswith("_ENV")
    ]
    assert elsewhere == []


def test_each_lazy_package_names_its_exports_once_for_type_checkers_and_once_for_the_loader():
    """A package whose names load on first use lists each twice: under TYPE_CHECKING (what type
    checkers read) and in `_EXPORTS` (name -> module, what the loader imports; `__all__` is its keys).
    The two must agree, module for module."""
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        exports = next(
            (
                node.value
                for node in tree.body
                if isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets)
            ),
            None,
        )
        if exports is None:
            continue
        loaded = {key.value: value.value for key, value in zip(exports.keys, exports.values, strict=True)}
        checked = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                for imp in node.body:
                    if isinstance(imp, ast.ImportFrom):
                        checked.update({alias.name: imp.module for alias in imp.names})
        assert checked == loaded, init


def host_writes(path: Path) -> list[str]:
    """Assignments to an attribute of the loop's host in `path`: `learn.x = ...`, `host.x = ...`,
    `self.learn.x = ...` (augmented and tuple targets included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = t.value
                named = isinstance(owner, ast.Name) and owner.id in {"learn", "host"}
                via_self = isinstance(owner, ast.Attribute) and owner.attr in {"learn", "host"}
                if named or via_self:
                    found.append(f"{path.name}:{t.lineno} {ast.unparse(t)}")
    return found


def test_the_host_writes_checker_finds_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(learn):\n    learn.xb, y = 1, 2\n    self.learn.model = 3\n")
    assert host_writes(sample) == ["sample.py:2 learn.xb", "sample.py:3 self.learn.model"]


def test_strategies_and_checkpoints_write_nothing_on_the_host():
    """They take what they need and return their results; the engine puts them in place
    (`unison.engine.use_parts`, `start_at`, `take_share`, `commit_step`)."""
    writes = [
        w
        for package in ("distributed", "checkpoint")
        for p in (PACKAGE / package).rglob("*.py")
        for w in host_writes(p)
    ]
    assert writes == []
