"""Blocking receives from slow peers, with Ctrl-C: a receive driven on the caller's
thread (crates/gradstream-py/src/complete.rs, run_here) sees a signal within a wait
slice however often the socket wakes it, and a receive interrupted never acknowledges
the gradient it did not hand back."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np

import gradstream as gs
import gradstream.sync as gsync
from support.connections import raw_listener


def test_ctrl_c_seen_within_a_second_while_a_peer_trickles() -> None:
    """A peer sending one byte every 5 ms keeps the caller's poll(2) waking: a SIGINT
    whose C handler ran outside that poll (here: on another thread) must still be acted
    on within a wait slice, not once the trickle ends."""
    wire = bytes(gs.GradientStreamSession().encode_frames(np.arange(1_000, dtype=np.float32)))
    srv = raw_listener()
    stop = threading.Event()

    def trickle() -> None:
        peer, _ = srv.accept()
        with peer:
            for b in wire:
                if stop.is_set():
                    return
                peer.send(bytes([b]))
                time.sleep(0.005)

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    helper = threading.Thread(target=lambda: time.sleep(30), daemon=True)
    helper.start()
    conn = gsync.connect(srv.getsockname(), protocol="seed")
    kicked = []

    def kick() -> None:
        time.sleep(0.5)
        kicked.append(time.monotonic())
        signal.pthread_kill(helper.ident, signal.SIGINT)  # handler runs off the poll

    threading.Thread(target=kick, daemon=True).start()
    got = None
    try:
        got = conn.recv()
        late = time.monotonic() - kicked[0]
        raise AssertionError(f"recv returned ({got.size} values) {late:.1f}s after Ctrl-C")
    except KeyboardInterrupt:
        late = time.monotonic() - kicked[0]
        assert late < 1.0, f"KeyboardInterrupt {late:.1f}s after Ctrl-C"
    finally:
        stop.set()
        conn.close()


def _slow_proxy(target: tuple[str, int], piece: int, pause: float) -> socket.socket:
    """A proxy to ``target``: client->server at once, server->client ``piece`` bytes per
    ``pause`` seconds (a slow link)."""
    front = raw_listener()

    def pump(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = src.recv(piece if slow else 65536)
                if not data:
                    break
                dst.sendall(data)
                if slow:
                    time.sleep(pause)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def run() -> None:
        client, _ = front.accept()
        server = socket.create_connection(target)
        threading.Thread(target=pump, args=(client, server, False), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, True), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return front


def test_an_interrupted_recv_never_acks_a_gradient_it_did_not_return() -> None:
    """docs/guides/connections.md "Delivery": no gradient is acknowledged that no call
    returned. A Ctrl-C that came while the caller's thread drove the receive is raised
    with the ack still owed (and the gradient then refused), never after the ack was
    written, which would let the sender's send() succeed for a gradient nobody got."""
    values = np.arange(2_000, dtype=np.float32)
    listener = gsync.listen(("127.0.0.1", 0))
    outcome: list[object] = []

    def sender() -> None:
        with listener.accept(timeout=20) as conn:
            try:
                outcome.append(conn.send(values))
            except Exception as exc:  # DeliveryError is the right answer
                outcome.append(exc)

    threading.Thread(target=sender, daemon=True).start()
    front = _slow_proxy(listener.address, 16, 0.005)
    helper = threading.Thread(target=lambda: time.sleep(60), daemon=True)
    helper.start()
    conn = gsync.connect(front.getsockname())

    def kick() -> None:
        time.sleep(0.3)
        signal.pthread_kill(helper.ident, signal.SIGINT)

    threading.Thread(target=kick, daemon=True).start()
    got = None
    try:
        got = conn.recv()
    except KeyboardInterrupt:
        pass
    time.sleep(1.0)
    conn.close()
    listener.close()
    assert got is not None or not isinstance(outcome[0], int), (
        f"the sender's send() returned {outcome} (acknowledged) but recv() gave nothing"
    )
