"""Architecture rules, checked on the source (no imports): the project's import graph has no cycle, the
serving process never loads the oracle, no installed module imports the lab, and no module keeps
mutable state of its own.

Modules are named as installed: ``sglang_hs/x.py`` is ``sglang_hs.x``, ``radix/x.py`` is
``sglang_hs.radix.x``, ``kernels/x.py`` is ``sglang_hs.kernels.x``, ``launch/x.py`` is
``sglang_hs.launch.x``; ``lab/x.py`` (not installed, run as ``python lab/x.py``, which puts ``lab/`` on
``sys.path``) is ``lab.x`` here and ``x`` in its own imports. Every import counts: function-level ones,
``importlib.import_module("...")`` and ``__import__("...")``, and module names passed as strings
(``"module"``, ``"module.attr"`` or ``"module:attr"``, e.g. to an SGLang registry); the entry points
come from ``pyproject.toml``.
"""

from __future__ import annotations

import ast
import os
import tomllib

from conftest import REPO_ROOT

PACKAGE_FOLDERS = {"sglang_hs": "sglang_hs", "radix": "sglang_hs.radix", "kernels": "sglang_hs.kernels",
                   "launch": "sglang_hs.launch"}  # fmt: skip
LAB_FOLDER, LAB_PACKAGE = "lab", "lab"
ORACLE = "sglang_hs.reference"
TOOL_PACKAGES = ("sglang_hs.launch.", "lab.")
"""Command-line tools and the lab: they may compare against the oracle."""
ORACLE_USERS = {"sglang_hs.kernels.cases"}
"""Besides the tools: the synthetic kernel cases, whose reference outputs the GPU tests check against."""
IMPORT_FUNCTIONS = {"import_module", "__import__"}
MUTATING_METHODS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add",
                    "discard", "remove", "sort", "reverse", "__setitem__"}  # fmt: skip
MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "deque", "OrderedDict", "Counter"}


def _folder_modules(folder: str, package: str) -> dict[str, str]:
    path = os.path.join(REPO_ROOT, folder)
    if not os.path.isdir(path):
        return {}
    return {f"{package}.{name[:-3]}": os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".py")}


def package_sources() -> dict[str, str]:
    """``{module name: file path}`` of every installed module."""
    modules = {}
    for folder, package in PACKAGE_FOLDERS.items():
        modules.update(_folder_modules(folder, package))
    return modules


def lab_sources() -> dict[str, str]:
    """``{lab.<name>: file path}`` of every lab module."""
    return _folder_modules(LAB_FOLDER, LAB_PACKAGE)


def entry_points() -> set[str]:
    """The modules ``pyproject.toml``'s entry points name (``module:attr``)."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f)["project"].get("entry-points", {})
    return {target.split(":")[0] for group in groups.values() for target in group.values()}


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _named_module(text: str, known: set[str]) -> str | None:
    """The known module a string names: ``module``, ``module:attr`` or ``module.attr``."""
    name = text.split(":")[0]
    if name in known:
        return name
    parent = name.rpartition(".")[0]
    return parent if parent in known else None


def imported_modules(tree: ast.Module, known: set[str], local: str | None = None) -> set[str]:
    """The known modules ``tree`` imports anywhere (``from pkg import mod`` counts as ``pkg.mod``), by
    import statements, import functions or module names in strings passed to calls. ``local``: the
    package of the file's top-level siblings (the lab's ``import x`` is ``lab.x``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call):
            for arg in [*node.args, *(keyword.value for keyword in node.keywords)]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if named := _named_module(arg.value, known):
                        found.add(named)
    if local:
        found |= {f"{local}.{name}" for name in found}
    return found & known


