"""Count the checks in the test suite, so that a reorganisation can show it lost none.

    python tests/count_assertions.py [--per-test] [PATH ...]      (default PATH: tests/)

For every test function (``test_*`` at module level, or a ``test_*`` method of a class),
keyed by (name, file): its ``assert`` statements, its ``pytest.raises`` and
``pytest.warns`` uses and its ``@given`` decorators, nested functions included. The same
counts for everything else (helpers, fixtures, module-level code) are totalled apart, so
that a check moved from a test into a shared helper still shows. ``--per-test`` prints a
line per test function before the totals (sorted by name, then file: two runs diff well).
Static counts, from ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, fields
from pathlib import Path

CHECKS = ("asserts", "raises", "warns", "given")


@dataclass
class Counts:
    asserts: int = 0
    raises: int = 0
    warns: int = 0
    given: int = 0

    def add(self, other: Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def row(self) -> str:
        return " ".join(f"{getattr(self, name):>7}" for name in CHECKS)


def _pytest_attr(node: ast.expr) -> str | None:
    """``raises`` / ``warns`` for ``pytest.raises`` / ``pytest.warns`` (or the bare names)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "pytest" and node.attr in ("raises", "warns"):
            return node.attr
    if isinstance(node, ast.Name) and node.id in ("raises", "warns"):
        return node.id
    return None


def _is_given(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Name):
        return target.id == "given"
    return isinstance(target, ast.Attribute) and target.attr == "given"


def count(node: ast.AST) -> Counts:
    """The checks in ``node`` and everything nested in it."""
    c = Counts()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            c.asserts += 1
        elif isinstance(sub, ast.Call) and (which := _pytest_attr(sub.func)):
            setattr(c, which, getattr(c, which) + 1)
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
            c.given += sum(_is_given(d) for d in sub.decorator_list)
    return c


def scan(path: Path) -> tuple[dict[str, Counts], Counts]:
    """({test name: counts} of one file, counts of the rest of the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    tests: dict[str, Counts] = {}
    rest = Counts()
    for stmt in tree.body:
        defs: list[tuple[str, ast.stmt]] = []
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            defs = [(stmt.name, stmt)]
        elif isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test"):
            defs = [
                (f"{stmt.name}.{m.name}", m)
                for m in stmt.body
                if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
            methods = {id(node) for _, node in defs}
            rest.add(count(ast.Module([m for m in stmt.body if id(m) not in methods], [])))
        else:
            rest.add(count(stmt))
            continue
        for name, node in defs:
            if name.rsplit(".", 1)[-1].startswith("test"):
                tests[name] = count(node)
            else:
                rest.add(count(node))
    return tests, rest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--per-test", action="store_true", help="a line per test function")
    args = parser.parse_args(argv)
    roots: list[Path] = args.paths or [Path(__file__).resolve().parent]
    found = {f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py"))}
    files = sorted({f.resolve() for f in found} - {Path(__file__).resolve()})
    per_test: list[tuple[str, str, Counts]] = []
    helpers = Counts()
    for f in files:
        tests, rest = scan(f)
        helpers.add(rest)
        shown = f.relative_to(Path.cwd()) if f.is_relative_to(Path.cwd()) else f
        per_test += [(name, str(shown), c) for name, c in tests.items()]
    per_test.sort(key=lambda t: (t[0], t[1]))
    header = f"{'':<12} {' '.join(f'{name:>7}' for name in CHECKS)}"
    if args.per_test:
        for name, where, c in per_test:
            print(f"{c.row()}  {name} ({where})")
        print()
    in_tests = Counts()
    for _, _, c in per_test:
        in_tests.add(c)
    print(header)
    print(f"{'tests':<12} {in_tests.row()}   ({len(per_test)} test functions, {len(files)} files)")
    print(f"{'elsewhere':<12} {helpers.row()}   (helpers, fixtures, module level)")
    total = Counts()
    total.add(in_tests)
    total.add(helpers)
    print(f"{'total':<12} {total.row()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
