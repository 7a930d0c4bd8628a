"""Rules for the tests themselves: every test that is not CUDA-marked names its device.

On a machine with a GPU, device="auto" (Session.open's default, the bench's and the CLI's) picks
CUDA, so a test that leaves the device out (or names "auto") would test something else there:
fp16 CUDA runs compared with CPU expectations. Only CUDA-marked tests and those ALLOWED_AUTO
lists, each with its reason, may. These checks read the tests' source with `ast`, child scripts
in string constants included, and name file:line.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# calls whose device defaults to "auto": each must say device=...
DEVICE_KEYWORD = ("Session.open", "BenchOptions", "run_demo")
# CLI verbs with a --device option defaulting to "auto": main([...]) with a literal list says it
DEVICE_VERBS = (("demo",), ("bench",), ("memory", "reencode"))
# tests that open with device "auto" on purpose (left out or named): (file, test function) -> why.
# Everything else that is not CUDA-marked names "cpu" (or "cuda"); an explicit "auto" counts as none
ALLOWED_AUTO: dict[tuple[str, str], str] = {}


def _is_cuda_marker(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "cuda" and "mark" in ast.unparse(n.value)
               for n in ast.walk(node))


def _marked_cuda(node: ast.AST) -> bool:
    return any(_is_cuda_marker(d) for d in getattr(node, "decorator_list", ()))


def _module_marked_cuda(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
               and _is_cuda_marker(n.value) for n in tree.body)


def _code_in_strings(tree: ast.AST):
    """(line, parsed tree) of each string constant or f-string that is Python code calling one
    of the functions above (the child scripts tests run in a fresh process)."""
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
            text = node.value
        elif isinstance(node, ast.JoinedStr):   # f-string: each {field} stands for a name
            text = "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
        else:
            continue
        if not any(f"{name}(" in text for name in DEVICE_KEYWORD):
            continue
        try:
            yield node.lineno, ast.parse(text)
        except SyntaxError:
            pass   # prose that mentions a call, not code


def _is_auto(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "auto"


def _missing_device(tree: ast.AST, cuda: bool, where: str, first_line: int, out: list[str],
                    allowed: dict[tuple[str, str], str], test: str = "") -> None:
    def visit(node: ast.AST, cuda: bool, test: str) -> None:
        for child in ast.iter_child_nodes(node):
            marked = cuda or _marked_cuda(child)
            inside = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not test else test
            if isinstance(child, ast.Call) and not marked and (where, inside) not in allowed:
                line = first_line + child.lineno - 1
                name = ast.unparse(child.func)
                device = [k.value for k in child.keywords if k.arg == "device"]
                if any(name == n or name.endswith("." + n) for n in DEVICE_KEYWORD):
                    if not device:
                        out.append(f"{where}:{line}: {name}(...) without device=")
                    elif _is_auto(device[0]):
                        out.append(f"{where}:{line}: {name}(..., device='auto')")
                if name == "main" and child.args and isinstance(child.args[0], ast.List):
                    words = [e.value for e in child.args[0].elts if isinstance(e, ast.Constant)]
                    if any(words[:len(v)] == list(v) for v in DEVICE_VERBS):
                        given = words.index("--device") if "--device" in words else None
                        if given is None:
                            out.append(f"{where}:{line}: main([{', '.join(map(repr, words[:2]))}, ...]) "
                                       "without --device")
                        elif words[given + 1:given + 2] == ["auto"]:
                            out.append(f"{where}:{line}: main([..., '--device', 'auto'])")
            visit(child, marked, inside)
    visit(tree, cuda, test)


def _enclosing_test(tree: ast.Module, line: int) -> str:
    """The top-level function of `tree` that holds `line` ("" at module level)."""
    return next((n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.lineno <= line <= n.end_lineno), "")


def find_missing_devices(root: Path = TESTS, allowed: dict[tuple[str, str], str] | None = None) -> list[str]:
    allowed = ALLOWED_AUTO if allowed is None else allowed
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue   # its own sample below breaks the rules on purpose
        where = str(path.relative_to(root.parent))
        tree = ast.parse(path.read_text(), filename=where)
        cuda = _module_marked_cuda(tree)
        _missing_device(tree, cuda, where, 1, out, allowed)
        cuda_lines = {ln for n in ast.walk(tree) if _marked_cuda(n)
                      for ln in range(n.lineno, n.end_lineno + 1)}
        for line, code in _code_in_strings(tree):
            _missing_device(code, cuda or line in cuda_lines, where, line, out, allowed,
                            _enclosing_test(tree, line))
    return out


def test_every_test_that_is_not_cuda_marked_names_its_device():
    missing = find_missing_devices()
    assert not missing, ("pass device=\"cpu\" (or --device cpu) explicitly; on a GPU machine 'auto' "
                         "picks CUDA:\n" + "\n".join(missing))


def test_the_device_check_sees_what_it_must(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('''
import pytest
from capsule import Session

def _open(path, **kw):
    return Session.open(path, model=None, **kw)

def test_a(tmp_path):
    Session.open(tmp_path, device="cpu")
    main(["demo", "--model", "builtin:tiny"])
    main(["bench", "--suite", "decode", "--device", "cpu"])
    BenchOptions(quick=True)

CHILD = """
from capsule import Session
s = Session.open(sys.argv[1], model=None)
"""

def test_child(tmp_path):
    code = f"""
with Session.open({str(tmp_path)!r}, model=None) as s:
    pass
"""

@pytest.mark.cuda
def test_gpu(tmp_path):
    Session.open(tmp_path, model=None)
    code = """Session.open(p)"""

def test_auto(tmp_path):
    Session.open(tmp_path, model=None, device="auto")
    main(["bench", "--suite", "decode", "--device", "auto"])

def test_auto_on_purpose(tmp_path):
    Session.open(tmp_path, model=None)
    code = """Session.open(p, device="auto")"""
''')
    got = find_missing_devices(tmp_path / "tests", {("tests/test_x.py", "test_auto_on_purpose"): "checks 'auto'"})
    assert got == ["tests/test_x.py:6: Session.open(...) without device=",
                   "tests/test_x.py:10: main(['demo', '--model', ...]) without --device",
                   "tests/test_x.py:12: BenchOptions(...) without device=",
                   "tests/test_x.py:31: Session.open(..., device='auto')",
                   "tests/test_x.py:32: main([..., '--device', 'auto'])",
                   "tests/test_x.py:16: Session.open(...) without device=",
                   "tests/test_x.py:21: Session.open(...) without device="], got
    assert len(find_missing_devices(tmp_path / "tests", {})) == len(got) + 2   # the allowed test's two calls
    assert all(why for why in ALLOWED_AUTO.values()), "each allowed 'auto' test says why"
