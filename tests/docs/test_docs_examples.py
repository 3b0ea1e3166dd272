"""The fenced code blocks of README.md and docs/**/*.md run, or at least compile, as written.

The convention (docs/contributing.md, "Examples in the docs"): an HTML comment on the
line just before a fence says what the block is.

- A ``python`` block without a comment is a program of its own: it runs alone in a
  fresh folder and must exit 0.
- ``<!-- fragment -->``: a piece of a program (names defined elsewhere, ``await`` at the
  top level). It is not run; it must compile, wrapped in an ``async def``.
- ``<!-- run NAME -->``: one step of the example NAME of its page. The steps of an
  example run in page order, in one fresh folder (files one step writes, the next
  reads), ``python`` blocks by this test's Python and ``sh`` blocks by ``sh -e``, each
  of which must exit 0. ``background`` after the name starts the step and goes on to
  the next once the step has printed its first line (a server saying it listens);
  ``join`` waits for the example's background steps to exit, each with 0, before this
  step starts; every background step must have exited 0 when the example ends.
  ``127.0.0.1:7000`` in an example's steps is replaced by a free port of this machine,
  the same in every step of the example, so that examples do not collide with each
  other or anything else on the machine; as written, they run on port 7000.
- ``<!-- run-by: tests/PATH.py -->``: the block is run by that test, which reads it
  from this page (it must name the page); ``python`` ones must also compile as they are.

Other blocks (``text``, ``console``, ``rust``, unmarked ``sh``...) are not run. The
README's and the getting-started pages' ``python`` blocks and the first ``python`` or
``sh`` block of every guide must be runnable (no fragments there).
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
STEP_TIMEOUT = 60.0  # seconds; every runnable block takes a few on an idle machine
PORT = "127.0.0.1:7000"
RUN_LANGUAGES = {"python", "sh"}

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
COMMENT = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")
RUN = re.compile(r"run (?P<name>[\w-]+)(?P<flags>(?: (?:background|join))*)")
RUN_BY = re.compile(r"run-by: (?P<path>\S+)")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    marker: str | None  # the comment's text, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        if self.marker is None:
            return "program" if self.lang == "python" else "shown"
        if self.marker == "fragment":
            return "fragment"
        if RUN.fullmatch(self.marker):
            return "step"
        if RUN_BY.fullmatch(self.marker):
            return "run-by"
        return "comment"  # any other comment before a fence: an error for runnable blocks


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    at = 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if not opening or not opening["lang"]:
            at += 1
            continue
        indent = len(opening["indent"])
        end = at + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[indent:] for line in lines[at + 1 : end]) + "\n"
        before = at - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        comment = COMMENT.match(lines[before]) if before >= 0 else None
        marker = comment["text"] if comment else None
        found.append(Block(page, at + 1, opening["lang"], body, marker))
        at = end + 1
    return found


ALL = [block for page in PAGES for block in blocks_of(page)]


@dataclass
class Example:
    page: Path
    name: str
    steps: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}#{self.name}"


def examples() -> list[Example]:
    found: dict[tuple[Path, str], Example] = {}
    for block in ALL:
        if block.kind == "program":
            name = f"line-{block.line}"
        elif block.kind == "step":
            match = RUN.fullmatch(block.marker or "")
            assert match is not None
            name = match["name"]
        else:
            continue
        found.setdefault((block.page, name), Example(block.page, name)).steps.append(block)
    return list(found.values())


EXAMPLES = examples()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Step:
    """A block running as a process, its output read in threads (reads can time out)."""

    def __init__(self, block: Block, folder: Path, port: int, index: int) -> None:
        self.block = block
        code = block.code.replace(PORT, f"127.0.0.1:{port}")
        script = folder / f"step-{index}.{'py' if block.lang == 'python' else 'sh'}"
        script.write_text(code)
        shell = ["sh", "-e"] if block.lang == "sh" else [sys.executable]
        command = [*shell, script.name]
        env = dict(os.environ)
        # `python` and `gradstream` in sh steps are this test's (the venv's).
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            command, cwd=folder, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, sink in ((self.proc.stdout, self.lines), (self.proc.stderr, None)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream: IO[str], sink: queue.Queue[str | None] | None) -> None:
        for line in stream:
            (self.out if sink is not None else self.err).append(line)
            if sink is not None:
                sink.put(line)
        if sink is not None:
            sink.put(None)

    def first_line(self, deadline: float) -> None:
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"{self.block.where}: printed nothing within {STEP_TIMEOUT} s")
        if line is None:
            self.finish(deadline)
            pytest.fail(f"{self.block.where}: ended before printing a line\n{self.report()}")

    def finish(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.block.where}: running after {STEP_TIMEOUT} s\n{self.report()}")
        time.sleep(0.05)  # let the reader threads drain the pipes
        assert self.proc.returncode == 0, f"{self.block.where} failed\n{self.report()}"

    def report(self) -> str:
        return f"stdout:\n{''.join(self.out)[-3000:]}\nstderr:\n{''.join(self.err)[-3000:]}"


@pytest.fixture
def running() -> Iterator[list[Step]]:
    steps: list[Step] = []
    yield steps
    for step in steps:
        if step.proc.poll() is None:
            step.proc.kill()
            step.proc.wait()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_the_example_runs_as_written(example: Example, tmp_path: Path, running: list[Step]) -> None:
    port = free_port()
    background: list[Step] = []
    for index, block in enumerate(example.steps):
        assert block.lang in RUN_LANGUAGES, f"{block.where}: cannot run a {block.lang} block"
        flags = (RUN.fullmatch(block.marker or "") or {"flags": ""})["flags"].split()
        deadline = time.monotonic() + STEP_TIMEOUT
        if "join" in flags:
            for step in background:
                step.finish(deadline)
            background.clear()
        step = Step(block, tmp_path, port, index)
        running.append(step)
        if "background" in flags:
            step.first_line(deadline)
            background.append(step)
        else:
            step.finish(deadline)
    deadline = time.monotonic() + STEP_TIMEOUT
    for step in background:
        step.finish(deadline)


FRAGMENTS = [b for b in ALL if b.kind == "fragment"]


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.where for b in FRAGMENTS])
def test_the_fragment_compiles_in_an_async_function(block: Block) -> None:
    assert block.lang == "python", f"{block.where}: only python blocks are fragments"
    source = "async def _fragment():\n" + textwrap.indent(block.code, "    ") + "    pass\n"
    compile(source, block.where, "exec")


RUN_BY_BLOCKS = [b for b in ALL if b.kind == "run-by"]


@pytest.mark.parametrize("block", RUN_BY_BLOCKS, ids=[b.where for b in RUN_BY_BLOCKS])
def test_a_block_run_by_another_test_names_a_test_that_reads_its_page(block: Block) -> None:
    match = RUN_BY.fullmatch(block.marker or "")
    assert match is not None
    test = ROOT / match["path"]
    assert test.is_file(), f"{block.where}: no {match['path']}"
    assert str(block.page.relative_to(ROOT)) in test.read_text(), (
        f"{match['path']} does not read {block.page.relative_to(ROOT)}"
    )
    if block.lang == "python":
        compile(block.code, block.where, "exec")


def test_every_comment_before_a_block_is_one_of_the_convention() -> None:
    wrong = [
        f"{b.where}: <!-- {b.marker} -->"
        for b in ALL
        if b.kind == "comment" or (b.kind == "step" and b.lang not in RUN_LANGUAGES)
    ]
    assert wrong == []


def test_the_readme_getting_started_and_each_guides_first_example_run() -> None:
    def must_run(page: Path) -> list[Block]:
        if page.parent.name == "guides":  # the first python or sh block
            return [b for b in blocks_of(page) if b.lang in RUN_LANGUAGES][:1]
        return [b for b in blocks_of(page) if b.lang == "python"]

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("getting-started/*.md"))]
    guides = sorted((ROOT / "docs").glob("guides/*.md"))
    assert len(guides) >= 7 and len(pages) >= 3
    not_run = [
        b.where
        for page in pages + guides
        for b in must_run(page)
        if b.kind not in ("program", "step", "run-by")
    ]
    assert not_run == []
    for page in guides:
        assert must_run(page), f"{page.relative_to(ROOT)} has no example"


def test_the_readme_fits_on_a_few_screens_and_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    assert "make demo" in readme and "make test" in readme
    steps = [b for b in blocks_of(ROOT / "README.md") if b.kind == "step"]
    # The plain quickstart, its blocking twin, and the same over TLS, each run as written.
    names = {RUN.fullmatch(b.marker or "")["name"] for b in steps}  # type: ignore[index]
    assert names == {"quickstart", "blocking", "tls"}
