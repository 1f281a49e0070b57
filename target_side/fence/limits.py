"""Memory, pids and cpu limits for a turn: cgroups where the machine allows, rlimits otherwise.

Each turn gets its own cgroup *below the server's own* in every hierarchy that
carries a controller it needs: a cgroup v2 tree delegated to the server (the
``Delegate=yes`` of a systemd unit), or cgroup v1 hierarchies writable by the
server (root on a machine without systemd). Nested below the server, a turn
can never get more than the server itself was given.

All turns together sit in one parent, ``paddock-turns``, directly below the
server's cgroup: its memory and pids limits (``[server] memory_mb`` and
``pids``) bound the target's turns as a whole, however many run, each within
its own limits below. Servers started in one cgroup share one parent (and
its bounds: the last to start writes them); under systemd each has its own.

bubblewrap is started with ``--block-fd``: its sandbox process stops after
setting up the fence and before the command starts. The runner moves that
process into the turn's cgroups (``place``) and only then releases it, so
every process of the command is born inside the limits.

What each way really guarantees (also what ``GET /v1/health`` says):

- cgroup (v2 or v1), per turn: ``memory.max`` / ``memory.limit_in_bytes`` bound
  the memory of all the turn's processes together (swap too); at the bound the
  whole turn is killed (v2's ``memory.oom.group``; under v1, where the kernel
  kills one process, by the runner on the cgroup's OOM event); ``pids.max`` bounds how many
  processes and threads exist at once; ``cpu.max`` / ``cpu.cfs_quota_us``
  bound CPU time per period to ``cpu`` CPUs.
- rlimit fallback: ``RLIMIT_AS`` bounds each process's *address space*, not
  the turn's memory (N processes may use N times it, and programs that
  reserve large address ranges fail early). ``RLIMIT_NPROC`` counts every
  process of the real uid on the whole machine, not the turn's, and does
  nothing at all for root; so pids are left to the wall-time limit as root.
  cpu has no rlimit counterpart (``RLIMIT_CPU`` is total seconds, not a
  rate): wall time is the only bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shutil
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from shared.wire import PlannedLimits
from target_side.errors import LimitError
from target_side.fence.cgroupfs import (
    CONTROLLERS,
    TURN_CGROUP,
    TURN_PREFIX,
    V1_USAGE,
    CgroupMount,
    cgroup_mounts,
    memberships,
    read_control,
    under,
    v1_mount,
    v2_mount,
    words,
    write_control,
)
from target_side.fence.nursery import Nursery, Slot, Slots, send_away

log = logging.getLogger("paddock.target")

CPU_PERIOD_US = 100_000
TRUSTED_BIN_PATH = "/usr/bin:/bin"
SERVER_LEAF = "paddock-server"
"""On cgroup v2 the server moves itself here so its own cgroup may hand controllers down."""
TURNS_PARENT = "paddock-turns"
"""The parent of every turn cgroup, below the server's own: the bound on all turns together."""
REMOVE_TRIES = 100


@dataclass(frozen=True)
class Hierarchy:
    """One cgroup hierarchy the server may create turn cgroups in."""

    version: int
    base: Path
    """The server's own cgroup here."""
    controllers: frozenset[str]
    turns: Path | None = None
    """Where turn cgroups are made: the ``paddock-turns`` parent (``base`` itself if None)."""

    @property
    def turn_parent(self) -> Path:
        return self.base if self.turns is None else self.turns


@dataclass(frozen=True)
class Enforcement:
    """How one limit is enforced on this machine, and what falls short, if anything."""

    limit: str
    how: str
    degraded: str | None = None


@dataclass(frozen=True)
class Totals:
    """What all turns together may use: written on their parent cgroup (None: no bound)."""

    memory_mb: int | None = None
    pids: int | None = None


@dataclass
class Usage:
    """What a turn used, from its cgroups (None where no cgroup counted it)."""

    cpu_s: float | None = None
    max_rss_kb: int | None = None
    oom_kills: int = 0


