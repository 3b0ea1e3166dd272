"""The ``GRADSTREAM`` tensor transport for Ray Direct Transport (``@ray.method(
tensor_transport="gradstream")``).

This is the one module that touches Ray's RDT API (``ray.experimental.rdt``, alpha in
Ray 2.60, the version ``requirements-dev.txt`` pins): a change there touches this file
alone. What moves the bytes is ``_endpoint``.

How Ray drives it: when a decorated method returns, Ray hands its numpy arrays to
``extract_tensor_transport_metadata`` in the actor that made them (we offer them on the
actor's endpoint, and the metadata carries its address); when the object reference is
passed to another actor's task, or to ``ray.get``, Ray calls ``recv_multiple_tensors``
in the receiving process (we fetch them from that address); when the reference goes out
of scope, ``garbage_collect`` in the maker (we stop serving them). The transport is
one-sided: Ray never asks the maker to send. Before a task that takes such an object is
submitted to an actor, Ray's ``RDTManager`` starts its transfer in the caller: there we
refuse a receiving actor that cannot take it (``_refuse_receivers_without_transport``).

Settings: Ray checks a transport's name where a decorated method is defined, in every
process that imports the class, and registers the driver's transports on an actor only
where the name is not known yet. So ``import gradstream.ray`` makes the name known
(``make_known``), and the settings (TLS, authkey, ...) do not travel with the class but
through Ray's KV store, one entry per job, written by the driver (``register``) and read
by every process when it first listens or connects for the transport (``_published``):
a worker's own import can never pin other settings than the driver's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import ray
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put
from ray.experimental.rdt import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
    register_tensor_transport,
)
from ray.experimental.rdt.rdt_manager import RDTManager
from ray.experimental.rdt.util import transport_manager_info

from ..errors import ProtocolError, SettingError, TensorSetError
from ._endpoint import Endpoint, check_arrays
from ._same_node import node_id, on_this_node
from ._settings import RaySettings

TRANSPORT = "GRADSTREAM"


@dataclasses.dataclass
class GradstreamMetadata(TensorTransportMetadata):
    """Ray's metadata of one object, plus where its maker serves it: its TCP address;
    its Unix socket (``"unix:PATH"``) and Ray node id, for receivers of that node."""

    address: tuple[str, int] | None = None
    local: str | None = None
    node: str | None = None


class GradstreamTransport(TensorTransportManager):
    """The transport. Ray makes one per process; its settings are the driver's
    (``_published``), read when the process first listens or connects."""

    def __init__(self) -> None:
        self._endpoint: Endpoint | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> Endpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = Endpoint(_published())
            return self._endpoint

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # A fetch is a task on our loop: cancelling it closes its connection, and the
        # maker's side ends that connection's handler. No actor needs killing.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Every process that imports gradstream.ray has it. Ray asks the caller of each
        # decorated method: in the driver, the moment to publish its settings, before
        # any actor can need them.
        if not _in_worker():
            _published()
        return True

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> GradstreamMetadata:
        check_arrays(rdt_object)
        return self.offer(
            obj_id, list(rdt_object), [(array.shape, array.dtype) for array in rdt_object]
        )

    def offer(self, obj_id: str, arrays: list[Any], tensor_meta: list[Any]) -> GradstreamMetadata:
        """Serve ``arrays`` as ``obj_id``; Ray's metadata of them, with where to fetch."""
        address, local = self.endpoint.offer(obj_id, arrays)
        return GradstreamMetadata(
            tensor_meta=tensor_meta,
            tensor_device="cpu",
            address=address,
            local=local,
            node=None if local is None else node_id(),
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        address = getattr(tensor_transport_metadata, "address", None)
        if address is None:
            raise TypeError(
                f"object {obj_id} carries no GRADSTREAM metadata: "
                f"{type(tensor_transport_metadata).__name__}"
            )
        recorded = _recorded(tensor_transport_metadata)
        # Bounded by what Ray recorded: a larger reply is refused from its manifest.
        most = sum(math.prod(shape) for shape, _ in recorded)
        # The maker's Unix socket only when Ray says it runs on this node: a path that
        # resolves proves nothing (two Ray nodes may share a filesystem).
        local = on_this_node(
            getattr(tensor_transport_metadata, "node", None),
            getattr(tensor_transport_metadata, "local", None),
        )
        try:
            arrays = self.endpoint.fetch(address, obj_id, max_values=most, local=local)
        except TensorSetError as exc:
            # Below this side's own limit, a refused set is the maker's doing (larger
            # than Ray recorded, or malformed): it did not serve the object. An object
            # as large as the limit may be refused by the limit itself: that error stays.
            if most >= self.endpoint.settings.session().max_gradient_len:
                raise
            expected = f"the arrays Ray recorded for object {obj_id}: {_describe(recorded)}"
            raise ProtocolError(expected, exc.detail, address) from exc
        _check_against(arrays, recorded, obj_id)
        if target_buffers is None:
            return arrays
        for target, array in zip(target_buffers, arrays, strict=True):
            np.copyto(target, array)
        return list(target_buffers)

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError("the GRADSTREAM transport is one-sided: the receiver fetches")

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        self.endpoint.withdraw(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        self.endpoint.abort(obj_id)


def _recorded(meta: TensorTransportMetadata) -> list[tuple[tuple[int, ...], np.dtype[Any]]]:
    """The shapes and (native-endian) dtypes of the arrays the maker's metadata names:
    it came through Ray, not from the peer."""
    # Typed with torch's types where torch is installed: they hold numpy's here.
    pairs: list[tuple[Any, Any]] = list(meta.tensor_meta)
    return [
        (tuple(int(n) for n in shape), np.dtype(dtype).newbyteorder("=")) for shape, dtype in pairs
    ]


def _check_against(
    arrays: list[Any], recorded: list[tuple[tuple[int, ...], np.dtype[Any]]], obj_id: str
) -> None:
    """The fetched arrays are what Ray recorded: their count, shapes and dtypes."""
    got = [(tuple(array.shape), array.dtype.newbyteorder("=")) for array in arrays]
    if got != recorded:
        raise ProtocolError(
            f"the arrays Ray recorded for object {obj_id}: {_describe(recorded)}",
            _describe(got),
        )


def _describe(pairs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> str:
    return "[" + ", ".join(f"{dtype.name}{list(shape)}" for shape, dtype in pairs) + "]"


_settings_lock = threading.Lock()
# The settings register() gave in this process, and the KV key of the job they were
# last written under (a driver may ray.shutdown() and ray.init() a new job).
_given: RaySettings | None = None
_published_under: bytes | None = None
_KEY_PREFIX = b"gradstream.ray/settings/"


def _in_worker() -> bool:
    """True in a process Ray started for tasks and actors (not a driver)."""
    worker = ray._private.worker
    return bool(worker.global_worker.mode == worker.WORKER_MODE)


def _key() -> bytes:
    # One entry per job: drivers sharing a cluster each keep their own settings.
    return _KEY_PREFIX + ray.get_runtime_context().get_job_id().encode()


def register(settings: RaySettings | None) -> RaySettings:
    """The driver's settings for this job (``None``: what was given before, else the
    defaults), published to Ray's KV store once Ray is up. In a worker process this
    does nothing: its settings are always the driver's."""
    global _given
    if _in_worker():
        return _published()
    with _settings_lock:
        if settings is not None and _given is not None and not _same(settings, _given):
            raise SettingError(
                "register",
                "gradstream.ray.register() was already given other settings in this "
                "process; call it once, in the driver, before the actors use the transport",
            )
        # Without an authkey, a random one: the job's processes read it with the rest.
        _given = (_given or settings or RaySettings()).with_key()
    return _published()


def _same(new: RaySettings, old: RaySettings) -> bool:
    """``new`` asks for what ``old`` holds (a ``new`` without a key takes the key that
    was made for ``old``)."""
    if new.authkey is None:
        new = dataclasses.replace(new, authkey=old.authkey)
    return new == old


def _published() -> RaySettings:
    """This process's settings: in the driver, those register() was given (or the
    defaults), written to Ray's KV store on first use; in a worker, the driver's, read
    from there."""
    global _given, _published_under
    if _in_worker():
        data = _internal_kv_get(_key())
        if data is None:
            raise SettingError(
                "register",
                "this job's driver published no gradstream.ray settings: call "
                "gradstream.ray.register() in the driver, after ray.init()",
            )
        settings = pickle.loads(data)  # written by this job's driver (Ray's control plane)
        if not isinstance(settings, RaySettings):
            raise TypeError(f"{_key()!r} in Ray's KV store holds no gradstream.ray settings")
        return settings
    with _settings_lock:
        if _given is None:
            _given = RaySettings().with_key()
        if ray.is_initialized() and _published_under != (key := _key()):
            _internal_kv_put(key, pickle.dumps(_given), overwrite=True)
            _published_under = key
        return _given


def make_known() -> None:
    """Make ``"gradstream"`` a tensor transport name in this process (Ray checks the
    name where a decorated method is defined, in every process that imports it), and
    refuse, from here on, a call that passes this transport's objects to an actor that
    cannot receive them (``_refuse_receivers_without_transport``)."""
    if TRANSPORT not in transport_manager_info:
        register_tensor_transport(TRANSPORT, ["cpu"], GradstreamTransport, np.ndarray)
    submit = RDTManager.queue_or_trigger_out_of_band_tensor_transfer
    if not getattr(submit, "_gradstream_checked", False):
        RDTManager.queue_or_trigger_out_of_band_tensor_transfer = (  # type: ignore[method-assign]
            _refuse_receivers_without_transport(submit)
        )


_Submit = TypeVar("_Submit", bound=Callable[..., Any])


def _refuse_receivers_without_transport(submit: _Submit) -> _Submit:
    """Ray's step that starts the transfers of a task's arguments (it runs in the caller,
    before the task is submitted), preceded by a check that the receiving actor was
    declared with ``enable_tensor_transport=True`` whenever an argument is this
    transport's object (docs/guides/ray.md, "Receivers").

    Why: Ray 2.60 runs each transfer into an actor as a task of that actor's
    ``_ray_system`` concurrency group, which only ``enable_tensor_transport=True``
    creates. Without it the transfer joins the actor's ordinary queue; a transfer whose
    object did not exist yet when the task was submitted is queued behind that very
    task, which waits in its argument's deserialization for the transfer: Ray's
    ``TimeoutError`` after ``RAY_rdt_fetch_fail_timeout_milliseconds`` (60 s), and the
    transfer runs after the task failed (ray-project/ray#66264). Whether an object
    exists yet is a race (an actor's first call waits for the actor, and so usually
    works): the call is refused always, in the caller, before anything is sent."""

    @functools.wraps(submit)
    def checked(self: RDTManager, dst_actor: Any, task_args: Any) -> Any:
        if not getattr(dst_actor, "_ray_enable_tensor_transport", True):
            for arg in task_args:
                if not isinstance(arg, ray.ObjectRef):
                    continue
                meta = self.get_rdt_metadata(arg.hex())
                if meta is not None and str(meta.tensor_transport_backend).upper() == TRANSPORT:
                    raise SettingError(
                        "enable_tensor_transport",
                        f"{dst_actor} is passed object {arg.hex()} of the GRADSTREAM "
                        "tensor transport, but its class was declared without "
                        "enable_tensor_transport=True: Ray 2.60 would run the transfer "
                        "behind the task that waits for it (a TimeoutError). Declare the "
                        "receiving class with @ray.remote(enable_tensor_transport=True)",
                    )
        return submit(self, dst_actor, task_args)

    checked._gradstream_checked = True  # type: ignore[attr-defined]
    return cast(_Submit, checked)
