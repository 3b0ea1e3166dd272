"""The checks of the session's settings and of the other integer and str arguments: each
turns a caller's value into the setting, or raises the TypeError, OverflowError or
SettingError the native side raises for it, with the same text.

Apart because they judge the caller's arguments, not bytes from the wire: the session and
the chunk run them once, before anything is encoded or read.
"""

from __future__ import annotations

import operator
from typing import Any, Literal

from .._checks import check_seconds
from ..errors import SettingError
from ._wire import LAYOUTS, U32_MAX, USIZE_MAX

DEFAULT_CHUNK_SIZE = 65_536
DEFAULT_MAX_PAYLOAD_LEN = 268_435_456  # 256 MiB
DEFAULT_MAX_GRADIENT_LEN = 1_073_741_824  # 2**30 values, 4 GiB of float32


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    return value


def _check_u32(value: Any, name: str) -> int:
    # operator.index rejects floats and other non-integers with TypeError; the range error is
    # an OverflowError because that is what a u32 conversion raises on the native side.
    number = operator.index(value)
    if not 0 <= number <= U32_MAX:
        raise OverflowError(f"{name} must be in 0..{U32_MAX}, got {number}")
    return number


Compression = Literal["lz4", "zstd"]
COMPRESSIONS: tuple[Compression, ...] = ("lz4", "zstd")


def _check_compression_setting(value: Any) -> Compression | None:
    """The constructor's ``compression``: None/False (off), True or "lz4" (LZ4 frame), or
    "zstd". A bool is a bool: 0 and 1 (which equal False and True) are refused."""
    if value is None or value is False:
        return None
    if value is True:
        return "lz4"
    if isinstance(value, str):
        for name in COMPRESSIONS:
            if value == name:
                return name
        raise SettingError(
            "compression", f"compression must be None, True, False, 'lz4' or 'zstd', got {value!r}"
        )
    raise TypeError(
        f"compression must be None, a bool, 'lz4' or 'zstd', got {type(value).__name__}"
    )


def _check_limit(value: Any, name: str, top: int, bounds: str) -> int:
    """A limit setting: an integer in 1..top, else SettingError saying it must be
    ``bounds``."""
    number = operator.index(value)
    if not 1 <= number <= top:
        raise SettingError(name, f"{name} must be {bounds}, got {number}")
    return number


def _check_max_gradient_len(value: Any) -> int:
    # A count of values, a usize in the native core. 0 is refused (as max_payload_len 0 is):
    # a limit that lets nothing but the empty gradient through is more likely a bug.
    return _check_limit(value, "max_gradient_len", USIZE_MAX, f"between 1 and {USIZE_MAX}")


def _check_max_payload_len(value: Any) -> int:
    # payload_len is a u32 on the wire, so no larger limit could ever be reached.
    return _check_limit(value, "max_payload_len", U32_MAX, f"in 1..{U32_MAX}")


# ``timeout=`` / ``deadline=``: the check the connection keywords use too.
_check_timeout = check_seconds


def _check_layout(value: str) -> str:
    if value not in LAYOUTS:
        raise SettingError(
            "layout",
            "layout must be 'seed' (the original's payload) or 'compact' (values only), "
            f"got {value!r}",
        )
    return value


def _check_chunk_size(value: Any) -> int:
    number = operator.index(value)
    if number < 0:
        raise SettingError("chunk_size", f"chunk_size must be >= 0, got {number}")
    if number > USIZE_MAX:
        raise OverflowError(f"chunk_size must be <= {USIZE_MAX}, got {number}")
    # The original raises a chunk size of 0 to 1 rather than refusing it.
    return max(number, 1)


def _check_flag(value: Any, name: str) -> bool:
    """keep_shape, keep_dtype: a real bool, as the native side's: not 0/1, not
    numpy.bool_ (stricter than ``_convert.check_bool``, which takes numpy.bool_)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
