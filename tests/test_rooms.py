"""The package's rooms (DESIGN.md, "Layout"): who may import whom, read from the source with `ast`.

DESIGN's dependency rule, top to bottom: cli -> control, bench (under tools/) -> session -> fleet -> memory, policy -> llm
-> lite -> state -> tokenize, store -> edge_kernels, devices, errors. A lower room never imports a
higher one. Imports are read statically (module level, inside functions, under TYPE_CHECKING);
an `importlib.import_module` string is not seen, so keep those inside one room.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SDK = REPO / "sdk"

# Highest room first; rooms on one level do not import each other. The tools (demo, doctor,
# store report, repair and the bench suites under tools/bench) sit above control (the control
# suite drives a ControlLoop); the package root (it re-exports Session and ControlLoop) below
# the command line's rooms and above the runtime's.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("tools",),              # the modules only the command line runs, the benchmark suites included
    ("capsule",),            # the package root
    ("control",),
    ("session",),            # session.py, session_*.py, assembly.py: the composition of the parts
    ("fleet",),              # replication to object storage, fleet memory (over the store and memory)
    ("memory", "policy"),
    ("llm",),
    ("lite",),               # the torch-free restore: reads capsules (state, store), runs ORT; llm writes its kit
    ("state",),
    ("tokenize", "store"),
    ("base",),               # errors, paths, safejson, stats, _version: small shared vocabulary
)
RANK = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}
TOP_LEVEL_ROOMS = {"cli": "cli", "control": "control", "session": "session", "assembly": "session",
                   "errors": "base", "paths": "base", "safejson": "base", "stats": "base", "_version": "base",
                   "cudagraph": "base", "trt_plan": "base", "sdnotify": "base", "digests": "base",
                   "gguf_header": "base", "safetensors_header": "base"}


@dataclass(frozen=True)
class Import:
    source: str      # importing module, dotted
    target: str      # imported module (a submodule when `from pkg import sub` names one), dotted
    at_import: bool  # runs when the source module is imported (not inside a function)
    typing_only: bool  # under `if TYPE_CHECKING:`


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path, root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: set[str]) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], at_import: bool, typing_only: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(Import(module, a.name, at_import, typing_only) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.append(Import(module, sub if sub in known else target, at_import, typing_only))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, at_import, True)
                visit(node.orelse, at_import, typing_only)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, False, typing_only)
            else:  # class bodies, if/try/with/for blocks: same timing as their parent
                for field in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(node, field, None)
                    if isinstance(block, list):
                        visit(block, at_import, typing_only)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)).body, True, False)
    return found


def capsule_imports() -> list[Import]:
    """Every import in sdk/capsule/**.py whose target is a capsule module (not itself)."""
    mods = _modules(SDK / "capsule", SDK)
    known = set(mods)
    return [i for m, p in mods.items() for i in _imports(m, p, known) if i.target in known and i.target != m]


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "capsule"
    name = parts[1]
    if len(parts) > 2 or (SDK / "capsule" / name).is_dir():
        return name
    if name.startswith("session_"):
        return "session"
    assert name in TOP_LEVEL_ROOMS, (f"{module} sits in no room: add it to TOP_LEVEL_ROOMS in {__file__} "
                                     "(which level of DESIGN.md's dependency rule is it?)")
    return TOP_LEVEL_ROOMS[name]


def test_import_capsule_loads_no_tool_no_bench_no_tqdm():
    # torch itself imports tqdm (torch.hub), so the check is who asks for it, not whether it is loaded
    code = (
        "import builtins, sys\n"
        "asked, real = [], builtins.__import__\n"
        "def spy(name, globals=None, *args, **kw):\n"
        "    if name.split('.')[0] == 'tqdm':\n"
        "        asked.append((globals or {}).get('__name__', '?'))\n"
        "    return real(name, globals, *args, **kw)\n"
        "builtins.__import__ = spy\n"
        "import capsule\n"
        "print([m for m in sys.modules if m.split('.')[:2] == ['capsule', 'tools']])\n"
        "print(sorted({a for a in asked if a.split('.')[0] == 'capsule'}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SDK)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded, tqdm_importers = proc.stdout.splitlines()[-2:]
    assert loaded == "[]", f"`import capsule` loaded CLI-only or bench modules: {loaded}"
    assert tqdm_importers == "[]", f"`import capsule` made these capsule modules import tqdm: {tqdm_importers}"


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    back: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        if node == goal:
            out = [node]
            while back[out[-1]] is not None:
                out.append(back[out[-1]])  # type: ignore[arg-type]
            return out[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in back:
                back[nxt] = node
                todo.append(nxt)
    return None


def test_no_import_cycles():
    # a cycle: A imports B when A is imported, and B imports A (at import time or in a function).
    # TYPE_CHECKING-only imports never run, so they make no cycle.
    runs = [i for i in capsule_imports() if not i.typing_only]
    graph: dict[str, set[str]] = {}
    for i in runs:
        graph.setdefault(i.source, set()).add(i.target)
    cycles = set()
    for i in runs:
        if i.at_import:
            back = _path(graph, i.target, i.source)
            if back is not None:
                cycles.add(" -> ".join([i.source, *back]))
    assert not cycles, "import cycles (break them: move the shared part into a lower module):\n" + "\n".join(
        sorted(cycles))


def test_no_room_imports_a_higher_room():
    upward = sorted({f"{i.source} ({room(i.source)}) imports {i.target} ({room(i.target)})"
                     for i in capsule_imports()
                     if room(i.source) != room(i.target) and RANK[room(i.target)] <= RANK[room(i.source)]})
    assert not upward, "imports against DESIGN.md's dependency rule:\n" + "\n".join(upward)


def test_only_the_cli_reaches_the_tools_and_the_bench():
    assert (SDK / "capsule" / "tools" / "bench" / "__init__.py").is_file()
    assert not (SDK / "capsule" / "bench").exists(), "the bench suites live under capsule/tools/bench"
    outside = sorted({f"{i.source} imports {i.target}" for i in capsule_imports()
                      if room(i.target) == "tools" and room(i.source) not in ("cli", "tools")})
    assert not outside, "the runtime must not import CLI-only or bench modules:\n" + "\n".join(outside)


def test_the_store_knows_nothing_of_models():
    higher = {"llm", "memory", "policy", "session"}
    bad = sorted({f"{i.source} imports {i.target}" for i in capsule_imports()
                  if room(i.source) == "store" and room(i.target) in higher})
    assert not bad, "\n".join(bad)
    # nor of memory facts: their columns, search and embeddings live in memory/ (on keyed records)
    store = REPO / "sdk" / "capsule" / "store"
    assert not sorted(p.name for p in store.glob("fact*.py"))
    words = re.compile(r"bm25|n_tokens|\brope\b|embedding|fingerprint", re.I)
    assert not [f"{p.name}: {line.strip()}" for p in store.glob("*.py") for line in p.read_text().splitlines()
                if words.search(line)]


def test_devices_and_edge_kernels_import_only_errors_from_capsule():
    bad = []
    for package in ("devices", "edge_kernels"):
        mods = _modules(REPO / package, REPO)
        for m, p in mods.items():
            bad += [f"{m} imports {i.target}" for i in _imports(m, p, set(mods))
                    if i.target.split(".")[0] == "capsule" and i.target != "capsule.errors"]
    assert not bad, "\n".join(bad)


def test_every_profile_engine_is_registered():
    import devices.profile

    from capsule.policy.registry import engine_names

    registered = set(engine_names())
    for path in sorted((REPO / "devices").glob("*.yaml")):
        engines = yaml.safe_load(path.read_text())["engines"]
        assert set(engines) <= registered, f"{path.name}: engines {engines}, registered: {sorted(registered)}"
    # the registry is the only list of engines: devices (below capsule) keeps none
    assert not hasattr(devices.profile, "ENGINES")


# Private attributes of objects from other libraries that have no public equivalent: why each
THIRD_PARTY_PRIVATE = {
    ("capsule.tokenize.families", "_pat_str"): "tiktoken.Encoding keeps its split pattern only there",
    ("capsule.tokenize.families", "_special_tokens"): "tiktoken.Encoding: the special-token table",
    ("capsule.tokenize.kinds", "_vocab_file"): "a transformers tokenizer's vocabulary path",
    ("capsule.tokenize.kinds", "_tokenizer"): "a transformers fast tokenizer's Rust tokenizer",
}


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions and classes (and their methods), and every
    attribute it assigns (self._x = ..., obj._x = ..., class-level _x = ..., __slots__)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)      # __slots__ entries, object.__setattr__(self, "_x", ...)
    return {n for n in own if n.startswith("_")}


def test_no_module_touches_a_private_attribute_of_another():
    # x._name where x is not self / cls and the module itself does not define _name: a seam
    # that should be a public attribute or method of the other module (issue 12)
    bad = []
    for module, path in _modules(SDK / "capsule", SDK).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or (module, node.attr) in THIRD_PARTY_PRIVATE:
                continue
            bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "private attributes of other modules (add a public view instead):\n" + "\n".join(bad)
