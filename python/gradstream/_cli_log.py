"""The command's view of the library's log (logger ``gradstream``, docs/guides/limits.md, logging):
one compact line a record on stderr, ``gradstream: warning: ...``, WARNING and above by
default (the refusals of bad peers at ``recv``), INFO with ``-v``, DEBUG with ``-vv``.

A record's traceback, if it has one, is cut to its last line: the command never prints
a traceback. ``cli.main`` installs the handler for one command and removes it after.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from ._cli_base import one_line

__all__ = ["LOGGER", "command_logging", "level_for"]

LOGGER = "gradstream"


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text = f"{text}: {exc} ({type(exc).__name__})"
        return f"gradstream: {record.levelname.lower()}: {one_line(text)}"


def level_for(verbosity: int) -> int:
    """``-v`` counted: 0 WARNING, 1 INFO, 2 or more DEBUG."""
    return {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)


@contextlib.contextmanager
def command_logging(level: int) -> Iterator[None]:
    """The library's records at ``level`` and above on stderr, one line each, while the
    command runs; nothing is passed on to the root logger (no second copy)."""
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
