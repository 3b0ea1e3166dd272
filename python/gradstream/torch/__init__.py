"""``torch.distributed`` over gradstream connections.

``import gradstream.torch`` registers the backend ``"gradstream"``::

    import gradstream.torch
    dist.init_process_group("gradstream", init_method="tcp://127.0.0.1:29500",
                            rank=r, world_size=n)

Options (``configure``) are read when a group is made, so call it before
``init_process_group``. docs/guides/torch-backend.md has the design: the rendezvous
through the group's store, the ring, the order of the additions, point to point
(a connection per direction and tag), FSDP, the failures.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist

from ._group import GradstreamProcessGroup
from ._options import Options, configure, options

__all__ = ["BACKEND", "GradstreamProcessGroup", "Options", "configure", "options"]

BACKEND = "gradstream"


def _create(store: Any, rank: int, size: int, timeout: Any) -> GradstreamProcessGroup:
    return GradstreamProcessGroup(store, rank, size, timeout)


if BACKEND not in _dist.Backend.backend_list:
    _dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
