"""The house's structure: no import circles among the project's modules, and every relative link in
README.md and docs/*.md resolves inside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("arvdm", "memory", "kernels", "data")
# Allowed direction between the packages (docs/ARCHITECTURE.md): arvdm -> memory -> kernels, arvdm -> data.
MAY_IMPORT = {"arvdm": {"arvdm", "memory", "kernels", "data"}, "memory": {"memory", "kernels"},
              "kernels": {"kernels"}, "data": {"data"}}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _is_main_guard(node: ast.AST) -> bool:
    # Code under `if __name__ == "__main__":` runs only when the file is the script (module `__main__`), so
    # its imports cannot close a circle of imports between library modules.
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _imported_names(tree: ast.Module, module: str, is_package: bool):
    """Every module name an import statement anywhere in the file (function bodies too) refers to."""
    todo = [n for n in tree.body if not _is_main_guard(n)]
    while todo:
        node = todo.pop()
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            yield from ([a.name] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            yield [f"{base}.{a.name}" for a in node.names] + [base]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> project modules it imports (module level and inside functions)."""
    mods = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for candidates in _imported_names(tree, mod, path.name == "__init__.py"):
            *names, base = candidates if len(candidates) > 1 else (candidates[0], candidates[0])
            hits = [n for n in names if n in mods]
            target = hits if hits else ([base] if base in mods else [])
            graph[mod].update(t for t in target if t != mod)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "arvdm" / "a.py").write_text("from arvdm.b import x\n")
    (tmp_path / "arvdm" / "b.py").write_text("def f():\n    from . import c\n")  # lazy imports count
    (tmp_path / "arvdm" / "c.py").write_text("import arvdm.a\n")
    (tmp_path / "arvdm" / "d.py").write_text("from .a import y\nif __name__ == '__main__':\n    from . import e\n")
    (tmp_path / "arvdm" / "e.py").write_text("from arvdm import d\n")  # d -> e only under the main guard
    graph = import_graph(tmp_path)
    assert graph["arvdm.b"] == {"arvdm.c"} and graph["arvdm.d"] == {"arvdm.a"}
    assert find_cycles(graph) == [["arvdm.a", "arvdm.b", "arvdm.c"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles (each line: modules that import each other in a ring):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_packages_depend_one_way():
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in import_graph().items() for dep in deps
                   if dep.split(".")[0] not in MAY_IMPORT[mod.split(".")[0]])
    assert not wrong, wrong


# -- links in the user's pages ---------------------------------------------------------------------------

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page (images too), outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [a or b for a, b in _LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for target in relative_links(page):
        path = unquote(target.split("#", 1)[0])
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (missing)")
    assert not broken, f"{page.relative_to(ROOT)}: " + ", ".join(broken)


def test_link_finder_sees_links_and_images_but_not_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](docs/a.md) ![pic](img.png) [web](https://x.org) [top](#usage)\n"
                    "`[no](code.md)`\n```\n[no](block.md)\n```\n")
    assert relative_links(page) == ["docs/a.md", "img.png"]


# -- one error family, one environment helper ------------------------------------------------------------

def _error_classes() -> list[type]:
    import importlib
    import inspect

    found = []
    for name in project_modules():
        if name.endswith("__main__"):
            continue  # a CLI entry point: importing it runs it
        if name.startswith("kernels"):
            continue  # kernels raise plain ValueError/TypeError for a caller's bug (docs/INTERFACES.md)
        module = importlib.import_module(name)
        found += [obj for _, obj in inspect.getmembers(module, inspect.isclass)
                  if issubclass(obj, Exception) and obj.__module__ == name]
    return found


def test_every_user_error_is_caught_by_the_clis():
    from arvdm.errors import USER_ERRORS, ArvdmError
    from data.errors import DataError

    classes = _error_classes()
    names = {c.__name__ for c in classes}
    assert {"ConfigError", "CheckpointError", "ScheduleError", "SamplingError", "GridError", "HybridError",
            "EpisodeError", "DatasetError", "GenerateError", "EnvUnavailable", "RetentionError"} <= names
    assert not [c for c in classes if not issubclass(c, USER_ERRORS)]
    for c in classes:  # each package's errors derive from its own base
        base = ArvdmError if c.__module__.startswith("arvdm") else DataError if c.__module__.startswith("data") \
            else Exception
        assert issubclass(c, base), c


def test_setup_environment_sets_defaults_and_keeps_the_users(monkeypatch):
    from arvdm.runtime import THREAD_ENVIRONMENT, setup_environment

    for key in THREAD_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    assert setup_environment() == THREAD_ENVIRONMENT
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert setup_environment()["OMP_WAIT_POLICY"] == "ACTIVE"
