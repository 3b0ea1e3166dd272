"""The public surface: the reference matches the native API, the constructor defaults
match the constants, the errors are one hierarchy, and the reference stands alone (never
imports the extension). That the stubs match the extension and the package type-checks
against them is `make lint` (mypy.stubtest and mypy), not a test."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import gradstream as gs
import gradstream.errors as errors
import gradstream.reference as ref
from support import ROOT

PACKAGE = ROOT / "python" / "gradstream"


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("name", ["GradientStreamSession", "GradientChunk"])
def test_reference_has_the_native_api(name: str) -> None:
    native, reference = getattr(gs, name), getattr(ref, name)
    assert _public(native) == _public(reference)
    for attr in _public(native):
        n, r = getattr(native, attr), getattr(reference, attr)
        if callable(n) and not isinstance(inspect.getattr_static(native, attr), property):
            n_params = list(inspect.signature(n).parameters)
            r_params = list(inspect.signature(r).parameters)
            assert n_params == r_params, attr


def test_constructor_defaults_agree_with_the_constants() -> None:
    params = inspect.signature(gs.GradientStreamSession).parameters
    assert params["chunk_size"].default == gs.DEFAULT_CHUNK_SIZE == 65536
    assert params["max_payload_len"].default == gs.DEFAULT_MAX_PAYLOAD_LEN == 256 << 20
    s = gs.GradientStreamSession("x")
    assert (s.chunk_size, s.max_payload_len) == (gs.DEFAULT_CHUNK_SIZE, gs.DEFAULT_MAX_PAYLOAD_LEN)
    r = inspect.signature(ref.GradientStreamSession).parameters
    assert r["chunk_size"].default == params["chunk_size"].default
    assert r["max_payload_len"].default == params["max_payload_len"].default
    # max_gradient_len and timeout too, and the reference's own copies of the constants.
    assert r["max_gradient_len"].default == params["max_gradient_len"].default
    assert params["max_gradient_len"].default == gs.DEFAULT_MAX_GRADIENT_LEN == 1 << 30
    assert r["timeout"].default is params["timeout"].default is None
    from gradstream.reference import _settings

    assert (
        _settings.DEFAULT_CHUNK_SIZE,
        _settings.DEFAULT_MAX_PAYLOAD_LEN,
        _settings.DEFAULT_MAX_GRADIENT_LEN,
    ) == (gs.DEFAULT_CHUNK_SIZE, gs.DEFAULT_MAX_PAYLOAD_LEN, gs.DEFAULT_MAX_GRADIENT_LEN)


def test_metadata_keys_agree_with_the_cores() -> None:
    """The core defines each metadata key once and _native exposes it; the reference and
    the pyarrow extension type keep deliberate copies of their own."""
    import gradstream._arrow as arrow
    import gradstream._dtypes as dtypes
    import gradstream._native as native
    from gradstream.reference import _wire

    assert (native.SHAPE_KEY, native.MANIFEST_KEY) == (_wire.SHAPE_KEY, _wire.MANIFEST_KEY)
    assert (native.SHAPE_KEY, native.MANIFEST_KEY) == ("gradient_shape", "gradstream_tensors")
    assert (native.DTYPE_KEY, native.BF16_EXTENSION) == (dtypes.DTYPE_KEY, arrow.BF16_EXTENSION)
    assert native.BF16_EXTENSION == arrow.BFloat16Type().extension_name


def _imported_names(path: Path, package: str) -> set[str]:
    """Every module a file imports and every name it imports from one, as absolute dotted
    names (a relative import resolved against ``package``, the file's own package)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module or "") if p)
            imported.add(base)
            imported.update(f"{base}.{alias.name}" for alias in node.names)
    return imported


def test_reference_never_imports_the_extension() -> None:
    # Every file of the subpackage that gradstream.reference is.
    folder = PACKAGE / "reference"
    assert Path(ref.__file__).parent == folder
    files = sorted(folder.glob("*.py"))
    assert folder / "__init__.py" in files
    imported = set()
    for path in files:
        imported |= _imported_names(path, "gradstream.reference")
    assert not any("_native" in name for name in imported), imported
    # Within the package: the subpackage itself, the modules both implementations share,
    # and nothing else.
    shared = ("reference", "_arrow", "_checks", "_convert", "_dtypes", "_io", "errors")
    own = {name for name in imported if name.split(".")[0] == "gradstream"}
    assert all(
        name == "gradstream"
        or any(name == f"gradstream.{m}" or name.startswith(f"gradstream.{m}.") for m in shared)
        for name in own
    ), own


def test_errors_are_one_hierarchy_shared_by_both() -> None:
    for cls in (
        gs.ChecksumMismatchError,
        gs.IncompleteStreamError,
        gs.ArrowIpcError,
        gs.FrameError,
    ):
        assert issubclass(cls, gs.GradientStreamError)
    assert gs.FrameError is errors.FrameError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layout": "bad", "compression": "gzip"},
        {"timeout": -1, "keep_shape": 1},
        {"chunk_size": -1, "wire_dtype": "int8"},
        {"max_payload_len": 0, "timeout": float("nan")},
        {"compression": "gzip", "wire_dtype": "int8"},
    ],
)
def test_two_bad_settings_fail_alike_on_both_sides(kwargs: dict[str, object]) -> None:
    """The settings are checked in one order, so the first refusal is the same error."""
    raised = []
    for impl in (gs, ref):
        with pytest.raises(Exception) as info:
            impl.GradientStreamSession("x", **kwargs)
        raised.append((type(info.value), str(info.value), getattr(info.value, "setting", None)))
    assert raised[0] == raised[1]


@pytest.mark.parametrize("timeout", ["3", b"3", object(), -1, 0, -0.5, float("nan"), float("inf")])
def test_a_bad_timeout_is_refused_in_the_same_words(timeout: object) -> None:
    raised = []
    for impl in (gs, ref):
        with pytest.raises((TypeError, ValueError)) as info:
            impl.GradientStreamSession("x", timeout=timeout)
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]