def import_graph(include_lab: bool = True) -> dict[str, set[str]]:
    sources = package_sources()
    lab = lab_sources() if include_lab else {}
    known = set(sources) | set(lab)
    graph = {module: imported_modules(parse(path), known) - {module} for module, path in sources.items()}
    graph.update({module: imported_modules(parse(path), known, LAB_PACKAGE) - {module} for module, path in lab.items()})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 20 and "sglang_hs.radix.hook" in graph and "sglang_hs.kernels.compress" in graph
    assert any(module.startswith("lab.") for module in graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_sees_function_level_and_string_imports():
    known = {"sglang_hs.a", "sglang_hs.b", "sglang_hs.c"}
    sources = (
        "def f():\n    from sglang_hs import b\n",
        "import importlib\ndef f():\n    return importlib.import_module('sglang_hs.b')\n",
        "def f():\n    return __import__('sglang_hs.b')\n",
        "register('x', lazy('sglang_hs.b.create'))\n",
        "register(name='x', target='sglang_hs.b:create')\n",
    )
    for source in sources:
        graph = {"sglang_hs.a": imported_modules(ast.parse(source), known), "sglang_hs.b": {"sglang_hs.a"}}
        assert find_cycle(graph) == ["sglang_hs.a", "sglang_hs.b", "sglang_hs.a"], source
    # A docstring or message that names a module is not an import.
    assert not imported_modules(ast.parse('"""sglang_hs.b"""\nprint("see sglang_hs.b")\n'), known)
    # The lab's own modules import each other by bare name.
    assert imported_modules(ast.parse("import c\n"), {"lab.c", "sglang_hs.c"}, "lab") == {"lab.c"}


def test_installed_modules_never_import_the_lab():
    graph = import_graph()
    reach = {module: sorted(t for t in targets if t.startswith("lab.")) for module, targets in graph.items()
             if not module.startswith("lab.")}  # fmt: skip
    assert not {module: targets for module, targets in reach.items() if targets}
    lab_names = {module.split(".", 1)[1] for module in lab_sources()}
    for module, path in package_sources().items():
        bare = imported_modules(parse(path), {f"lab.{name}" for name in lab_names}, "lab")
        assert not bare, (module, bare)


def test_serving_never_loads_the_oracle():
    """What a server process can import, starting from the entry points, does not include the
    reference; and only tools, the lab and the kernel cases import the reference at all."""
    graph = import_graph()
    roots = entry_points()
    assert roots == {"sglang_hs.plugin"} and roots <= set(graph)
    reachable, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in reachable:
            reachable.add(module)
            todo += graph[module]
    assert {"sglang_hs.backend", "sglang_hs.radix.hook", "sglang_hs.radix.factory", "sglang_hs.runtime",
            "sglang_hs.kernels.compress", "sglang_hs.kernels.decode", "sglang_hs.fallback"} <= reachable  # fmt: skip
    assert ORACLE not in reachable
    users = {module for module, targets in graph.items() if ORACLE in targets}
    assert {m for m in users if not m.startswith(TOOL_PACKAGES)} <= ORACLE_USERS, users


# ------------------------------------------------------------------------------------------ state
def _is_constant_name(name: str) -> bool:
    return name.lstrip("_").isupper()


def _is_mutable_value(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _top_level_statements(tree: ast.Module):
    """Statements that run at import: the module body, its ``if``/``try`` blocks and class bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]


def mutable_state(tree: ast.Module) -> list[str]:
    """Why ``tree`` keeps mutable state at module level (empty if it does not).

    The rule: a module or class body may bind a mutable container (list, dict, set, ...) only to an
    ALL_CAPS name, a constant that nothing writes to (no item assignment, no mutating method call on
    it anywhere in the module); no ``global`` statement; no assignment to an attribute of a module-level
    class from anywhere (class attributes as process-wide variables). Memoized pure functions
    (``functools.lru_cache`` on kernel builders) are not state: their result depends on their arguments only.
    """
    problems, constants = [], set()
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in _top_level_statements(tree):
        value = getattr(node, "value", None)
        for target in _targets(node):
            if isinstance(target, ast.Name) and _is_mutable_value(value):
                if _is_constant_name(target.id):
                    constants.add(target.id)
                else:
                    problems.append(f"line {node.lineno}: {target.id} is a mutable container at module level")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            problems.append(f"line {node.lineno}: {type(node).__name__.lower()} {', '.join(node.names)}")
        for target in _targets(node) if isinstance(node, ast.stmt) else []:
            for part in ast.walk(target):
                if isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name) and part.value.id in constants:
                    problems.append(f"line {node.lineno}: writes to the constant {part.value.id}")
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id in classes:
                    problems.append(f"line {node.lineno}: assigns class attribute {part.value.id}.{part.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_METHODS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in constants):  # fmt: skip
            problems.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}() mutates a constant")
    return problems


def test_no_module_keeps_mutable_state():
    found = {}
    for module, path in {**package_sources(), **lab_sources()}.items():
        problems = mutable_state(parse(path))
        if problems:
            found[module] = problems
    assert not found, found


def test_mutable_state_rule():
    bad = ("cache = {}\n", "_seen: set[str] = set()\n", "def f():\n    global x\n",
           "TABLE = {}\ndef f():\n    TABLE['a'] = 1\n", "NAMES = []\ndef f():\n    NAMES.append(1)\n",
           "class C:\n    width = 0\ndef f():\n    C.width = 3\n", "class C:\n    seen = {}\n",
           "if True:\n    found = []\n")  # fmt: skip
    for source in bad:
        assert mutable_state(ast.parse(source)), source
    good = ("TABLE = {'a': 1}\ndef f():\n    return TABLE['a']\n", "NAMES = ('a', 'b')\n",
            "logger = object()\n", "def f():\n    seen = {}\n    seen['a'] = 1\n",
            "class C:\n    DOCS = {'a': 'b'}\n    def __init__(self):\n        self.seen = {}\n")  # fmt: skip
    for source in good:
        assert not mutable_state(ast.parse(source)), source
