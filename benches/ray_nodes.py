"""The two Ray nodes of benches/ray_bench.py on this one machine, and their teardown: the
head in the root network namespace and a second node in a namespace this module makes,
joined by a veth pair (needs root and ``ip``; ``namespaces_unavailable`` says why not).

Each ``ray start`` here gets its own ``--temp-dir`` under /tmp/raybench, its own ports, a
token of its own (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``: the joining node and the
driver present the head's token) and an environment marker; teardown (also on error or
SIGTERM) ends the processes that carry that marker, and those left in the namespace,
never ``ray stop`` (it would end every Ray process on the machine, other clusters' too),
then deletes the veth pair, the namespace and the temp dir. Traffic goes only to
loopback and to the two addresses of the veth pair.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OBJECT_STORE = 2 << 30
TEMP_ROOT = Path("/tmp/raybench")
SUBNET = "10.213.0"
HEAD_IP, NODE_IP = f"{SUBNET}.1", f"{SUBNET}.2"
MARK = "GRADSTREAM_RAY_BENCH"


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Clusters:
    """The Ray processes, namespace and veth pair this run made, and their teardown."""

    def __init__(self) -> None:
        self.marker = secrets.token_hex(8)
        self.token = secrets.token_hex(32)
        self.root = TEMP_ROOT / f"{os.getpid()}-{self.marker}"
        self.namespace: str | None = None
        self.veth: str | None = None
        self.ray = str(Path(os.path.abspath(sys.executable)).with_name("ray"))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                MARK: self.marker,
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.token,
            }
        )
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env.pop("RAY_ADDRESS", None)
        return env

    def _ray_start(
        self,
        prefix: list[str],
        node_ip: str,
        resource: str | None,
        head_port: int | None,
        join: str | None,
        temp: str,
    ) -> None:
        agent, grpc, runtime, metrics = _free_ports(4)
        cmd = [
            *prefix,
            self.ray,
            "start",
            f"--node-ip-address={node_ip}",
            "--num-cpus=4",
            f"--object-store-memory={OBJECT_STORE}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={runtime}",
            f"--metrics-export-port={metrics}",
            "--disable-usage-stats",
        ]
        if resource is not None:
            cmd.append("--resources=" + json.dumps({resource: 1}))
        if head_port is not None:
            cmd += [
                "--head",
                f"--port={head_port}",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
            ]
        else:
            assert join is not None
            cmd += [f"--address={join}", f"--temp-dir={temp}"]
        try:
            _run(cmd, env=self.env(), timeout=120)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{exc.stdout[-2000:]}\n{exc.stderr[-2000:]}"
            ) from None

    def start_head(self, node_ip: str, resource: str | None, name: str) -> str:
        port = _free_ports(1)[0]
        temp = self.root / name
        temp.mkdir(parents=True, exist_ok=True)
        self._ray_start([], node_ip, resource, port, None, str(temp))
        return f"{node_ip}:{port}"

    def join(self, address: str, node_ip: str, resource: str, name: str) -> None:
        assert self.namespace is not None
        temp = self.root / name
        temp.mkdir(parents=True, exist_ok=True)
        prefix = ["ip", "netns", "exec", self.namespace]
        self._ray_start(prefix, node_ip, resource, None, address, str(temp))

    def make_namespace(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespace = f"gsbench{tag}"
        veth, peer = f"gsb{tag}a", f"gsb{tag}b"
        _run(["ip", "netns", "add", self.namespace])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        self.veth = veth
        _run(["ip", "link", "set", peer, "netns", self.namespace])
        _run(["ip", "addr", "add", f"{HEAD_IP}/24", "dev", veth])
        _run(["ip", "link", "set", veth, "up"])
        inside = ["ip", "netns", "exec", self.namespace]
        _run([*inside, "ip", "addr", "add", f"{NODE_IP}/24", "dev", peer])
        _run([*inside, "ip", "link", "set", peer, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])

    def _marked(self) -> list[int]:
        """The processes that carry this run's marker (the Ray processes it started,
        and theirs), itself excepted."""
        needle = f"{MARK}={self.marker}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def _in_namespace(self) -> list[int]:
        if self.namespace is None:
            return []
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            out = _run(["ip", "netns", "pids", self.namespace]).stdout
            return [int(pid) for pid in out.split()]
        return []

    def stop_processes(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            pids = set(self._marked()) | set(self._in_namespace())
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not (set(self._marked()) | set(self._in_namespace())):
                    return
                time.sleep(0.2)
        left = set(self._marked()) | set(self._in_namespace())
        if left:
            print(f"warning: processes left after SIGKILL: {sorted(left)}", file=sys.stderr)

    def teardown(self) -> None:
        self.stop_processes()
        if self.veth is not None:
            with contextlib.suppress(subprocess.CalledProcessError):
                _run(["ip", "link", "del", self.veth])
            self.veth = None
        if self.namespace is not None:
            with contextlib.suppress(subprocess.CalledProcessError):
                _run(["ip", "netns", "del", self.namespace])
            self.namespace = None
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            TEMP_ROOT.rmdir()  # only when no other run's folder is in it


def namespaces_unavailable() -> str | None:
    """Why namespace rows cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    if out.returncode != 0:
        return f"`ip addr` failed: {out.stderr.strip()}"
    if f" {SUBNET}." in out.stdout:
        return f"{SUBNET}.0/24 is already in use on this machine"
    return None
