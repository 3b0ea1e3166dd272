"""A forked child gets a working library (what ``multiprocessing``'s "fork" start method
and a torch ``DataLoader`` do): the tokio runtime of the transfers, the session's
templates and ``gradstream.ray``'s loop are made again in the child on first use, so a
child forked after its parent's own transfers does transfers of its own.

Each case runs in a subprocess of its own with a bound on the child, so that a child that
hangs fails the test instead of hanging the suite: the parent of the case kills a child
still running after ``BOUND`` seconds and reports it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Seconds a child's transfers may take; each takes milliseconds when the library works.
BOUND = 30

PRELUDE = f"""
import asyncio, os, signal, socket, sys, threading, time
import numpy as np
import gradstream as gs

BOUND = {BOUND}
G = np.arange(1_000_000, dtype=np.float32)  # 4 MB: past the caller-thread fast path


async def over_a_connection(g):
    async with await gs.listen(("127.0.0.1", 0)) as listener:

        async def receive():
            async with await listener.accept() as conn:
                return await conn.recv()

        receiving = asyncio.create_task(receive())
        async with await gs.connect(listener.address) as conn:
            await conn.send(g)
        return await receiving


async def over_a_socket(session, g):
    a, b = socket.socketpair()
    with a, b:
        got, _ = await asyncio.gather(session.receive_from(b), session.stream_to(g, a))
    return got


def transfers(session):
    \"\"\"A connection transfer, a session's stream over a socket pair and an in-memory
    encode + decode, each checked value for value.\"\"\"

    async def all_of_them():
        return [await over_a_connection(G), await over_a_socket(session, G)]

    for got in asyncio.run(asyncio.wait_for(all_of_them(), BOUND)):
        assert np.array_equal(got, G)
    assert np.array_equal(session.decode_frames(session.encode_frames(G)), G)


def wait_child(pid):
    \"\"\"The child's exit code, or "hung" (it is killed) once BOUND seconds have passed.\"\"\"
    end = time.monotonic() + BOUND
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def child_does(work):
    \"\"\"Fork; the child runs `work` and exits 0, or 3 with the error on stderr.\"\"\"
    pid = os.fork()
    if pid == 0:
        try:
            work()
        except BaseException as e:
            print(f"child: {{e!r}}", file=sys.stderr, flush=True)
            os._exit(3)
        os._exit(0)
    return wait_child(pid)
"""


def run_case(body: str) -> None:
    """Run the prelude and `body` in a new interpreter; it must print "ok" and exit 0."""
    code = PRELUDE + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=4 * BOUND
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the case itself hung: {e.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"], (done.stdout, done.stderr)


def test_a_child_forked_after_the_parents_transfers_transfers_with_os_fork() -> None:
    run_case(
        """
        session = gs.GradientStreamSession("fork", 65536)
        transfers(session)  # the parent's own: its runtime, hub and templates are made
        # The child with the parent's session and with one of its own.
        assert child_does(lambda: transfers(session)) == 0
        assert child_does(lambda: transfers(gs.GradientStreamSession("child"))) == 0

        def and_a_grandchild():
            # Forked from a child that had made its own runtime.
            transfers(session)
            assert child_does(lambda: transfers(session)) == 0

        assert child_does(and_a_grandchild) == 0
        transfers(session)  # and the parent's still work
        print("ok")
        """
    )


def test_a_child_forked_by_multiprocessing_transfers() -> None:
    run_case(
        """
        import multiprocessing

        def work(queue):
            transfers(gs.GradientStreamSession("mp"))
            queue.put("done")

        transfers(gs.GradientStreamSession("parent"))
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        children = [ctx.Process(target=work, args=(queue,)) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(BOUND)
        hung = [c.pid for c in children if c.is_alive()]
        for child in children:
            child.kill() if child.is_alive() else None
        assert not hung, f"children still running after {BOUND} s: {hung}"
        assert [c.exitcode for c in children] == [0, 0]
        assert [queue.get(timeout=1) for _ in children] == ["done", "done"]
        print("ok")
        """
    )


def test_a_child_forked_while_other_threads_decode_with_its_session_decodes() -> None:
    """Threads of the parent decode with the session (a template lookup per chunk) while
    it forks: whatever lock they held at the fork, the child's decodes with that session
    go on (its templates are made again there)."""
    run_case(
        """
        s = gs.GradientStreamSession("fork", 4096)
        wire = s.encode_frames(np.ones(2_000_000, np.float32))
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                s.decode_frames(wire)

        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()

        def decode():
            assert float(s.decode_frames(wire).sum()) == 2e6

        try:
            for _ in range(100):
                assert child_does(decode) == 0
        finally:
            stop.set()
            for t in threads:
                t.join()
        print("ok")
        """
    )


def test_the_ray_loop_is_made_again_in_a_forked_child() -> None:
    pytest.importorskip("ray")
    run_case(
        """
        from gradstream.ray import _loop

        async def where():
            await asyncio.sleep(0)
            return os.getpid()

        assert _loop.call(where()) == os.getpid()
        parent_loop = _loop.loop()

        def work():
            # The parent's loop thread does not run here: a call would wait for ever.
            assert _loop.call(where()) == os.getpid()
            assert np.array_equal(_loop.call(over_a_connection(G)), G)

        assert child_does(work) == 0
        assert _loop.call(where()) == os.getpid()
        assert _loop.loop() is parent_loop  # the parent keeps its loop
        print("ok")
        """
    )
