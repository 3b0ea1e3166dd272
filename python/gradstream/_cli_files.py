"""The files of ``gradstream send`` and ``recv``: what a file sends, and how what arrived
is written.

* A ``.npy`` file is one gradient (``recv`` writes a lone gradient as one).
* A ``.npz`` archive or a ``.safetensors`` file is a *tensor set*
  (docs/guides/tensor-sets.md): its arrays by name, in the file's order, each in its dtype
  and shape. ``recv`` writes a set as the one its ``--out`` names.

The dtypes that travel are float16, bfloat16, float32 and float64. numpy has no bfloat16:
it saves an ``ml_dtypes.bfloat16`` array as 2-byte raw values (``'<V2'``), which ``send``
takes as bfloat16 and ``recv`` writes alike; a ``.safetensors`` file says ``BF16``, whose
raw bits are read here (not through ``safetensors.numpy``, which needs ml_dtypes for it and
whose older versions refuse it). Handing bfloat16 to the library needs ml_dtypes (the
``bfloat16`` extra), as everywhere in numpy.

safetensors (the ``safetensors`` extra) is imported only when a ``.safetensors`` file is
read or written. Over ``_cli_base`` and ``_dtypes``; ``_cli_send`` and ``_cli_recv`` use it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _dtypes
from ._cli_base import CliError, count_of, one_line

__all__ = [
    "SET_SUFFIXES",
    "WANTS_A_GRADIENT",
    "WANTS_A_SET",
    "TensorSet",
    "describe_set",
    "load_gradient",
    "load_item",
    "needs_safetensors",
    "remove_quietly",
    "write_gradient",
    "write_set",
]

# The output suffixes `recv` writes a tensor set as; every other one is a lone gradient's.
SET_SUFFIXES = (".npz", ".safetensors")
# How the library refuses a transfer of the other kind (a lone gradient where the peer's
# recv_tensors waits for a set's manifest, or the reverse): at chunk 0, from its seal,
# before anything of it is acknowledged.
WANTS_A_SET = "expected a tensor set's manifest"
WANTS_A_GRADIENT = "expected a lone gradient"
TRAVEL = "float16, bfloat16, float32 and float64"
# What a .npy file may hold: float32 alone for --protocol seed (the original's wire),
# and the dtypes a gradstream connection keeps (docs/guides/connections.md "Defaults").
_NPY_DTYPES = ("float16", "float32", "float64")
_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
SAFETENSORS_INSTALL = (
    "pip install safetensors (or pip install 'gradstream[safetensors]', which brings "
    "ml_dtypes for bfloat16 too)"
)
BFLOAT16_INSTALL = "pip install ml_dtypes (or pip install 'gradstream[bfloat16]')"


@dataclass(frozen=True)
class TensorSet:
    """The arrays of one ``.npz`` or ``.safetensors`` file, by name, in the file's order."""

    tensors: dict[str, npt.NDArray[Any]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def describe(self) -> str:
        """`3 tensors, 1,234 values (float32, bfloat16)`: the dtypes in order of first
        appearance."""
        return describe_set(self.tensors)


def describe_set(tensors: dict[str, Any]) -> str:
    values = sum(math.prod(t.shape) for t in tensors.values())
    dtypes = list(dict.fromkeys(t.dtype.name for t in tensors.values()))
    kinds = f" ({', '.join(dtypes)})" if dtypes else ""
    return f"{count_of(len(tensors), 'tensor')}, {count_of(values, 'value')}{kinds}"


# --------------------------------------------------------------------------- reading


def load_item(path: Path, protocol: str) -> npt.NDArray[Any] | TensorSet:
    """What one file given to ``send`` sends: a .npy file's array, or the tensor set of a
    .npz archive or a .safetensors file. Every refusal is a CliError, raised before
    anything connects."""
    if path.is_dir():
        raise CliError(
            f"cannot read {path}: it is a directory; give a .npy, .npz or .safetensors file"
        )
    if not path.is_file():
        raise CliError(f"cannot read {path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc
    # A zip archive starts with a local file header, or when empty its end record.
    is_npz = path.suffix.lower() == ".npz" or magic[:4] in (b"PK\x03\x04", b"PK\x05\x06")
    is_set = is_npz or path.suffix.lower() == ".safetensors"
    if is_set and protocol == "seed":
        raise CliError(
            f"cannot send {path} with --protocol seed: its arrays go as a tensor set, which "
            "the seed wire (flat float32 gradients, the original's) does not carry; use "
            "--protocol gradstream, or save each array as a .npy file and send those"
        )
    if path.suffix.lower() == ".safetensors":
        return _load_safetensors(path)
    if is_npz:
        return _load_npz(path)
    if magic != b"\x93NUMPY":
        raise CliError(
            f"cannot read {path}: not a .npy file (it does not start with numpy's "
            "\\x93NUMPY header; make one with numpy.save), nor a .npz archive "
            "(numpy.savez) or a .safetensors file (named so)"
        )
    return load_gradient(path, protocol)


def load_gradient(path: Path, protocol: str = "gradstream") -> npt.NDArray[Any]:
    """The array of a .npy file, memory-mapped when possible (no copy): float16, bfloat16
    (2-byte raw values, as ``recv`` writes it), float32 or float64 over a gradstream
    connection (sent in its dtype and shape), float32 alone for ``--protocol seed``."""
    try:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:
            # Arrays numpy cannot map (e.g. object arrays) get a plain load and its message.
            array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise CliError(f"cannot read {path} as a .npy file: {one_line(str(exc))}") from exc
    if not isinstance(array, np.ndarray):
        raise CliError(f"{path} is not a .npy file holding one array")
    if protocol == "gradstream" and _raw_bfloat16(array.dtype):
        return _bfloat16(path, None, array.view(np.uint16))
    kept = (
        protocol == "gradstream"
        and array.dtype.kind == "f"
        and (array.dtype.newbyteorder("=").name in _NPY_DTYPES)
    )
    if kept or (array.dtype.kind == "f" and array.dtype.itemsize == 4):
        return array
    stem = path.with_name(path.stem + "-f32.npy")
    sends = (
        "--protocol seed sends float32 only (the original's wire)"
        if protocol == "seed"
        else "gradstream sends float16, bfloat16 (as numpy saves ml_dtypes.bfloat16: '<V2'), "
        "float32 or float64"
    )
    raise CliError(
        f"{path} holds {array.dtype} values; {sends}. Convert it: "
        f"python -c \"import numpy as n; n.save('{stem}', "
        f"n.load('{path}').astype(n.float32))\""
    )


def _refuse_members(path: Path, bad: list[str]) -> CliError:
    return CliError(
        f"cannot send {path}: {'; '.join(bad)}; the dtypes that travel are {TRAVEL} "
        "(convert the others, e.g. with .astype(numpy.float32))"
    )


def _raw_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether an array of `dtype` holds bfloat16: ml_dtypes' own, or 2-byte raw values
    ('<V2'), as numpy saves ml_dtypes.bfloat16 to a .npy or .npz file."""
    plain_void = dtype.kind == "V" and dtype.names is None and dtype.shape == ()
    return dtype.name == "bfloat16" or (plain_void and dtype.itemsize == 2)


def _bfloat16(path: Path, name: str | None, bits: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """2-byte raw values as ml_dtypes' bfloat16 (a view, no copy)."""
    dtype = _dtypes.bfloat16_dtype()
    if dtype is None:
        what = "it holds" if name is None else f"member {json.dumps(name)} is"
        raise CliError(
            f"cannot send {path}: {what} bfloat16, which numpy holds through ml_dtypes: "
            f"{BFLOAT16_INSTALL}"
        )
    return bits.view(dtype)


def _npz_member(name: str, array: npt.NDArray[Any]) -> npt.NDArray[Any] | str:
    """The member as it goes (float16/32/64 in native byte order, or 2-byte raw values as
    bfloat16 bits), or the words refusing it."""
    dtype = array.dtype
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))
    if _raw_bfloat16(dtype):
        return array.view(np.uint16)
    return f"member {json.dumps(name)} is {dtype}"


