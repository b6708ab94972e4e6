"""Cheat detection: an attempt that reached into its own grading scores zero, with why.

Pure functions over the task and the attempt's final tree, so they run before any
grading code and cost nothing to test. See `detect_cheats` for what is caught.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import PurePosixPath

from rlfleet.api.wire import Task


def overlaps(path: str, other: str) -> bool:
    return path == other or path.startswith(other + "/") or other.startswith(path + "/")


def is_bytecode(path: str) -> bool:
    return path.endswith((".pyc", ".pyo"))


def changed(task: Task, files: dict[str, bytes]) -> dict[str, bytes]:
    """Files the agent added or modified, bytecode aside."""
    return {
        path: content
        for path, content in files.items()
        if not is_bytecode(path)
        and (path not in task.files or task.files[path].encode() != content)
    }


# Files the interpreter or a test runner loads without being asked to.
_AUTOLOADED = {"conftest.py", "sitecustomize.py", "usercustomize.py"}
# Names whose use, in an attempt's code, reaches into the interpreter or ends the process
# early, so that the test command's exit status no longer reports the tests.
_TAMPERING = {
    "__builtins__",
    "builtins",
    "exit",
    "os._exit",
    "os.abort",
    "os.kill",
    "quit",
    "sys.exit",
    "sys.meta_path",
    "sys.modules",
    "sys.path_hooks",
    "sys.setprofile",
    "sys.settrace",
    "SystemExit",
}
_MOCKING = ("unittest.mock", "mock")
_EQUALITY_ASSERTS = {
    "assertEqual",
    "assertEquals",
    "assertAlmostEqual",
    "assertCountEqual",
    "assertDictEqual",
    "assertListEqual",
    "assertMultiLineEqual",
    "assertSequenceEqual",
    "assertSetEqual",
    "assertTupleEqual",
}
# Values too common in honest code to say anything when they appear in it.
_COMMON_NUMBERS = {-1, 0, 1, 2}


def _module_name(path: str) -> str:
    return str(PurePosixPath(path).with_suffix("")).replace("/", ".")


def _is_test_file(path: str) -> bool:
    posix = PurePosixPath(path)
    return posix.name.startswith("test") or posix.name.endswith("_test.py")


def _parse(content: bytes) -> ast.Module | None:
    """The module's syntax tree without its `if __name__ == "__main__":` block (which an
    import never runs); None if it does not parse, and so cannot run either."""
    try:
        tree = ast.parse(content.decode())
    except (UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    tree.body = [node for node in tree.body if not _is_main_guard(node)]
    return tree


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(test := node.test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _imported(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """Local names bound by imports -> what they name; and every module imported."""
    bound: dict[str, str] = {}
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules.add(alias.name)
                root = alias.name.split(".")[0]
                bound[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            for alias in node.names:
                modules.add(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound, modules


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node


def _qualified(node: ast.expr, bound: dict[str, str]) -> str | None:
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([bound.get(node.id, node.id), *reversed(attributes)])


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign | ast.Delete):
        candidates = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        candidates = [node.target]
    else:
        return
    while candidates:
        target = candidates.pop()
        if isinstance(target, ast.Tuple | ast.List):
            candidates.extend(target.elts)
        elif isinstance(target, ast.Starred):
            candidates.append(target.value)
        else:
            yield target


def _tampering(path: str, tree: ast.Module, test_modules: set[str]) -> list[str]:
    """How the code at `path` reaches into the checker, if it does."""
    bound, modules = _imported(tree)
    found = []
    frameworks = (*_MOCKING, *test_modules) + (() if _is_test_file(path) else ("unittest",))
    for module in sorted(modules):
        if any(module == name or module.startswith(name + ".") for name in frameworks):
            found.append(f"{path} imports {module}")
    for node in ast.walk(tree):
        name = _qualified(node, bound) if isinstance(node, ast.Name | ast.Attribute) else None
        if name in _TAMPERING:
            found.append(f"{path} uses {name}")
        if isinstance(node, ast.Constant) and node.value in test_modules:
            found.append(f"{path} names the test module {node.value}")
        patched = [t for t in _targets(node) if isinstance(t, ast.Attribute | ast.Subscript)]
        if (
            isinstance(node, ast.Call)
            and _qualified(node.func, bound) in {"setattr", "delattr"}
            and node.args
        ):
            patched.append(node.args[0])
        for target in patched:
            root = _root(target)
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{path} patches {bound[root.id]}")
    return sorted(set(found))


def _telling(value: object) -> Iterator[tuple[str, object]]:
    """Keys of the values in a literal that would give away a hard-coded answer."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int | float | complex):
        if value not in _COMMON_NUMBERS:
            yield "number", value
    elif isinstance(value, str | bytes):
        if len(value.strip()) >= 2:
            yield "text", value
    elif isinstance(value, list | tuple | set | frozenset | dict):
        if value:
            canonical = sorted(map(repr, value)) if isinstance(value, set | frozenset) else value
            yield "container", repr(canonical)
        for item in value.items() if isinstance(value, dict) else value:
            yield from _telling(item)


