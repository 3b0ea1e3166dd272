"""The docs' ``Averager`` pattern (docs/guides/ray.md, "Receivers"): one actor takes
three trainers' GRADSTREAM objects, step after step. Declared without
``enable_tensor_transport=True`` it is refused at each call, before anything is sent,
by a ``SettingError`` naming the fix (Ray 2.60 would run the transfer behind the task
that waits for it: Ray's TimeoutError from the second step on); declared with it, five
steps give the right means. With torch installed and with torch hidden (Ray's failure
monitor and default transports differ): a job of its own each, its driver and its
workers started with tests/support/torchless/ on their path or not."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SUPPORT = pathlib.Path(__file__).resolve().parent.parent / "support"
DRIVER = SUPPORT / "ray_receivers_driver.py"
TORCHLESS = SUPPORT / "torchless"


@pytest.mark.parametrize("torch", ["installed", "hidden"])
def test_an_averager_is_refused_without_the_transport_and_runs_five_steps_with_it(
    cluster: str, torch: str
) -> None:
    folders = [str(SUPPORT.parent)]
    if torch == "hidden":
        folders.insert(0, str(TORCHLESS))
    path = os.pathsep.join(folders)
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, str(DRIVER), cluster, path],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    visible = torch == "installed"
    # torch is part of the install (requirements-dev.txt); hidden, Ray goes without it.
    assert report["driver_torch"] is visible
    assert report["worker_torch"] == {"importable": visible, "ray_torch_transports": visible}
    # Refused at the call, each step, whatever the actor's concurrency: no call reached it.
    assert report["plain"] == ["refused"] * 5
    assert report["threaded"] == ["refused"] * 5
    assert report["plain_calls"] == report["threaded_calls"] == 0
    assert report["enabled"] == ["ok"] * 5
    assert report["enabled_calls"] == 5