def _load_npz(path: Path) -> TensorSet:
    """The arrays of a .npz archive, by its keys in its order; no pickles."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            members: dict[str, npt.NDArray[Any] | str] = {}
            for name in names:
                try:
                    members[name] = _npz_member(name, archive[name])
                except ValueError as exc:
                    if "allow_pickle" not in str(exc):
                        raise
                    members[name] = (
                        f"member {json.dumps(name)} holds Python objects (a pickled "
                        "array), which are never loaded"
                    )
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CliError(f"cannot read {path} as a .npz archive: {one_line(str(exc))}") from exc
    if not members:
        raise CliError(f"cannot send {path}: the archive holds no arrays")
    bad = [m for m in members.values() if isinstance(m, str)]
    if bad:
        raise _refuse_members(path, bad)
    tensors = {}
    for name, member in members.items():
        assert not isinstance(member, str)
        tensors[name] = member if member.dtype != np.uint16 else _bfloat16(path, name, member)
    return TensorSet(tensors)


def _safetensors_module(path: Path, doing: str) -> Any:
    try:
        return importlib.import_module("safetensors")
    except ImportError:
        raise CliError(
            f"cannot {doing} {path}: .safetensors files need the safetensors package: "
            f"{SAFETENSORS_INSTALL}"
        ) from None


def needs_safetensors(path: Path) -> None:
    """Fail at once (before a receiver listens) when ``path`` is a .safetensors file and
    the package is missing."""
    if path.suffix.lower() == ".safetensors":
        _safetensors_module(path, "write")
        importlib.import_module("safetensors.numpy")


def _safetensors_header(path: Path) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """The data's offset in the file and the header's entries, in the file's order (the
    format: an 8-byte little-endian length, then that many bytes of JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length), object_pairs_hook=list)
    return 8 + length, [(k, dict(v)) for k, v in header if k != "__metadata__"]