class Limiter:
    """The limit machinery this machine allows, found once at startup."""

    def __init__(self, hierarchies: Iterable[Hierarchy], rlimits: bool = True) -> None:
        self.hierarchies = tuple(hierarchies)
        self.rlimits = rlimits
        self.nursery: Slots | None = None

    def start_nursery(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep workers settled in fresh turn cgroups (``fence.nursery``): cgroup v1 only."""
        if self.hierarchies and all(h.version == 1 for h in self.hierarchies):
            self.nursery = Nursery(loop, self.turn_parents())

    def keep_slots(self, slots: Slots) -> None:
        """Take turns' slots from ``slots`` (prepared by the launcher, for a server whose
        fences the launcher starts), instead of a nursery of the server's own threads."""
        self.nursery = slots

    def turn_parents(self) -> list[Path]:
        """Where each hierarchy's turn cgroups go, in the order a slot's ``dirs`` follow."""
        return [h.turn_parent for h in self.hierarchies]

    def close(self) -> None:
        """Stop the nursery (blocking, briefly): what waits in its slots ends, the slots go."""
        if self.nursery is not None:
            self.nursery.close()
            self.nursery = None

    @classmethod
    def detect(cls, proc: Path = Path("/proc/self"), totals: Totals | None = None) -> Limiter:
        """Find usable hierarchies from the server's own ``/proc/self/{cgroup,mountinfo}``.

        Each gets its ``paddock-turns`` parent, with ``totals`` written where
        the hierarchy carries the controller.
        """
        try:
            places = memberships((proc / "cgroup").read_text())
            mounts = cgroup_mounts((proc / "mountinfo").read_text())
        except OSError as exc:
            log.warning("cannot read the server's cgroups (%s); limits fall back to rlimits", exc)
            return cls(())
        found: list[Hierarchy] = []
        taken: set[str] = set()
        v2 = _v2_hierarchy(places, mounts)
        if v2 is not None:
            found.append(v2)
            taken |= v2.controllers
        for controller in (*CONTROLLERS, V1_USAGE):
            if controller in taken:
                continue
            v1 = _v1_hierarchy(controller, places, mounts)
            if v1 is not None and v1.base not in {h.base for h in found}:
                found.append(v1)
                taken |= v1.controllers
            elif v1 is not None:
                taken.add(controller)
        limiter = cls(found)
        limiter.reap_stale()
        limiter.hierarchies = tuple(_with_parent(h, totals or Totals()) for h in found)
        return limiter

    def controller(self, name: str) -> Hierarchy | None:
        return next((h for h in self.hierarchies if name in h.controllers), None)

    def report(self) -> list[Enforcement]:
        """How memory, pids and cpu are enforced here (wall time and output are always enforced)."""
        return [self._enforcement(name) for name in CONTROLLERS]

    def _enforcement(self, name: str) -> Enforcement:
        hierarchy = self.controller(name)
        if hierarchy is not None:
            return Enforcement(name, f"cgroup v{hierarchy.version} at {hierarchy.base}")
        if name == "memory" and self.rlimits:
            return Enforcement(
                name,
                "rlimit",
                "memory_mb limits each process's address space "
                "(RLIMIT_AS), not the turn's total: no usable memory cgroup",
            )
        if name == "pids" and self.rlimits:
            return Enforcement(
                name,
                "rlimit",
                "pids limits all processes of the role's uid "
                "(RLIMIT_NPROC), not each turn's: no usable pids cgroup",
            )
        what = {
            "pids": "pids (RLIMIT_NPROC does not bind root)",
            "cpu": "cpu",
            "memory": "memory_mb",
        }
        return Enforcement(
            name,
            "none",
            f"{what[name]} is not enforced: no usable {name} cgroup; only wall_s bounds the turn",
        )

    def degraded(self) -> str | None:
        """One sentence per limit that falls short of a per-turn cgroup, or None."""
        problems = [e.degraded for e in self.report() if e.degraded]
        return "; ".join(problems) or None

    def for_turn(self, turn_id: str, limits: PlannedLimits) -> TurnLimits:
        """Create ``turn_id``'s cgroups with ``limits`` written; nothing runs in them yet
        (event loop: a ready slot is taken where one is free)."""
        return self.make_for_turn(turn_id, limits, self.take_ready_slot())

    def take_ready_slot(self) -> Slot | None:
        """A slot of fresh cgroups ready for a turn's first process, if one is free (event
        loop only)."""
        return self.nursery.take() if self.nursery is not None else None

    def make_for_turn(
        self, turn_id: str, limits: PlannedLimits, slot: Slot | None = None
    ) -> TurnLimits:
        """``for_turn`` with the slot already taken, on any thread (blocking).

        With a slot, its cgroups become the turn's (renamed): what waits there (a
        settled thread, a prepared launch) then starts the turn's first process
        inside them. Without one, they are
        made. Turns planned together make theirs at once: the kernel serialises
        the operations itself, and queued behind a lock of the server's, each
        turn held it through a round of the interpreter lock per system call
        (the burst's turns were made one every 6 ms, the cgroups being the last
        step they queued for).
        """
        turn = TurnLimits(self, f"{TURN_PREFIX}{os.getpid()}-{turn_id}", limits, slot=slot)
        try:
            if slot is not None:
                turn.take_slot(slot)
            else:
                for hierarchy in self.hierarchies:
                    turn.create(hierarchy)
        except OSError as exc:
            turn.remove_now()
            raise LimitError(f"could not set up the turn's cgroups: {exc}") from exc
        return turn

    def reap_stale(self) -> None:
        """Remove empty turn cgroups left by a server that is gone.

        Turn cgroups carry their server's pid, so a server never removes one
        that another live server has just made and not yet filled. Looked for
        in the parent, and directly below the server's cgroup, where they were
        made before there was a parent.
        """
        for hierarchy in self.hierarchies:
            for place in (hierarchy.base, hierarchy.base / TURNS_PARENT):
                _reap_in(place)


