"""Threads that start a fence's bubblewrap and wait for it, born inside its cgroups when they can.

Every process the server starts for a turn is started and waited for by a
``Worker``: a thread of its own, which runs ``subprocess.Popen`` (off the event
loop), opens the fence's gate when the process's status pipe says the fence
is up (``fence.gate``), and then blocks in ``waitpid`` until the process
ends, as asyncio's threaded child watcher would.

Moving a process into a cgroup makes the kernel wait out an RCU grace period
first (about 10 ms here), while the fence waits at its gate. Under cgroup v1 a
single thread can be moved, and a child is born in the cgroups of the thread
that forks it. So the ``Nursery`` keeps a few workers that have moved
themselves, ahead of time and off every turn's path, into a fresh set of turn
cgroups (one per hierarchy) and wait there. A turn takes one: its cgroups get
the turn's name and limits, its bubblewrap is started by that thread, born
inside them, with nothing left to move. The worker stays in them, asleep in
``waitpid``, until the process ends, then exits, which takes it out at once.

While it is there, the worker is a thread of the server inside the turn's
cgroups, so each rule that reads a cgroup's members must leave the server out:

- ``pids``: the worker is one of the tasks counted, and so is bubblewrap's
  outer process (which a fence moved in once it is up leaves outside); the
  turn's ``pids.max`` is written two higher (``Worker.seats``), so the turn
  itself gets exactly its limit, either way;
- killing what is left in a cgroup skips the server's own pid (``limits``);
- ``memory``: a thread's memory is charged to its process's owner, not to the
  thread's cgroup, and the OOM killer picks among processes whose leader is in
  the cgroup, so neither the limit nor an OOM kill ever touches the server;
- ``cpu``/``cpuacct``: the worker's few hundred microseconds of starting the
  process count as the turn's.

Under cgroup v2 a thread cannot be in another cgroup than its process (the
memory controller allows no threaded subtree); the kernel's way there is
clone3's ``CLONE_INTO_CGROUP``, which Python does not offer. So v2 turns are
placed after they start, as turns are whenever no settled worker is free.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import secrets
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from target_side.fence import landlock, orphans, thread_ids
from target_side.fence.cgroupfs import TURN_PREFIX, write_control

log = logging.getLogger("paddock.target")

IDLE_WORKERS = 2
"""Settled workers kept waiting: turns starting closer together than a grace period share them."""
REMOVE_TRIES = 50

Start = Callable[[], "subprocess.Popen[bytes]"]


class Watch(Protocol):
    """Told, on the worker's thread, when its process started and when it was reaped, or
    that it never started. Never raises: the worker must go on to reap the process."""

    def started(self, process: subprocess.Popen[bytes]) -> None: ...

    def ended(self) -> None: ...

    def abandoned(self) -> None: ...


class Slot(Protocol):
    """Fresh turn cgroups (one per hierarchy) with the next turn's first process-to-be in
    them: a settled ``Worker`` here, a prepared launch through the launcher
    (``launcher_client.PreparedLaunch``). A turn takes it over (its cgroups renamed for it
    where the hierarchy allows: cgroup v1)."""

    dirs: list[Path]

    @property
    def seats(self) -> int:
        """Tasks in the turn's cgroups that are not the turn's own (``pids.max`` counts them)."""

    def discard(self) -> None:
        """Not needed after all: whatever waits in the slot ends."""

    def join(self, timeout: float | None = None) -> None:
        """Wait (briefly) until the slot's cgroups can be removed."""


class Slots(Protocol):
    """Slots kept ready, each replaced once taken."""

    def take(self) -> Slot | None: ...

    def close(self) -> None: ...


