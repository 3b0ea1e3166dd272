"""The arrows between the layers point one way (docs/contributing.md, layout): the Python session
calls
the Rust engine once per public call, and Rust never calls back into the package.

Read from the sources, so that a new call in the wrong direction fails here rather than
at run time after a rename."""

from __future__ import annotations

import ast
import re

from support import ROOT

BINDINGS = ROOT / "crates" / "gradstream-py" / "src"
PACKAGE = ROOT / "python" / "gradstream"
NATIVE_STUB = PACKAGE / "_native.pyi"


def test_rust_imports_no_module_of_the_package_but_the_errors() -> None:
    # A module path in a Rust string literal is what `py.import`/`PyOnceLock::import` take.
    named = set()
    for path in sorted(BINDINGS.glob("*.rs")):
        for module in re.findall(r'"(gradstream(?:\.[A-Za-z_]+)+)"', path.read_text()):
            named.add((path.name, module))
    imported = {(f, m) for f, m in named if m not in ("gradstream._native",)}
    # The error classes are plain Python, raised by the reference too: Rust passes their
    # fields, the classes build the message (errors.rs). Nothing else.
    assert imported == {("errors.rs", "gradstream.errors")}, imported


def _native_users() -> dict[str, set[str]]:
    """Per module of the package: the names it takes from gradstream._native."""
    users: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_native"):
                users.setdefault(path.name, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import) and any("_native" in a.name for a in node.names):
                users.setdefault(path.name, set()).add("*")
    return users


def test_only_the_session_layer_uses_the_engine() -> None:
    users = _native_users()
    # __init__ re-exports the constants and the two plain classes; _aio makes the loop's
    # Completions, and sync/_wait.py each thread's; _handover wraps an asyncio stream's
    # socket; _session alone holds an Engine (_connection asks the session for links and
    # listeners made with its engine).
    assert set(users) == {"__init__.py", "_session.py", "_aio.py", "_handover.py", "_wait.py"}
    assert users["_aio.py"] == users["_wait.py"] == {"Completions"}
    assert users["_handover.py"] == {"Handover"}
    assert "Engine" not in users["__init__.py"]
    assert all(not name.startswith("_") for names in users.values() for name in names)


def test_the_engine_has_no_underscore_methods() -> None:
    # What the Python layers call on native objects is public, stubbed and stubtest-checked.
    stub = ast.parse(NATIVE_STUB.read_text())
    private = [
        f"{cls.name}.{item.name}"
        for cls in stub.body
        if isinstance(cls, ast.ClassDef)
        for item in cls.body
        if isinstance(item, ast.FunctionDef)
        and item.name.startswith("_")
        and not (item.name.startswith("__") and item.name.endswith("__"))
    ]
    assert private == [], private


def test_no_module_calls_an_underscore_method_of_the_session_engine() -> None:
    # `engine._x(` / `._engine._x(` anywhere in the package would be a private door.
    pattern = re.compile(r"\b_?engine\._[a-z]\w*\(")
    hits = [
        f"{path.name}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == [], hits


def _layout_section() -> str:
    text = (ROOT / "docs" / "contributing.md").read_text()
    start = text.index("## Layout")
    return text[start : text.index("\n## ", start + 1) if "\n## " in text[start + 1 :] else None]


def test_the_readme_layout_names_every_source_file() -> None:
    layout = _layout_section()
    missing = [
        str(path.relative_to(ROOT))
        for folder, pattern in [
            (ROOT / "crates" / "gradstream-core" / "src", "*.rs"),
            (ROOT / "crates" / "gradstream-core" / "src" / "codec", "*.rs"),
            (ROOT / "crates" / "gradstream-core" / "src" / "tensors", "*.rs"),
            (ROOT / "crates" / "gradstream-core" / "src" / "connection", "*.rs"),
            (ROOT / "crates" / "gradstream-core" / "src" / "protocol", "*.rs"),
            (ROOT / "crates" / "gradstream-core" / "src" / "tls", "*.rs"),
            (BINDINGS, "*.rs"),
            (PACKAGE, "*.py"),
            (PACKAGE / "reference", "*.py"),
        ]
        for path in sorted(folder.glob(pattern))
        if path.name != "__init__.py" and path.stem not in layout
    ]
    assert missing == [], missing