def _raw_bits(path: Path, start: int, entry: dict[str, Any]) -> npt.NDArray[Any]:
    """A 2-byte tensor's values as uint16, memory-mapped (safetensors is little-endian)."""
    shape = tuple(entry["shape"])
    if math.prod(shape) == 0:
        return np.zeros(shape, np.uint16)
    begin, _ = entry["data_offsets"]
    bits = np.memmap(path, np.dtype("<u2"), "r", start + begin, shape)
    return np.asarray(bits).astype(np.uint16, copy=False)


def _load_safetensors(path: Path) -> TensorSet:
    """The tensors of a .safetensors file, in the file's order. safetensors reads them
    (and checks the file); BF16 tensors are read here as their raw bits."""
    safetensors = _safetensors_module(path, "read")
    try:
        with safetensors.safe_open(str(path), framework="np") as f:
            start, entries = _safetensors_header(path)
            bad = [
                f"member {json.dumps(name)} is {entry['dtype']}"
                for name, entry in entries
                if entry["dtype"] not in _SAFETENSORS_DTYPES
            ]
            if bad:
                raise _refuse_members(path, bad)
            if not entries:
                raise CliError(f"cannot send {path}: the file holds no tensors")
            tensors = {}
            for name, entry in entries:
                if entry["dtype"] == "BF16":
                    tensors[name] = _bfloat16(path, name, _raw_bits(path, start, entry))
                else:
                    tensors[name] = f.get_tensor(name)
    except CliError:
        raise
    except Exception as exc:  # safetensors' own error type, or a broken header
        raise CliError(f"cannot read {path} as a .safetensors file: {one_line(str(exc))}") from exc
    return TensorSet(tensors)


# --------------------------------------------------------------------------- writing


def remove_quietly(part: Path) -> None:
    with contextlib.suppress(OSError):
        part.unlink()


def write_gradient(part: Path, array: npt.NDArray[Any]) -> None:
    """numpy.save to exactly `part` (no `.npy` appended); a failure removes it."""
    try:
        with open(part, "wb") as f:
            np.save(f, array)
    except OSError as exc:
        remove_quietly(part)
        raise CliError(f"cannot write {part}: {exc.strerror or exc}") from exc


def write_set(part: Path, tensors: dict[str, npt.NDArray[Any]], kind: str) -> None:
    """A tensor set to `part`, as a .npz archive (numpy.savez's format: one .npy member a
    tensor, uncompressed, in the set's order) or a .safetensors file (``kind``); a failure
    removes it. bfloat16 (ml_dtypes) goes into a .npz as numpy saves it ('<V2') and into a
    .safetensors file as BF16."""
    try:
        if kind == ".safetensors":
            importlib.import_module("safetensors.numpy").save_file(tensors, str(part))
        else:
            with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, array in tensors.items():
                    with zf.open(name + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, array, allow_pickle=False)
    except OSError as exc:
        remove_quietly(part)
        raise CliError(f"cannot write {part}: {exc.strerror or exc}") from exc
    except Exception as exc:
        remove_quietly(part)
        raise CliError(f"cannot write {part}: {one_line(str(exc))}") from exc