class Worker:
    """One thread: settles into a slot of fresh cgroups (if given), starts one process, waits.

    ``spawned`` resolves (on the event loop) with the ``Popen`` or the error
    starting it raised; ``ended`` with its exit status.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, parents: Sequence[Path] = ()) -> None:
        self._loop = loop
        self._parents = tuple(parents)
        self.dirs: list[Path] = []
        """The slot's cgroups (one per hierarchy) once the worker is in all of them."""
        self.settled = concurrent.futures.Future[bool]()
        self.spawned: asyncio.Future[subprocess.Popen[bytes]] = loop.create_future()
        self.ended: asyncio.Future[int] = loop.create_future()
        self._jobs: queue.SimpleQueue[tuple[Start, Watch | None] | None] = queue.SimpleQueue()
        self._gone = threading.Event()
        self.tid: int | None = None
        """The thread's id for the kernel (its ``tasks`` entry), once it runs."""
        # Not ``threading.Thread.start``: it waits, on the event loop, until the new thread
        # has a core and the interpreter lock (0.4 s over 300 turns in a profile).
        _thread.start_new_thread(self._run, ())

    @property
    def is_settled(self) -> bool:
        """In its slot, and waiting for a turn (False while settling, and after it failed to)."""
        return self.settled.done() and self.settled.result()

    @property
    def seats(self) -> int:
        """Tasks in the turn's cgroups not the turn's own: counted by ``pids.max`` all the same.

        The worker itself, and bubblewrap's outer process, born inside with the
        rest (a fence moved in once it is up leaves that one outside).
        """
        return 2 if self.dirs else 0

    def start(
        self, start: Start, watch: Watch | None = None
    ) -> asyncio.Future[subprocess.Popen[bytes]]:
        """Run ``start`` on this worker's thread; then it waits for the process it returned,
        telling ``watch`` (on the thread) once it started and once it was reaped."""
        self._jobs.put((start, watch))
        return self.spawned

    def discard(self) -> None:
        """Not needed after all: the thread ends (leaving its cgroups), and they are removed;
        ``spawned`` is cancelled."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the thread's work is done. It leaves its cgroups as it exits, a moment
        later: whoever removes them next retries while they are busy."""
        self._gone.wait(timeout)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        try:
            self._live()
        finally:
            self._gone.set()

    def _live(self) -> None:
        thread_ids.mark_one_shot()  # it may act as a role's ids: it ends with its process
        self._settle()
        _confine()
        job = self._jobs.get()
        if job is None:
            # Sent away unused: a nursery that took it replaces it once ``spawned`` is done.
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                self._loop.call_soon_threadsafe(self.spawned.cancel)
            return
        start, watch = job
        try:
            process = start()
        except BaseException as exc:
            if watch is not None:
                watch.abandoned()
            self._report(self.spawned, exc)
            return
        self._report(self.spawned, process)
        if watch is not None:
            _tell(watch.started, process)
        status = process.wait()
        if watch is not None:
            _tell(watch.ended)
        self._report(self.ended, status)
        # Its sandbox's first process, handed to us as bubblewrap exited (``fence.orphans``).
        orphans.reap_orphaned_sandboxes()

    def _settle(self) -> None:
        """Move this thread into a fresh slot below each parent; on any failure, into none."""
        if not self._parents:
            self.settled.set_result(False)
            return
        name = f"{TURN_PREFIX}{os.getpid()}-t-{secrets.token_hex(16)}"
        made: list[Path] = []
        try:
            for parent in self._parents:
                slot = parent / name
                slot.mkdir(mode=0o755)
                made.append(slot)
            for slot in made:
                # This thread, not the process (cgroup v1's ``tasks``), named as "0", the writer
                # itself: named by its id, the kernel takes the lock every fork and exit on the
                # machine waits for, after a grace period when it was idle (5-7 ms here).
                write_control(slot / "tasks", "0\n")
        except OSError as exc:
            log.warning("could not settle a turn worker in %s: %s", made or self._parents, exc)
            self._leave(made)
            self.settled.set_result(False)
            return
        self.dirs = made
        self.settled.set_result(True)

    def _leave(self, made: list[Path]) -> None:
        """Back into the parents, and the slot removed (a failed settle only)."""
        for slot in made:
            with contextlib.suppress(OSError):
                write_control(slot.parent / "tasks", "0\n")
            with contextlib.suppress(OSError):
                slot.rmdir()

    def _report(self, future: asyncio.Future[Any], outcome: object) -> None:
        def settle() -> None:
            if future.done():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(settle)


class Nursery:
    """A few workers settled in fresh cgroups below ``parents``, replaced as turns take them."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, parents: Sequence[Path], idle: int = IDLE_WORKERS
    ) -> None:
        self._loop = loop
        self._parents = tuple(parents)
        self._idle: list[Worker] = []
        self._closed = False
        for _ in range(idle):
            self._idle.append(Worker(loop, self._parents))

    def ready(self) -> int:
        """Workers settled in their slots and waiting for a turn."""
        return sum(1 for w in self._idle if w.is_settled)

    def take(self) -> Worker | None:
        """A worker already in its slot, or None; another settles once this one has started.

        Not at once: a thread settling takes the cgroup hierarchy's lock, which
        the taken slot's rename and limits need first.
        """
        for worker in self._idle:
            if worker.is_settled:
                self._idle.remove(worker)
                worker.spawned.add_done_callback(lambda _: self._replace())
                return worker
        self._idle = [w for w in self._idle if not (w.settled.done() and not w.settled.result())]
        return None

    def _replace(self) -> None:
        if not self._closed:
            self._idle.append(Worker(self._loop, self._parents))

    def close(self) -> None:
        """End the waiting workers and remove their slots."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.discard()
        for worker in idle:
            worker.join(timeout=5)
            remove_when_empty(worker.dirs)


def _confine() -> None:
    """This thread, and the fence it starts, kept from the host's abstract unix sockets
    (``fence.landlock``), where the kernel can; a failure is said, and the turn goes on."""
    try:
        landlock.confine_thread()
    except OSError as exc:
        log.warning("a turn worker could not join its Landlock domain: %s", exc)


def _tell(step: Callable[..., None], *args: Any) -> None:
    """A watch's step; a failure in it is logged, and the process is still reaped."""
    try:
        step(*args)
    except Exception:
        log.exception("a turn worker's watch failed")


def send_away(worker: Slot, dirs: Sequence[Path] | None = None) -> None:
    """A taken slot not needed after all: what waits there ends, and its cgroups (``dirs``,
    the slot's if None) are removed (blocking, briefly)."""
    worker.discard()
    worker.join(1.0)
    remove_when_empty(worker.dirs if dirs is None else dirs)


def remove_when_empty(dirs: Sequence[Path]) -> list[Path]:
    """rmdir each of ``dirs``, retrying a little while one is still busy; those left."""
    left = list(dirs)
    for _ in range(REMOVE_TRIES):
        for path in list(left):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            left.remove(path)
        if not left:
            break
        threading.Event().wait(0.01)
    return left
