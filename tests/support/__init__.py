"""Helpers the test folders share, imported as ``from support.frames import ...``.

pytest puts tests/ on sys.path (``pythonpath = ["tests"]`` in pyproject.toml), so this
package imports the same way from every folder, whatever the import mode. Fixtures are not
here: they are in tests/conftest.py.

    frames    the frame header, frames built and split by hand, decoded both ways
    impls     the two implementations by name, their pairs, the settings tried
    values    float32 bit patterns a round trip must keep
    aio       asyncio under a deadline, transfers over socketpairs and TCP
    memory    this process's RSS figures
    payloads  payload surgery: Arrow IPC record batches read and rewritten byte by byte
    bomb      compressed-buffer bombs, and a receive of one measured for peak RSS
    peer      the test peer: an independent implementation of the connection protocol
              (sans-I/O, with an asyncio driver) for the other side of a connection

and one module per group of tests that share more (cases, compressed, differential, dtypes,
links, outputs, shapes, streams, tensor_sets, certs, cli, connections, protocol).
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
