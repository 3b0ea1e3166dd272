"""A second Ray driver for tests/onray/test_receivers.py: the docs' ``Averager`` pattern
(docs/guides/ray.md, "Receivers"), one averaging actor taking three trainers' GRADSTREAM
objects step after step, as a job of its own on the tests' cluster. Prints one JSON
object of what it saw.

    python ray_receivers_driver.py GCS_ADDRESS TESTS_PATH

TESTS_PATH is the ``PYTHONPATH`` of this job's Ray workers (``tests/``, and for the run
without torch the folder whose ``sitecustomize`` hides it, which this driver's own
``PYTHONPATH`` holds too).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import numpy as np
import ray

import gradstream as gs
import gradstream.ray as gsray

STEPS = 5
N = 1 << 16  # values per gradient
# Seconds ray.get may wait for one step: more than Ray's own 60 s RDT timeout, so that a
# step that hangs shows as Ray's TimeoutError.
STEP_BOUND = 150.0


def gradient(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng([step, rank]).standard_normal(N, dtype=np.float32)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    @ray.method(tensor_transport="gradstream")
    def gradient(self, step: int) -> dict[str, Any]:
        return {"w": gradient(step, self.rank), "step": step}


class Averager:
    """The docs' averager, with a count of the calls that reached it and what its
    process sees of torch."""

    def __init__(self) -> None:
        self.calls = 0

    def mean(self, *results: dict[str, Any]) -> np.ndarray:
        self.calls += 1
        return np.mean([r["w"] for r in results], axis=0)

    def count(self) -> int:
        return self.calls

    def torch(self) -> dict[str, bool]:
        from ray.experimental.rdt.util import transport_manager_info

        return {
            "importable": importlib.util.find_spec("torch") is not None,
            # Ray registers its torch transports in a process that can import torch.
            "ray_torch_transports": "GLOO" in transport_manager_info,
        }


# The pattern as the docs had it, and the same refused however the actor runs tasks.
Plain = ray.remote(num_cpus=0)(Averager)
Threaded = ray.remote(num_cpus=0, max_concurrency=4)(Averager)
Enabled = ray.remote(num_cpus=0, enable_tensor_transport=True)(Averager)


def outcome(averager: Any, trainers: list[Any], step: int) -> str:
    """What one step does: "refused" (a SettingError at the call, naming the fix), "ok"
    (the right mean), or what went wrong instead."""
    refs = [trainer.gradient.remote(step) for trainer in trainers]
    try:
        result = averager.mean.remote(*refs)
    except gs.SettingError as exc:
        fix = "@ray.remote(enable_tensor_transport=True)"
        named = exc.setting == "enable_tensor_transport" and fix in str(exc)
        return "refused" if named else f"refused without the fix: {exc}"
    started = time.monotonic()
    try:
        mean = ray.get(result, timeout=STEP_BOUND)
    except Exception as exc:  # what Ray gives: RayTaskError(TimeoutError), ...
        cause = getattr(exc, "cause", None)
        name = type(cause if cause is not None else exc).__name__
        return f"failed after {time.monotonic() - started:.0f} s: {name}"
    expected = np.mean([gradient(step, rank) for rank in range(len(trainers))], axis=0)
    return "ok" if np.array_equal(mean, expected) else "wrong mean"


def run(averager: Any, trainers: list[Any]) -> list[str]:
    outcomes: list[str] = []
    for step in range(STEPS):
        outcomes.append(outcome(averager, trainers, step))
        if outcomes[-1] not in ("ok", "refused"):
            break  # a hung step would cost the next ones Ray's 60 s each
    return outcomes


def main() -> None:
    gcs, path = sys.argv[1], sys.argv[2]
    ray.init(
        address=gcs,
        runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}},
        configure_logging=False,
        log_to_driver=False,
    )
    gsray.register(timeout=15.0)
    trainers = [Trainer.remote(rank) for rank in range(3)]  # type: ignore[attr-defined]
    report: dict[str, Any] = {}
    for name, cls in {"plain": Plain, "threaded": Threaded, "enabled": Enabled}.items():
        averager = cls.remote()  # type: ignore[attr-defined]
        report[name] = run(averager, trainers)
        report[f"{name}_calls"] = ray.get(averager.count.remote())
        if name == "enabled":
            report["worker_torch"] = ray.get(averager.torch.remote())
    report["driver_torch"] = importlib.util.find_spec("torch") is not None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