def _reap_in(place: Path) -> None:
    with contextlib.suppress(OSError):
        for entry in place.iterdir():
            match = TURN_CGROUP.fullmatch(entry.name)
            if match and not _alive(int(match[1])) and entry.is_dir():
                with contextlib.suppress(OSError):
                    entry.rmdir()


def _with_parent(hierarchy: Hierarchy, totals: Totals) -> Hierarchy:
    """``hierarchy`` with turns going into its ``paddock-turns`` parent, bounded by ``totals``.

    Where the parent cannot be made, turns go directly below the server, as
    before: each still bounded by its own limits, the total only by the server's.
    """
    parent = hierarchy.base / TURNS_PARENT
    try:
        parent.mkdir(mode=0o755, exist_ok=True)
        for name, value in _total_settings(hierarchy, totals):
            _write(parent / name, value, optional=name in _OPTIONAL)
    except OSError as exc:
        log.warning(
            "cannot bound all turns together in %s (%s); turns go below %s",
            parent,
            exc,
            hierarchy.base,
        )
        return hierarchy
    return replace(hierarchy, turns=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class TurnLimits:
    """One turn's cgroups (and rlimits), from creation to removal."""

    limiter: Limiter
    name: str
    limits: PlannedLimits
    dirs: dict[Path, Hierarchy] = field(default_factory=dict)
    slot: Slot | None = None
    """What waits in these cgroups to start the turn's first process: a thread of the
    server's settled there, or a process the launcher forked into them."""
    oom_alarm: int | None = None
    """An eventfd the kernel signals when it OOM-kills in the turn's cgroup v1 memory
    cgroup, armed before anything runs there. v2 ends the whole turn by itself
    (``memory.oom.group``); v1 kills one process and lets the rest run on, so the
    turn's runner ends the turn when this fires, and v1 ends a turn as v2 does."""

    @property
    def born_inside(self) -> bool:
        """The worker starts the turn's first process: in these cgroups from its first
        instruction, it has nothing to wait for before its command runs (``fence.gate``)."""
        return self.slot is not None

    def create(self, hierarchy: Hierarchy) -> None:
        path = hierarchy.turn_parent / self.name
        path.mkdir(mode=0o755)
        self.dirs[path] = hierarchy
        self._write_limits(path, hierarchy)

    def take_slot(self, slot: Slot) -> None:
        """``slot``'s cgroups, with this turn's limits written: renamed for the turn under
        cgroup v1; under v2, which renames no cgroup (EPERM), they keep the slot's name."""
        for made, hierarchy in zip(slot.dirs, self.limiter.hierarchies, strict=True):
            path = made
            if hierarchy.version == 1:
                path = made.parent / self.name
                made.rename(path)
            self.dirs[path] = hierarchy
            self._write_limits(path, hierarchy)

    def _write_limits(self, path: Path, hierarchy: Hierarchy) -> None:
        # Tasks there that are not the turn's (``Slot.seats``): the turn has exactly its own.
        seats = self.slot.seats if self.slot is not None else 0
        for name, value in _settings(hierarchy, self.limits, seats):
            _write(path / name, value, optional=name in _OPTIONAL)
        if _v1_memory(hierarchy) and self.oom_alarm is None:
            self.oom_alarm = _oom_eventfd(path)

    def place(self, pid: int) -> None:
        """Put ``pid`` (bubblewrap's sandbox process, still blocked) into the turn's cgroups.

        Its children inherit the membership. Nothing to do for a process born inside.
        """
        if self.born_inside:
            return
        for path in self.dirs:
            write_control(path / "cgroup.procs", f"{pid}\n")

    def rlimit_prefix(self, uid: int) -> tuple[str, ...]:
        """A ``prlimit`` prefix for what no cgroup bounds, applied by the turn to itself.

        Lowering one's own limits needs no privilege, where setting another
        process's needs ``CAP_SYS_RESOURCE`` once it runs as another uid; so the
        turn's first process sets them before it becomes bubblewrap, and every
        process of the turn inherits them.
        """
        if not self.limiter.rlimits:
            return ()
        flags = []
        if self.limiter.controller("memory") is None:
            memory = self.limits.memory_mb << 20
            flags.append(f"--as={memory}:{memory}")
        if self.limiter.controller("pids") is None and uid != 0:
            # RLIMIT_NPROC counts every process of the uid: the role's turns together.
            flags.append(f"--nproc={self.limits.pids}:{self.limits.pids}")
        if not flags:
            return ()  # before the search: a stat per directory on every turn, for nothing
        prlimit = shutil.which("prlimit", path=TRUSTED_BIN_PATH)
        return () if prlimit is None else (prlimit, *flags, "--")

    def usage(self) -> Usage:
        """CPU seconds, peak memory and OOM kills, read before the cgroups go."""
        found = Usage()
        for path, hierarchy in self.dirs.items():
            _read_usage(path, hierarchy, found)
        return found

    def alarm_was_oom(self) -> bool:
        """Whether ``oom_alarm`` rang for an OOM kill: the kernel also rings it when the
        cgroup is removed (here, by someone else, while the turn starts), and then there
        is no cgroup left to read."""
        cgroup = next((p for p, h in self.dirs.items() if _v1_memory(h)), None)
        try:
            return cgroup is not None and bool(read_control(cgroup / "memory.oom_control"))
        except OSError:
            return False

    def close_oom_alarm(self) -> None:
        """Close ``oom_alarm`` (before the cgroup goes: its removal would signal it too)."""
        alarm, self.oom_alarm = self.oom_alarm, None
        if alarm is not None:
            os.close(alarm)

    def kill(self) -> None:
        """SIGKILL what is left in the turn's cgroups: the backstop to the pid-namespace kill."""
        for path, hierarchy in self.dirs.items():
            if hierarchy.version == 2 and _write(path / "cgroup.kill", "1", optional=True):
                continue
            for pid in _pids(path):
                _kill_member(pid, path)

    async def remove(self) -> None:
        """Kill any stragglers and remove the cgroups (a dying process keeps one busy briefly).

        On a thread: removing a memory cgroup the turn used takes the kernel 0.06 ms
        most times and several milliseconds one time in ten, which on the event loop
        held up every other turn's stream (a millisecond a turn, on average).
        """
        self.close_oom_alarm()
        slot = self.slot
        for _ in range(REMOVE_TRIES):
            if await asyncio.to_thread(self._removed_after, slot):
                return
            slot = None  # joined on the first try
            self.kill()
            await asyncio.sleep(0.05)
        log.warning("could not remove cgroups of %s: %s", self.name, ", ".join(map(str, self.dirs)))

    def remove_now(self) -> None:
        """Remove without waiting (nothing was ever placed in them but a worker, sent away)."""
        self.close_oom_alarm()
        if self.slot is not None:
            send_away(self.slot, list(self.dirs))
            self.dirs.clear()
            return
        self._try_remove()

    def _removed_after(self, slot: Slot | None) -> bool:
        """``_try_remove`` once ``worker`` has ended (blocking): it ends once it has reaped
        the turn's process, which takes it out of the cgroups."""
        if slot is not None:
            slot.join(1.0)
        return self._try_remove()

    def _try_remove(self) -> bool:
        for path in list(self.dirs):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("removing %s: %s", path, exc)
                continue
            del self.dirs[path]
        return not self.dirs


_OPTIONAL = {
    "memory.memsw.limit_in_bytes",
    "memory.swap.max",
    "memory.oom.group",
    "cgroup.subtree_control",
}
"""Absent where swap accounting is off or the kernel is older; the main limit still holds.
(A controller the parent cannot hand down fails the turn's own limit, loudly, instead.)"""


def _settings(hierarchy: Hierarchy, limits: PlannedLimits, seats: int = 0) -> list[tuple[str, str]]:
    memory = str(limits.memory_mb << 20)
    quota = str(max(1000, round(limits.cpu * CPU_PERIOD_US)))
    has = hierarchy.controllers
    if hierarchy.version == 2:
        return [
            *(
                [("memory.max", memory), ("memory.swap.max", "0"), ("memory.oom.group", "1")]
                if "memory" in has
                else []
            ),
            *([("pids.max", str(limits.pids + seats))] if "pids" in has else []),
            *([("cpu.max", f"{quota} {CPU_PERIOD_US}")] if "cpu" in has else []),
        ]
    return [
        # The memory limit first: the kernel refuses memory+swap below memory alone.
        *(
            [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)]
            if "memory" in has
            else []
        ),
        *([("pids.max", str(limits.pids + seats))] if "pids" in has else []),
        *(
            [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", quota)]
            if "cpu" in has
            else []
        ),
    ]


def _total_settings(hierarchy: Hierarchy, totals: Totals) -> list[tuple[str, str]]:
    """The parent's bounds, and (v2) the controllers it hands down to the turns below it."""
    has = hierarchy.controllers
    memory = None if totals.memory_mb is None else str(totals.memory_mb << 20)
    pids = None if totals.pids is None else str(totals.pids)
    found: list[tuple[str, str]] = []
    if hierarchy.version == 2:
        found += [("cgroup.subtree_control", f"+{name}") for name in sorted(has)]
        if "memory" in has and memory is not None:
            found += [("memory.max", memory), ("memory.swap.max", "0")]
        if "pids" in has and pids is not None:
            found.append(("pids.max", pids))
        return found
    if "memory" in has and memory is not None:
        # Unbounded swap first: the kernel refuses memory+swap below memory alone, and the
        # parent may hold lower values from a server before.
        found += [
            ("memory.memsw.limit_in_bytes", "-1"),
            ("memory.limit_in_bytes", memory),
            ("memory.memsw.limit_in_bytes", memory),
        ]
    if "pids" in has and pids is not None:
        found.append(("pids.max", pids))
    return found


def _v1_memory(hierarchy: Hierarchy) -> bool:
    """Whether ``hierarchy`` is cgroup v1's memory controller (where the OOM alarm is armed)."""
    return hierarchy.version == 1 and "memory" in hierarchy.controllers


def _oom_eventfd(path: Path) -> int | None:
    alarm = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        control = os.open(path / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        try:
            # The kernel keeps the eventfd from here; the control file only names the event.
            write_control(path / "cgroup.event_control", f"{alarm} {control}")
        finally:
            os.close(control)
    except OSError as exc:
        os.close(alarm)
        log.debug("no OOM alarm for %s: %s", path, exc)
        return None
    return alarm


def _read_usage(path: Path, hierarchy: Hierarchy, found: Usage) -> None:
    has = hierarchy.controllers
    if hierarchy.version == 2:
        stat = _keyed(path / "cpu.stat")
        if "usage_usec" in stat:
            found.cpu_s = stat["usage_usec"] / 1e6
        if "memory" in has:
            found.max_rss_kb = _int(path / "memory.peak", 1024)
            found.oom_kills += _keyed(path / "memory.events").get("oom_kill", 0)
        return
    if V1_USAGE in has:
        usage = _int(path / "cpuacct.usage", 1)
        found.cpu_s = None if usage is None else usage / 1e9
    if "memory" in has:
        found.max_rss_kb = _int(path / "memory.max_usage_in_bytes", 1024)
        found.oom_kills += _keyed(path / "memory.oom_control").get("oom_kill", 0)


def _write(path: Path, value: str, optional: bool = False) -> bool:
    try:
        write_control(path, value)
    except OSError:
        if optional:
            return False
        raise
    return True


def _int(path: Path, unit: int) -> int | None:
    try:
        return int(read_control(path).split()[0]) // unit
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in read_control(path).splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                found[key] = int(value)
    return found


def _pids(path: Path) -> list[int]:
    """The processes in a turn's cgroup: never the server, whose worker thread may be one."""
    try:
        listed = [int(p) for p in read_control(path / "cgroup.procs").split()]
    except (OSError, ValueError):
        return []
    return [pid for pid in listed if pid != os.getpid()]


def _kill_member(pid: int, cgroup: Path) -> None:
    # Through a pidfd, checked to still be in the cgroup: a recycled pid is never killed.
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if pid in _pids(cgroup):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


# --- detection -------------------------------------------------------------------------------


def _v1_hierarchy(
    controller: str, memberships: dict[str, str], mounts: list[CgroupMount]
) -> Hierarchy | None:
    path = memberships.get(controller)
    mount = v1_mount(mounts, controller)
    if path is None or mount is None:
        return None
    base = under(mount, path)
    if base is None or not _can_make_children(base):
        return None
    return Hierarchy(1, base, mount.controllers)


def _v2_hierarchy(memberships: dict[str, str], mounts: list[CgroupMount]) -> Hierarchy | None:
    path = memberships.get("")
    mount = v2_mount(mounts)
    if path is None or mount is None:
        return None
    own = under(mount, path)
    if own is None:
        return None
    base = own.parent if own.name == SERVER_LEAF else own
    available = set(words(base / "cgroup.controllers")) & set(CONTROLLERS)
    if not available or not _can_make_children(base):
        return None
    enabled = _delegate(base, own, available)
    return Hierarchy(2, base, frozenset(enabled)) if enabled else None


def _delegate(base: Path, own: Path, wanted: set[str]) -> set[str]:
    """Enable ``wanted`` for children of ``base``; the server first leaves for a leaf of its own.

    cgroup v2 hands controllers down only from a cgroup with no processes of
    its own, so the server moves itself (never anything else) into a leaf.
    """
    enabled = set(words(base / "cgroup.subtree_control"))
    if wanted <= enabled:
        return wanted
    if own == base:
        try:
            leaf = base / SERVER_LEAF
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as exc:
            log.warning("cannot move the server into %s/%s: %s", base, SERVER_LEAF, exc)
            return enabled & wanted
    for name in sorted(wanted - enabled):
        try:
            (base / "cgroup.subtree_control").write_text(f"+{name}\n")
            enabled.add(name)
        except OSError as exc:
            log.warning("cannot enable the %s controller in %s: %s", name, base, exc)
    return enabled & wanted


def _can_make_children(base: Path) -> bool:
    """A real probe (mkdir, rmdir), not ``access()``: a read-only or undelegated tree fails it."""
    probe = base / f"{TURN_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True
