"""The server's log lines are written by threads of their own (target_side.service.log_writer)."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from logging.handlers import QueueHandler

import pytest
from uvicorn.logging import AccessFormatter

from target_side.service.log_writer import HELD_RECORDS, SETTLE_S, LogWriters, every_logger


class ThreadNoting(logging.StreamHandler):  # type: ignore[type-arg]
    """A real stream handler that also notes which thread wrote each line."""

    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.threads: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.threads.append(threading.get_ident())
        super().emit(record)

    @property
    def text(self) -> str:
        stream = self.stream
        assert isinstance(stream, io.StringIO)
        return stream.getvalue()


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    found = logging.getLogger("paddock.test.log_writer")
    found.propagate = False
    found.setLevel(logging.INFO)
    yield found
    found.handlers.clear()


def test_lines_are_written_off_the_thread_that_logs_them(logger: logging.Logger) -> None:
    handler = ThreadNoting()
    logger.addHandler(handler)
    writers = LogWriters([logger])
    try:
        assert handler not in logger.handlers
        for number in range(50):
            logger.info("turn %d ended", number)
    finally:
        writers.stop()
    assert handler.text.splitlines() == [f"turn {n} ended" for n in range(50)]
    assert set(handler.threads) and threading.get_ident() not in handler.threads
    assert handler in logger.handlers  # given back, and nothing left in its place
    assert not any(isinstance(h, QueueHandler) for h in logger.handlers)
    logger.info("after")
    assert handler.threads[-1] == threading.get_ident()


def test_a_traceback_is_kept(logger: logging.Logger) -> None:
    handler = ThreadNoting()
    logger.addHandler(handler)
    writers = LogWriters([logger])
    try:
        try:
            raise RuntimeError("the launch failed")
        except RuntimeError:
            logger.exception("turn t-1: the target failed to launch it")
    finally:
        writers.stop()
    assert "turn t-1: the target failed to launch it" in handler.text
    assert "RuntimeError: the launch failed" in handler.text
    assert "Traceback" in handler.text


def test_uvicorns_access_lines_keep_their_fields(logger: logging.Logger) -> None:
    handler = ThreadNoting()
    handler.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s'))
    logger.addHandler(handler)
    writers = LogWriters([logger])
    try:
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", "/v1/turns", "1.1", 201)
    finally:
        writers.stop()
    assert handler.text.strip() == '127.0.0.1:5 - "POST /v1/turns HTTP/1.1" 201 Created'


def test_a_handlers_level_still_holds(logger: logging.Logger) -> None:
    handler = ThreadNoting()
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    writers = LogWriters([logger])
    try:
        logger.info("not for this handler")
        logger.warning("for it")
    finally:
        writers.stop()
    assert handler.text == "for it\n"


def test_every_logger_includes_the_root_and_those_made() -> None:
    made = logging.getLogger("paddock.test.log_writer.made")
    found = every_logger()
    assert found[0] is logging.getLogger()
    assert made in found


class Stalled(ThreadNoting):
    """A log whose reader has stopped reading: every write waits until ``reading`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.reading.wait(30)
        super().emit(record)


def test_a_log_that_stops_reading_never_holds_up_the_logger_and_drops_are_told(
    logger: logging.Logger,
) -> None:
    stalled = Stalled()
    logger.addHandler(stalled)
    told = ThreadNoting()
    paddock = logging.getLogger("paddock.target")
    paddock.addHandler(told)
    writers = LogWriters([logger])
    extra = 50
    try:
        started = time.monotonic()
        for number in range(HELD_RECORDS + extra + 1):  # the thread holds one as it waits
            logger.info("line %d", number)
        assert time.monotonic() - started < 10  # before: each line waited for the reader
        stalled.reading.set()
        deadline = time.monotonic() + 30
        while stalled.text.count("\n") < HELD_RECORDS + 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader catches up
        logger.info("after")
    finally:
        writers.stop()
        paddock.removeHandler(told)
    written = stalled.text.splitlines()
    assert written[-1] == "after"
    assert len(written) == HELD_RECORDS + 2
    assert f"{extra} log lines were dropped" in told.text


class TimeNoting(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.written.append((time.monotonic(), record.getMessage()))


def test_an_idle_writer_lets_the_moment_that_woke_it_pass_and_writes_what_came_with_it(
    logger: logging.Logger,
) -> None:
    """Woken by a line, a writer would take the interpreter lock from the event loop just as
    the loop goes on with what the line was about (a turn's end, on its way out)."""
    handler = TimeNoting()
    logger.addHandler(handler)
    writers = LogWriters([logger])
    try:
        for burst in range(3):
            logged = time.monotonic()
            for number in range(5):
                logger.info("burst %d line %d", burst, number)
            deadline = logged + 5
            while len(handler.written) < 5 * (burst + 1) and time.monotonic() < deadline:
                time.sleep(0.001)
            first = handler.written[5 * burst][0]
            assert first - logged >= SETTLE_S
            time.sleep(3 * SETTLE_S)  # idle again
    finally:
        writers.stop()
    assert [m for _, m in handler.written] == [
        f"burst {b} line {n}" for b in range(3) for n in range(5)
    ]


def test_one_thread_writes_every_loggers_lines_each_to_its_own_handlers(
    logger: logging.Logger,
) -> None:
    """A turn's access line and its end line come from two loggers: one writer wakes for both."""
    other = logging.getLogger("paddock.test.log_writer.other")
    other.propagate = False
    other.setLevel(logging.INFO)
    mine, theirs = ThreadNoting(), ThreadNoting()
    logger.addHandler(mine)
    other.addHandler(theirs)
    writers = LogWriters([logger, other])
    try:
        for number in range(20):
            logger.info("access %d", number)
            other.info("ended %d", number)
    finally:
        writers.stop()
        other.handlers.clear()
    assert mine.text.splitlines() == [f"access {n}" for n in range(20)]
    assert theirs.text.splitlines() == [f"ended {n}" for n in range(20)]
    assert len(set(mine.threads) | set(theirs.threads)) == 1
    assert threading.get_ident() not in mine.threads
