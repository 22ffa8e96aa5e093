"""The package's import graph: no cycle anywhere inside ``xfuse/``, and the floors the design names (a family folder
imports nothing back through its spec; ``xfuse.pipelines`` sits below the families; ``comm`` below the runtime).

Every ``import`` / ``from ... import`` statement counts, wherever it stands (a function body's lazy import or a
``TYPE_CHECKING`` block too): a cycle hidden behind a lazy import is still a cycle of the design."""

import ast
import os

import pytest

from tests.support import REPO

PACKAGE = os.path.join(REPO, "xfuse")


def _module_name(path: str) -> str:
    name = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The ``xfuse`` modules ``name`` imports: ``from a.b import c`` names ``a.b.c`` where that is a module, else
    ``a.b``; relative imports resolved against the module's package."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_inside_xfuse_has_no_cycle():
    assert len(GRAPH) > 100  # every module of the package was read
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(
    "graph,expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),  # a self-import is no cycle
    ],
)
def test_the_cycle_finder_finds_what_it_should(graph, expected):
    assert cycles(graph) == expected


def test_an_import_behind_a_function_or_type_checking_counts():
    """The walk sees lazy and ``TYPE_CHECKING`` imports: the spec's convention-based lookup is not one of them (the
    families' spec modules import none of their folder's code)."""
    assert "xfuse.families.registry" in GRAPH["xfuse"]  # xfuse.__getattr__'s lazy import
    for name in MODULES:
        if name.startswith("xfuse.families.") and name.endswith(".spec") and name != "xfuse.families.spec":
            family = name.removesuffix(".spec")
            assert not {m for m in GRAPH[name] if m.startswith(family + ".")}, name


def test_the_floors():
    """``xfuse.pipelines`` reads of the families only the spec contract and the folder reader (the families build on
    it, not it on them); ``comm`` imports nothing above it but the package's leaves."""
    leaves = ("xfuse.comm", "xfuse.errors", "xfuse.stderr", "xfuse.types")
    for name, imports in GRAPH.items():
        if name.startswith("xfuse.pipelines"):
            families = {m for m in imports if m.startswith("xfuse.families")}
            assert families <= {"xfuse.families.spec", "xfuse.families.folder"}, (name, families)
        if name.startswith("xfuse.comm"):
            above = {m for m in imports if not m.startswith(leaves)}
            assert not above, (name, above)


# Modules outside the family folders that hold data about released models by name: the published latencies the
# performance model is checked against, the curves measured per family, the reference family, the default model.
NAMING_ALLOWED = {
    "xfuse.perf.published": "published latencies of released models",
    "xfuse.perf.measured": "pass curves measured per family, and the reference family",
    "xfuse.config.whole": "the default model (the `tiny` preset)",
}


def _family_words() -> set[str]:
    from xfuse.families.registry import FAMILIES

    words: set[str] = set()
    for spec in FAMILIES:
        words |= {spec.name, spec.diffusers_pipeline, spec.diffusers_transformer, spec.stage_name, *spec.presets}
        words |= {name for name in (spec.controlnet, spec.image_to_video) if name}
        words |= set(spec.pipeline_names)
    return words


def _names_in_code(path: str, words: set[str]) -> list[tuple[int, str]]:
    """String constants of ``path`` that are a family's name, class or preset, and names of its classes used as
    identifiers (docstrings aside; a variable called ``small`` is no preset)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in words:
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name) and node.id in words and node.id[:1].isupper():  # a class, not a word
            found.append((node.lineno, node.id))
    return found


def _family_folder(name: str) -> str | None:
    parts = name.split(".")
    shared = ("common", "generic", "spec", "registry", "folder")  # what every family uses: no family's folder
    if len(parts) > 2 and parts[1] == "families" and parts[2] not in shared:
        return ".".join(parts[:3])
    return None


def test_no_module_outside_a_family_folder_names_a_family():
    """Adding a family is its folder and its registry line: no other module imports a family's code or names its
    family, classes or presets in code (the registry's import of each spec is the one line a family adds; modules
    that hold data about released models by name are listed in ``NAMING_ALLOWED``, with why)."""
    words = _family_words()
    assert {"flux", "FluxPipeline", "PipeFusionFluxPipeline", "FluxStage", "flux-tiny"} <= words
    for name, path in MODULES.items():
        folder = _family_folder(name)
        for imported in GRAPH[name]:
            home = _family_folder(imported)
            if (
                home is not None
                and home != folder
                and not (name == "xfuse.families.registry" and imported == home + ".spec")
            ):
                pytest.fail(f"{name} imports {imported}: only its own folder and the registry's spec line may")
        if folder is None and name not in NAMING_ALLOWED:
            assert _names_in_code(path, words) == [], name
