"""known_hosts files, read line by line as OpenSSH reads them, for paramiko to check against.

paramiko reads only plain lines (``HOSTS TYPE KEY``): a line with a marker
stops its reader with an exception, and a key marked ``@revoked`` would be
trusted wherever it is also listed plainly. So the lines are sorted here:

- a plain line is handed to paramiko, whose matching (hashed names too) decides;
  one with patterns (``*``, ``?``, ``!`` to exclude), which paramiko does not
  match, is matched here against the host being connected to, as OpenSSH
  matches it, and handed over under that host's name if it matches;
- ``@revoked HOSTS TYPE KEY``: that key is refused, for every host (OpenSSH
  looks at the line's hosts too; refusing a revoked key everywhere only ever
  refuses more), and it is not trusted by any other line;
- ``@cert-authority``: paddock does not check host certificates, so the line
  trusts nothing; it is remembered, to say so when a host is unknown;
- a line that is no key at all is passed over, as OpenSSH passes over it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"


@dataclass
class KnownHosts:
    """What a set of known_hosts files trusts and refuses."""

    entries: list[HostKeyEntry] = field(default_factory=list)
    """Plain lines: hosts and the key each is known by."""
    revoked: dict[bytes, str] = field(default_factory=dict)
    """Each revoked key, and the file that revoked it."""
    authorities: list[str] = field(default_factory=list)
    """The files with ``@cert-authority`` lines, which trust nothing here."""

    @classmethod
    def read(cls, paths: Iterable[str]) -> KnownHosts:
        """The files at ``paths`` (an ``OSError`` if one cannot be read)."""
        known = cls()
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    known._take(line.strip(), path)
        return known

    def trust(self, client: paramiko.SSHClient, host: str) -> None:
        """Make ``client`` trust every host key listed and not revoked, to connect to
        ``host`` (as known_hosts names it: ``[name]:port`` off port 22)."""
        keys = client.get_host_keys()
        for entry in self.entries:
            if self.revoked_by(entry.key) is not None:
                continue
            names = [n for n in entry.hostnames if not _is_pattern(n)]
            if len(names) < len(entry.hostnames) and _matches(entry.hostnames, host):
                names.append(host)
            for name in names:
                keys.add(name, entry.key.get_name(), entry.key)

    def revoked_by(self, key: paramiko.PKey) -> str | None:
        """The file that revoked ``key``, if one did."""
        return self.revoked.get(key.asbytes())

    def _take(self, line: str, path: str) -> None:
        if not line or line.startswith("#"):
            return
        fields = line.split()  # any run of blanks, as OpenSSH takes it; paramiko wants one
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if marker == CERT_AUTHORITY:
            self.authorities.append(path)
            return
        entry = _entry(" ".join(fields))
        if entry is None or marker not in (None, REVOKED):
            return  # not a key line, or a marker OpenSSH does not know either
        if marker == REVOKED:
            self.revoked.setdefault(entry.key.asbytes(), path)
        else:
            self.entries.append(entry)


def _is_pattern(name: str) -> bool:
    return name.startswith("!") or "*" in name or "?" in name


def _matches(patterns: list[str], host: str) -> bool:
    """Whether ``host`` is one a known_hosts line's host field names: a pattern (or name)
    matches it, and no ``!`` pattern does. Names compare without case."""
    matched = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if _pattern_regex(pattern.removeprefix("!")).fullmatch(host.lower()):
            if negated:
                return False
            matched = True
    return matched


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    # Only * and ? are special (not fnmatch's [ ]: "[host]:port" is a literal name).
    literal = re.escape(pattern.lower())
    return re.compile(literal.replace(r"\*", ".*").replace(r"\?", "."))


def _entry(line: str) -> HostKeyEntry | None:
    try:
        return HostKeyEntry.from_line(line)
    except (InvalidHostKey, paramiko.SSHException, ValueError):
        return None
