"""The house's structure (issue 19), checked on the sources' AST (only the names of docs/ARCHITECTURE.md are
imported): no import circles (every import counts, in functions and under main guards too); imports go down
between the packages and down arvdm's layers, and nobody imports a `__main__`; module and function sizes;
project imports at the top; the names of docs/ARCHITECTURE.md exist; relative links resolve; every error
class is a USER_ERROR. The rules are the constants below; each check has a test that plants violations in a
small tree of its own, to show that it can fail.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

# -- the rules -------------------------------------------------------------------------------------------

PACKAGES = ("arvdm", "memory", "kernels", "data")
# Entry points outside the packages: graph nodes (so they may not import a `__main__`) free to import any package.
ENTRY_POINTS = ("benchmarks", "train.py", "sample.py")
# Allowed direction between top-level packages (docs/ARCHITECTURE.md): arvdm -> memory -> kernels, arvdm -> data.
MAY_IMPORT = {"arvdm": {"arvdm", "memory", "kernels", "data"}, "memory": {"memory", "kernels"},
              "kernels": {"kernels"}, "data": {"data"},
              "benchmarks": {"benchmarks", *PACKAGES}, "train": set(PACKAGES), "sample": set(PACKAGES)}
# Inside arvdm, a module may import its own unit and the units of lower layers.
ARVDM_LAYERS = (
    ("arvdm.config", "arvdm.presets", "arvdm.errors", "arvdm.runtime", "arvdm.checks", "arvdm.setting_checks"),
    ("arvdm.model", "arvdm.schedules", "arvdm.evaluation", "arvdm.sample_settings"),
    ("arvdm.pipeline",),
    ("arvdm.hybrid", "arvdm.speculative", "arvdm.training"),
    ("arvdm.sampling",),
    ("arvdm.experiments",),
)
SAME_LAYER_ALLOWED = {
    ("arvdm.config", "arvdm.errors"), ("arvdm.runtime", "arvdm.errors"),  # the base raises ArvdmErrors too
    ("arvdm.checks", "arvdm.errors"), ("arvdm.setting_checks", "arvdm.errors"),
    ("arvdm.config", "arvdm.presets"),  # config reads the presets' data
    ("arvdm.config", "arvdm.setting_checks"),  # config's keys share their checks with the CLIs' flags
    ("arvdm.training", "arvdm.hybrid"),  # training fine-tunes hybrid models
}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MODULE_SIZE_CHECKED = ("arvdm", "memory", "data", "benchmarks", "train.py", "sample.py")  # kernels/ exempt
FUNCTION_SIZE_CHECKED = ("arvdm", "memory", "kernels", "data", "benchmarks", "train.py", "sample.py")

# Where a project import inside a function is allowed: the CLIs import after setup_environment().
LAZY_IMPORT_CHECKED = ("arvdm", "memory", "kernels", "data", "benchmarks")
LAZY_IMPORT_ALLOWED_FILES = ("train.py", "sample.py", "__main__.py")
LAZY_MARK = re.compile(r"#\s*lazy:\s*\S")  # `# lazy: <reason>` on the import or on the line above it

ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
FILE_SUFFIXES = {"py", "md", "json", "yaml", "yml", "npz", "npy", "mp4", "png", "csv", "pt", "safetensors"}


# -- the import graph ------------------------------------------------------------------------------------

def python_files(root: Path, entries) -> list[Path]:
    """Every .py file of the given folders (recursively) and files under root."""
    out = []
    for entry in entries:
        path = root / entry
        out += [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
    return out


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages and entry points (`__main__` ones too)."""
    mods = {}
    for f in python_files(root, PACKAGES + ENTRY_POINTS):
        parts = f.relative_to(root).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imported_names(tree: ast.Module, module: str, is_package: bool):
    """For every import statement anywhere in the file: the candidate module names it may refer to."""
    for node in ast.walk(tree):
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
    """Module -> project modules it imports (module level, inside functions, under main guards)."""
    mods = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for candidates in _imported_names(parse(path), mod, path.name == "__init__.py"):
            *names, base = candidates if len(candidates) > 1 else (candidates[0], candidates[0])
            hits = [n for n in names if n in mods]
            target = hits if hits else ([base] if base in mods else [])
            graph[mod].update(t for t in target if t != mod)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of more than one module that reach each other through imports (the circles), each sorted."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            new = graph[todo.pop()] - seen
            seen |= new
            todo += new
        reach[start] = seen
    rings = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph if v in reach[v]}
    return sorted(list(ring) for ring in rings if len(ring) > 1)


