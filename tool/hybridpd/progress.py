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
