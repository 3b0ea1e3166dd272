"""docs/guides/ray.md: its complete example (the page's first python block) runs as
written, in a fresh process that starts its own Ray (in single-node mode, so that Ray
stays on loopback)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "ray.md"


def example() -> str:
    text = PAGE.read_text()
    section = text[: text.index("\n## ")]  # the page's introduction, before its sections
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_readme_example_runs_as_written(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "many_workers.py"
    script.write_text(example())
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "StepReport(step=4, count=3, missing=())"
    assert lines[-2].count("StepReport(step=4, count=3, missing=())") == 3