def _arvdm_unit(module: str) -> tuple[str, int] | None:
    """(unit, layer) of an arvdm module: the longest unit of ARVDM_LAYERS that is it or contains it."""
    if module == "arvdm":
        return "arvdm", len(ARVDM_LAYERS)  # the root package sits above every layer
    found = [(unit, layer) for layer, units in enumerate(ARVDM_LAYERS) for unit in units
             if module == unit or module.startswith(unit + ".")]
    return max(found, key=lambda u: len(u[0])) if found else None


def dependency_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the package direction, against arvdm's layers, or of a `__main__` module."""
    wrong = [f"{mod} is in no layer of ARVDM_LAYERS" for mod in graph
             if mod.startswith("arvdm.") and _arvdm_unit(mod) is None]
    for mod, deps in graph.items():
        for dep in sorted(deps):
            if dep.split(".")[-1] == "__main__":
                wrong.append(f"{mod} imports {dep} (a `__main__` module runs its CLI when imported)")
            elif dep.split(".")[0] not in MAY_IMPORT[mod.split(".")[0]]:
                wrong.append(f"{mod} imports {dep} (package direction)")
            elif _arvdm_unit(mod) and _arvdm_unit(dep):
                (unit, layer), (dep_unit, dep_layer) = _arvdm_unit(mod), _arvdm_unit(dep)
                if unit != dep_unit and dep_layer >= layer and (unit, dep_unit) not in SAME_LAYER_ALLOWED:
                    where = "same layer" if dep_layer == layer else "upward"
                    wrong.append(f"{mod} imports {dep} ({where}: layer {layer} -> {dep_layer})")
    return sorted(wrong)


def _plant(root: Path, files: dict[str, str]) -> None:
    """A small tree of the packages under root with the given files (path -> source)."""
    for pkg in PACKAGES:
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for rel, source in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(source)


