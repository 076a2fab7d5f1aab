"""The runtime's and the planner's modules form trees, and stay small.

- No import cycle among megatron_hexi's modules, nor among planner's, counting every import:
  function-local ones and those for type checking only (a cycle of type-only imports still ties
  the modules together: neither can be read, moved or tested without the other). A package
  counts as its `__init__.py`, so a submodule that imports from its own package is a cycle.
- No module of megatron_hexi/ or planner/ is over MAX_LINES lines (SIZE_CHECKED lists the
  folders). What the planner's modules may import at all is checked in
  tests/planner/test_geometry_owner.py.

Read from the source (ast), nothing imported: the check needs no torch.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 700
SIZE_CHECKED = ("megatron_hexi", "planner")


def _modules(package):
    """{dotted module name: file} of every module under the package folder `package`."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        parts = os.path.relpath(folder, ROOT).split(os.sep)
        for f in files:
            if f.endswith(".py"):
                name = parts if f == "__init__.py" else [*parts, f[:-3]]
                out[".".join(name)] = os.path.join(folder, f)
    return out


def _imports(package):
    """{module: modules of `package` it imports anywhere, type-only imports included}. `from
    P import x` is an import of P.x where that is a module, else of P itself."""
    mods = _modules(package)
    graph = {}
    for mod, path in mods.items():
        is_package = path.endswith("__init__.py")
        tree = ast.parse(open(path).read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    here = mod.split(".") if is_package else mod.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _cycle(graph):
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    done, active = set(), []

    def visit(mod):
        if mod in active:
            return active[active.index(mod) :] + [mod]
        if mod in done:
            return None
        active.append(mod)
        for dep in sorted(graph[mod]):
            found = visit(dep)
            if found:
                return found
        active.pop()
        done.add(mod)
        return None

    for mod in sorted(graph):
        found = visit(mod)
        if found:
            return found
    return None


def test_cycle_finder_finds_cycles():
    """The check can fail: a type-only tie back, or a submodule importing its package."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"p"}}) == ["p", "p.x", "p"]


def test_runtime_imports_form_a_tree():
    graph = _imports("megatron_hexi")
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the checkpoint modules read a trainer through checkpoint.state.TrainState, never training
    ckpt = [m for m in graph if m.startswith("megatron_hexi.checkpoint.")]
    assert len(ckpt) >= 7, ckpt
    assert not any("megatron_hexi.training" in graph[m] for m in ckpt)
    assert "megatron_hexi.checkpoint.state" in graph["megatron_hexi.checkpoint.writer"]
    assert "megatron_hexi.distributed" in graph["megatron_hexi.training"]
    assert "megatron_hexi.metrics" in graph["megatron_hexi.training"]


def test_planner_imports_form_a_tree():
    graph = _imports("planner")
    assert len(graph) > 30, sorted(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the baselines read a search through its state's module, never the strategy runner
    assert "planner.search" not in graph["planner.search_baselines"]
    assert "planner.plan" not in graph["planner.splits"]


def test_modules_are_at_most_700_lines():
    sizes = {
        os.path.relpath(path, ROOT): sum(1 for _ in open(path))
        for package in SIZE_CHECKED
        for path in _modules(package).values()
    }
    assert len(sizes) > 50, sorted(sizes)
    assert {path.split(os.sep)[0] for path in sizes} == set(SIZE_CHECKED)  # each folder read
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"
