"""`import gradstream` (and the command's modules) leave the optional and heavy modules
alone: ml_dtypes, pyarrow and tqdm are imported when first needed (a bfloat16 array handed
back, an Arrow object asked for, a progress bar shown), so that the package and every CLI
command start fast. Each check runs in a fresh interpreter, which is what sys.modules
tells about; none is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradstream
from support import ROOT

# Imported only when needed; never by `import gradstream` or the command's modules.
LAZY = ("ml_dtypes", "pyarrow", "tqdm", "torch", "ray")


def imported_after(code: str) -> dict[str, bool]:
    """Which of LAZY are in sys.modules after ``code`` runs in a new interpreter."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {LAZY!r}}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, bool] = json.loads(result.stdout.splitlines()[-1])
    return found


@pytest.mark.parametrize(
    "code",
    [
        "import gradstream",
        "import gradstream.cli, gradstream.demo, gradstream._cli_progress",
        "import gradstream; gradstream.GradientStreamSession()",
    ],
)
def test_import_gradstream_imports_none_of_the_lazy_modules(code: str) -> None:
    assert imported_after(code) == dict.fromkeys(LAZY, False)


def test_a_float32_round_trip_needs_neither_pyarrow_nor_ml_dtypes() -> None:
    code = (
        "import numpy as np, gradstream as gs\n"
        "s = gs.GradientStreamSession('lazy', 4)\n"
        "assert s.decode_frames(s.encode_frames(np.ones(9, np.float32))).sum() == 9\n"
    )
    found = imported_after(code)
    assert (found["pyarrow"], found["ml_dtypes"]) == (False, False)


def test_ml_dtypes_comes_with_the_first_bfloat16_array_handed_back(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sender = gradstream.GradientStreamSession("tx", 4, keep_dtype=True)
    wire = tmp_path / "bf16.frames"
    wire.write_bytes(sender.encode_frames(np.array([1, -2, 0.5], ml_dtypes.bfloat16)))
    code = (
        "import sys, numpy as np, gradstream as gs\n"
        "s = gs.GradientStreamSession('rx', 4)\n"
        "f32 = s.decode_frames(s.encode_frames(np.ones(9, np.float32)))\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        f"back = s.decode_frames(open({str(wire)!r}, 'rb').read())\n"
        "assert back.dtype.name == 'bfloat16', back.dtype\n"
        "assert back.astype(np.float32).tolist() == [1, -2, 0.5]\n"
    )
    assert imported_after(code)["ml_dtypes"] is True


@pytest.mark.parametrize("pyarrow_first", [True, False])
def test_the_bfloat16_arrow_type_is_registered_once_pyarrow_is_in_use(
    pyarrow_first: bool,
) -> None:
    # Imported before gradstream, pyarrow gets the type at `import gradstream`, as it
    # always did; imported after, with gradstream.BFloat16Type (or any use of pyarrow by
    # gradstream itself).
    order = "import pyarrow as pa\nimport gradstream as gs\n"
    if not pyarrow_first:
        order = "import gradstream as gs\nimport pyarrow as pa\ngs.BFloat16Type\n"
    code = order + (
        "import pyarrow.ipc, numpy as np\n"
        "from gradstream._arrow import BFloat16Type\n"
        "f = pa.field('v', pa.uint16(), metadata={b'ARROW:extension:name': "
        "b'gradstream.bfloat16', b'ARROW:extension:metadata': b''})\n"
        "sink = pa.BufferOutputStream()\n"
        "t = pa.table([pa.array(np.zeros(2, np.uint16))], schema=pa.schema([f]))\n"
        "with pa.ipc.new_file(sink, t.schema) as w: w.write_table(t)\n"
        "read = pa.ipc.open_file(sink.getvalue()).schema.field('v').type\n"
        "assert isinstance(read, BFloat16Type), read\n"
    )
    assert imported_after(code)["pyarrow"] is True
