"""Progress of long steps: one line rewritten in place on a terminal, quiet in logs.

Downloads draw a bar (:func:`hybridpd.pkgindex.download`); server start-up prints its
state (:func:`printer`); a step that runs a child for minutes (a pytest run) shows
:func:`ticker`. Where stderr is not a terminal (CI logs, pipes) a ticker prints nothing
and a printer prints at most one line every ``every`` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

CLEAR = "\r\033[K"

Log = Callable[[str], None]
"""How a library function reports its progress: one call per line. Functions take a
``log`` (most default to :func:`quiet`; ``build.build`` to :func:`say`), and the CLI
passes its stderr echo, or :func:`quiet` with ``--json``. A few one-off notices (a
re-download, a git fallback) go straight to :func:`say`."""


def quiet(_message: str) -> None:
    """The :data:`Log` that says nothing: the library's default."""


def say(message: str) -> None:
    """A line for the user on stderr (the library's messages; results go to stdout)."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bar(label: str, total: int, stream: TextIO | None = None) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; on a terminal a line ``label  NN% (done/total MB)`` is
    rewritten as it advances, elsewhere ``label (total MB)`` is said once."""
    stream = stream or sys.stderr
    size = f" ({total / 1e6:.1f} MB)" if total else ""
    if not total or not stream.isatty():
        stream.write(f"{label}{size}\n")
        stream.flush()
        yield lambda _n: None
        return
    state = {"done": 0, "shown": -1}

    def advance(n: int) -> None:
        state["done"] += n
        percent = min(100, state["done"] * 100 // total)
        if percent != state["shown"]:
            state["shown"] = percent
            stream.write(f"{CLEAR}{label}  {percent:3d}% "
                         f"({state['done'] / 1e6:.1f}/{total / 1e6:.1f} MB)")
            stream.flush()

    try:
        yield advance
    finally:
        stream.write("\n")
        stream.flush()


def printer(stream: TextIO | None = None, every: float = 10.0):
    """``(show, done)``: ``show(msg)`` rewrites the line on a terminal, else prints every
    ``every`` s (and always a message without "starting"); ``done()`` ends the line."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    state = {"last": 0.0}

    def show(msg: str) -> None:
        if tty:
            stream.write(CLEAR + msg)
            stream.flush()
        elif time.monotonic() - state["last"] >= every or "starting" not in msg:
            state["last"] = time.monotonic()
            stream.write(msg + "\n")
            stream.flush()

    def done() -> None:
        if tty:
            stream.write("\n")
            stream.flush()

    return show, done


@contextlib.contextmanager
def ticker(
    label: str,
    status: Callable[[], str] = lambda: "",
    stream: TextIO | None = None,
    interval: float = 1.0,
) -> Iterator[None]:
    """While the body runs, keep ``label: <status()> (<seconds> s)`` on the terminal's
    last line, refreshed every ``interval`` s, and clear it at the end. Nothing at all
    when ``stream`` (default stderr) is not a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield
        return
    stop = threading.Event()
    start = time.monotonic()

    def draw() -> None:
        while not stop.wait(interval):
            try:
                text = status()
            except Exception:  # a status is a nicety: never fail the step for it
                text = ""
            shown = f"{label}: {text} " if text else f"{label} "
            stream.write(f"{CLEAR}{shown}({time.monotonic() - start:.0f} s)")
            stream.flush()

    thread = threading.Thread(target=draw, name="hybridpd-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        stream.write(CLEAR)
        stream.flush()