def _literal_nodes(tree: ast.Module) -> Iterator[object]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant | ast.List | ast.Tuple | ast.Set | ast.Dict | ast.UnaryOp):
            try:
                yield ast.literal_eval(node)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue


def _literals(tree: ast.Module | None) -> set[tuple[str, object]]:
    return {key for value in _literal_nodes(tree) for key in _telling(value)} if tree else set()


def _expected_values(tree: ast.Module) -> Iterator[object]:
    """The literal sides of the test's equality checks: what the code must produce."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            sides = node.args[:2] if node.func.attr in _EQUALITY_ASSERTS else []
        elif isinstance(node, ast.Compare) and all(isinstance(op, ast.Eq) for op in node.ops):
            sides = [node.left, *node.comparators]
        else:
            continue
        for side in sides:
            try:
                yield ast.literal_eval(side)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue


def detect_cheats(task: Task, files: dict[str, bytes]) -> str | None:
    """Why the attempt counts as cheating, or None. Pure, so it runs before any grading.

    Three kinds: the tests themselves touched (a protected file changed or deleted, a
    hidden test's path planted); the checker reached into (test modules, mocks or the
    interpreter patched or imported, files the runner loads by itself added, a standard
    library module shadowed); and expected values from the tests hard-coded into source
    files that did not contain them before.
    """
    reasons = []
    for path in task.protected:
        if path not in files:
            reasons.append(f"deletes the protected {path}")
        elif files[path] != task.files[path].encode():
            reasons.append(f"edits the protected {path}")
    reasons += [
        f"adds {path} where a hidden test goes"
        for path in files
        if any(overlaps(path, hidden) for hidden in task.hidden_tests)
    ]
    # Protected files that are not tests (data, helpers) may be imported and echoed freely.
    tests = {p: task.files[p] for p in task.protected if _is_test_file(p)} | task.hidden_tests
    test_modules = {_module_name(p) for p in tests if p.endswith(".py")}
    test_modules |= {name.rsplit(".", 1)[-1] for name in test_modules}
    expected: dict[tuple[str, object], str] = {}
    for test_path, source in tests.items():
        tree = _parse(source.encode()) if test_path.endswith(".py") else None
        for value in _expected_values(tree) if tree else ():
            expected |= {key: test_path for key in _telling(value)}
    for path, content in sorted(changed(task, files).items()):
        if path in task.protected or path in task.hidden_tests:
            continue  # reported above
        posix = PurePosixPath(path)
        top = posix.parts[0].split(".")[0]
        if posix.name in _AUTOLOADED or posix.suffix == ".pth":
            reasons.append(f"adds {path}, which Python or the test runner loads by itself")
        if path not in task.files and top in sys.stdlib_module_names:
            reasons.append(f"adds {path}, which shadows the standard library's {top}")
        tree = _parse(content) if posix.suffix == ".py" else None
        if tree is None:
            continue
        reasons += _tampering(path, tree, test_modules)
        if _is_test_file(path):
            continue
        original = _parse(task.files[path].encode()) if path in task.files else None
        for kind, value in sorted(_literals(tree) - _literals(original), key=repr):
            if (kind, value) in expected:
                shown = value if kind == "container" else repr(value)
                test = expected[kind, value]
                reasons.append(f"{path} hard-codes {shown}, an expected value in {test}")
    return "; ".join(reasons) or None