def test_the_cycle_finder_counts_every_import_and_finds_planted_circles(tmp_path):
    _plant(tmp_path, {
        "arvdm/a.py": "from arvdm.b import x\n",
        "arvdm/b.py": "def f():\n    from . import c\n",  # lazy imports count
        "arvdm/c.py": "import arvdm.a\n",
        "arvdm/d.py": "from .a import y\nif __name__ == '__main__':\n    from . import e\n",  # main guards count
        "arvdm/e.py": "from arvdm import d\n",
        "arvdm/p/__main__.py": "from arvdm.p.cli import main\n",
        "arvdm/p/cli.py": "import arvdm.p.__main__\n",  # a circle through a `__main__.py`
    })
    graph = import_graph(tmp_path)
    assert graph["arvdm.b"] == {"arvdm.c"} and graph["arvdm.d"] == {"arvdm.a", "arvdm.e"}
    assert find_cycles(graph) == [["arvdm.a", "arvdm.b", "arvdm.c"], ["arvdm.d", "arvdm.e"],
                                  ["arvdm.p.__main__", "arvdm.p.cli"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles (each line: modules that import each other in a ring):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_direction_check_finds_planted_violations(tmp_path):
    _plant(tmp_path, {
        "arvdm/config.py": "",
        "arvdm/model/net.py": "from arvdm.config import x\n",  # down a layer: fine
        "arvdm/evaluation/m.py": "from arvdm.model.net import y\n",  # same layer
        "arvdm/pipeline/r.py": "from arvdm.hybrid import convert\n",  # upward
        "arvdm/hybrid/convert.py": "",
        "arvdm/training/t.py": "from arvdm.hybrid.convert import z\n",  # the allowed same-layer exception
        "arvdm/schedules/__main__.py": "from arvdm.schedules.plots import main\n",
        "arvdm/schedules/plots.py": "",
        "arvdm/sampling.py": "import arvdm.schedules.__main__\n",  # runs a CLI
        "arvdm/stray.py": "",  # in no layer
        "memory/bank.py": "from arvdm.config import x\n",  # package direction
    })
    assert dependency_violations(import_graph(tmp_path)) == [
        "arvdm.evaluation.m imports arvdm.model.net (same layer: layer 1 -> 1)",
        "arvdm.pipeline.r imports arvdm.hybrid.convert (upward: layer 2 -> 3)",
        "arvdm.sampling imports arvdm.schedules.__main__ (a `__main__` module runs its CLI when imported)",
        "arvdm.stray is in no layer of ARVDM_LAYERS",
        "memory.bank imports arvdm.config (package direction)",
    ]


def test_imports_go_down_the_packages_and_layers():
    wrong = dependency_violations(import_graph())
    assert not wrong, "imports against the direction (tests/test_structure.py's rules):\n" + "\n".join(wrong)


# -- sizes -----------------------------------------------------------------------------------------------

def oversized_modules(root: Path = ROOT) -> list[str]:
    sizes = {f: len(f.read_text(encoding="utf-8").splitlines()) for f in python_files(root, MODULE_SIZE_CHECKED)}
    return [f"{f.relative_to(root)} ({n} lines)" for f, n in sizes.items() if n > MAX_MODULE_LINES]


def oversized_functions(root: Path = ROOT) -> list[str]:
    out = []

    def visit(node: ast.AST, path: Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{child.lineno} {name[:-1]} ({lines} lines)")
            visit(child, path, name)

    for path in python_files(root, FUNCTION_SIZE_CHECKED):
        visit(parse(path), path, "")
    return out


def test_the_size_checks_find_planted_giants(tmp_path):
    _plant(tmp_path, {
        "arvdm/big.py": "\n" * MAX_MODULE_LINES + "y = 1\n",
        "arvdm/ok.py": "\n" * (MAX_MODULE_LINES - 1) + "y = 1\n",
        "kernels/big.py": "\n" * MAX_MODULE_LINES + "y = 1\n",  # exempt from the module size
        "memory/f.py": "def small():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1)  # just at the limit
                       + "class C:\n    def big(self):\n" + "        pass\n" * MAX_FUNCTION_LINES,
    })
    assert oversized_modules(tmp_path) == [f"arvdm/big.py ({MAX_MODULE_LINES + 1} lines)"]
    assert oversized_functions(tmp_path) == [f"memory/f.py:{MAX_FUNCTION_LINES + 2} C.big "
                                             f"({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_module_is_too_long():
    wrong = oversized_modules()
    assert not wrong, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(wrong)


def test_no_function_is_too_long():
    wrong = oversized_functions()
    assert not wrong, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(wrong)


# -- imports at the top ----------------------------------------------------------------------------------

def imports_inside_functions(root: Path = ROOT) -> list[str]:
    """Project imports inside function bodies, except in LAZY_IMPORT_ALLOWED_FILES and `# lazy:` lines."""
    out = []
    for path in python_files(root, LAZY_IMPORT_CHECKED):
        if path.name in LAZY_IMPORT_ALLOWED_FILES:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        functions = [n for n in ast.walk(parse(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in {n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            project = getattr(node, "level", 0) or any(n.split(".")[0] in PACKAGES for n in names)
            marked = any(LAZY_MARK.search(line) for line in lines[max(node.lineno - 2, 0):node.end_lineno])
            if project and not marked:
                where = f"{path.relative_to(root)}:{node.lineno}"
                out.append((path, node.lineno, f"{where} {lines[node.lineno - 1].strip()}"))
    return [line for *_, line in sorted(out)]


def test_the_import_position_check_finds_planted_lazy_imports(tmp_path):
    _plant(tmp_path, {
        "arvdm/a.py": "import os\nfrom memory import bank\n\n\ndef f():\n    from arvdm.b import g\n"
                      "    import matplotlib\n    import memory.bank  # lazy: because\n    return g\n",
        "data/b.py": "class C:\n    def m(self):\n        # lazy: torch is slow to import in workers\n"
                     "        from data import c\n        from . import d\n",
        "arvdm/p/__main__.py": "def main():\n    from arvdm.a import f\n",
    })
    assert imports_inside_functions(tmp_path) == ["arvdm/a.py:6 from arvdm.b import g", "data/b.py:5 from . import d"]


def test_project_imports_are_at_the_top():
    wrong = imports_inside_functions()
    assert not wrong, ("project imports inside functions (move them to the top, or say why with `# lazy: ...`):\n"
                       + "\n".join(wrong))


# -- names in docs/ARCHITECTURE.md -----------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w./-])(?:" + "|".join(PACKAGES) + r")(?:\.\w+)+(?![\w/])")


def _repository_paths(root: Path) -> list[tuple[str, ...]]:
    """The parts of every file and folder path under root (hidden folders and caches left out)."""
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        base = Path(here).relative_to(root).parts
        out += [base + (name,) for name in dirs + files]
    return out


def _resolves(name: str) -> bool:
    """Whether a dotted name is a module or an attribute of one (imports it; a `__main__` is only found)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        dotted = ".".join(parts[:i])
        is_submodule = hasattr(obj, "__path__") and importlib.util.find_spec(dotted) is not None
        if part == "__main__":
            return is_submodule
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif is_submodule:
            obj = importlib.import_module(dotted)
        else:
            return False
    return True


def architecture_problems(text: str, root: Path = ROOT) -> list[str]:
    """Paths that match no file or folder of the repository, and dotted project names (in code spans or blocks)
    that resolve to no module or attribute. A `.py` path may be named by its last parts (a tree listing's
    `denoiser.py` under `model/`); a folder is checked when it starts at a top-level folder (`arvdm/model/`),
    since other folders are a user's (`DATASET/training/`, run folders)."""
    existing = set()
    for parts in _repository_paths(root):
        existing.update(parts[i:] for i in range(len(parts)))
    top = {p.name for p in root.iterdir() if p.is_dir()}
    problems = []
    for token in re.findall(r"[\w./-]+", re.sub(r"\w+://\S+", "", text)):
        parts = tuple(token.rstrip(".").strip("/").split("/"))
        is_file = token.rstrip(".").endswith(".py") and parts[-1] != ".py"
        is_folder = token.rstrip(".").endswith("/") and not token.startswith("/") and parts[0] in top
        if (is_file or is_folder) and parts not in existing:
            problems.append(f"{token.rstrip('.')} (no such file or folder)")
    code = " ".join(re.findall(r"```.*?```", text, flags=re.S) + re.findall(r"`[^`\n]+`", text))
    for name in sorted(set(_DOTTED.findall(code))):
        if name.rsplit(".", 1)[1] not in FILE_SUFFIXES and not _resolves(name):
            problems.append(f"{name} (no such module or attribute)")
    return sorted(set(problems))


def test_the_architecture_check_finds_planted_wrong_names():
    text = ("```\narvdm/\n  model/\n    denoiser.py   Denoiser; arvdm.model.denoiser.NoSuchName\n  gone.py\n```\n"
            "`DATASET/training/` and `runs/` are a user's; `arvdm/gone/` is not.\n"
            "See `arvdm/nowhere.py`, `arvdm.model.denoiser.Denoiser`, `arvdm.no_module`, `memory.MemoryBank`,"
            " `python -m arvdm.schedules`, `arvdm.schedules.__main__`, `data.md`, `cfg.memory.length`, "
            "tests/test_structure.py and https://example.org/a/b.py.\n")
    assert architecture_problems(text) == [
        "arvdm.model.denoiser.NoSuchName (no such module or attribute)",
        "arvdm.no_module (no such module or attribute)",
        "arvdm/gone/ (no such file or folder)",
        "arvdm/nowhere.py (no such file or folder)",
        "gone.py (no such file or folder)",
    ]


def test_the_names_in_the_architecture_page_exist():
    wrong = architecture_problems(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not wrong, "docs/ARCHITECTURE.md names what does not exist:\n" + "\n".join(wrong)


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
    found = []
    for name in project_modules():
        if name.endswith("__main__") or not name.startswith(("arvdm", "memory", "data")):
            continue  # a CLI entry point runs when imported; kernels raise plain ValueError/TypeError for a
            # caller's bug (docs/INTERFACES.md); benchmarks and the CLIs define no errors
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
