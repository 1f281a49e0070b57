"""One verified SSH connection to a target host, re-established when it drops.

    Destination.parse("user@host:2222")      what the user typed
    resolve(destination, options) -> Endpoint  after ~/.ssh/config (HostName, Port, User,
                                               IdentityFile)
    SshConnection(endpoint, options)         owns one paramiko.SSHClient at a time and opens
                                               direct-tcpip channels on it

Trust is OpenSSH's: the server's host key must already be in a known_hosts file
(``~/.ssh/known_hosts``, ``/etc/ssh/ssh_known_hosts``, and any given with
``--known-hosts``), read as OpenSSH reads them (``agent_side.known_hosts``).
An unknown host is refused with the command that adds it; a changed key, or
one marked ``@revoked``, is refused loudly. Nothing is ever added to known_hosts.

Keys are offered in this order: identity files that need no passphrase (``-i``,
else ``IdentityFile`` from ~/.ssh/config, else ``~/.ssh/id_*``), then the SSH
agent's keys, then passphrase-protected identity files, whose passphrase is
asked for only then. The key that worked is kept in memory, so reconnecting
never asks again.

Every paramiko and socket failure leaves this module as an ``AgentError``.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import paramiko
from paramiko.auth_strategy import (
    AuthFailure,
    AuthSource,
    AuthStrategy,
    InMemoryPrivateKey,
    PrivateKey,
    SourceResult,
)

from agent_side.errors import (
    AgentError,
    HostKeyChanged,
    HostKeyRevoked,
    HostKeyUnknown,
    SshAuthFailed,
    SshFailure,
    SshUnreachable,
    TargetUnreachable,
    UsageError,
)
from agent_side.known_hosts import KnownHosts

DEFAULT_PORT = 22
USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
USER_SSH_CONFIG = "~/.ssh/config"
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")

WINDOW_SIZE = 8 * 1024 * 1024
"""Receive window of each channel, chosen by measurement; throughput is at most window / RTT.

On loopback a turn's event stream through the tunnel runs at 31-37 MiB/s with
2 or 8 MiB windows and about 20 with 16 MiB (bench/, throughput section); the
target's event pipeline, not SSH, is the bound there. Raw channel
throughput in MB/s, 64 KiB packets, to a real sshd on a loaded 2-core machine;
RTT added by a delaying proxy; a cell is the range of separate runs, each the
median of three transfers:

    window   loopback   20 ms RTT   50 ms RTT
     2 MiB   105-181     66          36
     4 MiB   142-150     80-115      65
     8 MiB    93-148     75-101      92-96
    16 MiB    85-108    162          110-127

8 MiB keeps the tunnel ahead of the event stream up to ~300 ms RTT. Larger
windows lose on short links: paramiko moves a channel's whole unread buffer on
each read, and a fast sender keeps up to a window of it buffered per channel.
"""
MAX_PACKET_SIZE = 64 * 1024
"""Largest data packet the server may send us. 32 KiB (OpenSSH's default) was up
to 2x slower with windows of 8 MiB and more; 128 KiB gained nothing over 64 KiB."""

REMOTE_FILE_LIMIT = 1 << 20
"""The most ``read_file`` takes from the SSH host: a CA certificate is a few KiB."""

# paramiko logs what it then raises (``Secsh channel 0 open FAILED: ...``), and with
# no logging configured Python prints those records on stderr. Every failure reaches
# the caller as an ``AgentError`` instead; an application that configures logging
# still receives them through the root logger.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

PassphraseSource = Callable[[str], str | None]
"""Given a key file's path, its passphrase, or None when there is none to give."""


@dataclass(frozen=True)
class SshTimeouts:
    """Every wait in setting up and using the connection is bounded (seconds)."""

    connect: float = 10.0
    """TCP connect, and the key exchange after it."""
    banner: float = 10.0
    """The server's ``SSH-2.0-...`` greeting."""
    auth: float = 15.0
    """Each authentication attempt."""
    channel: float = 10.0
    """Opening a channel to the target's listener."""
    keepalive: float = 15.0
    """A keepalive request goes out after this much silence, so NATs keep the flow."""
    dead_link: float = 45.0
    """Unacknowledged data for this long closes the connection (TCP_USER_TIMEOUT)."""


@dataclass(frozen=True)
class SshOptions:
    """How to reach and trust an SSH server; explicit values beat ~/.ssh/config."""

    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    """Files checked besides ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts."""
    ssh_config: str | None = USER_SSH_CONFIG
    use_agent: bool = True
    passphrase: PassphraseSource | None = field(default=None, repr=False)
    timeouts: SshTimeouts = SshTimeouts()
    window_size: int = WINDOW_SIZE
    max_packet_size: int = MAX_PACKET_SIZE


@dataclass(frozen=True)
class Destination:
    """``[USER@]HOST[:PORT]`` as given; HOST may be an alias from ~/.ssh/config."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Destination:
        """Parse ``[ssh://][USER@]HOST[:PORT]``; an IPv6 address with a port goes in brackets."""
        rest = text.removeprefix("ssh://")
        user, at, hostport = rest.rpartition("@")
        if at and not user:
            raise UsageError(f"--ssh {text!r}: the user before '@' is empty")
        host, port = _split_host_port(hostport, text)
        if not host or host.startswith("-") or any(c.isspace() or c in "/@" for c in host):
            raise UsageError(f"--ssh {text!r} is not [USER@]HOST[:PORT]")
        return cls(host=host, user=user or None, port=port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        where = host if self.port is None else f"{host}:{self.port}"
        return where if self.user is None else f"{self.user}@{where}"


def _split_host_port(hostport: str, text: str) -> tuple[str, int | None]:
    if hostport.startswith("["):
        host, bracket, tail = hostport[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise UsageError(f"--ssh {text!r}: write an IPv6 address as [ADDR]:PORT")
        return host, _port(tail[1:], text) if tail else None
    if hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
        return host, _port(port, text)
    return hostport, None  # a bare IPv6 address has several colons and no port


def _port(text: str, whole: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        raise UsageError(f"--ssh {whole!r}: the port must be a number in 1..65535")
    return int(text)


@dataclass(frozen=True)
class Endpoint:
    """Where to connect and as whom, once ~/.ssh/config has been applied."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts files use for this server (``[host]:port`` off port 22)."""
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"

    def __str__(self) -> str:
        return f"{self.user}@{self.known_hosts_name}"


def resolve(destination: Destination, options: SshOptions) -> Endpoint:
    """Apply ~/.ssh/config to ``destination``: what the user typed wins over the file."""
    found = _ssh_config(options.ssh_config).lookup(destination.host)
    port = destination.port or _config_port(found.get("port"), options.ssh_config)
    identities = options.identity_files or tuple(found.get("identityfile", ()))
    for path in options.identity_files:
        if not os.path.isfile(os.path.expanduser(path)):
            raise UsageError(f"-i {path}: no such key file")
    return Endpoint(
        alias=destination.host,
        hostname=found.get("hostname", destination.host),
        port=port,
        user=destination.user or found.get("user") or getpass.getuser(),
        identity_files=tuple(os.path.expanduser(p) for p in identities),
    )


def _ssh_config(path: str | None) -> paramiko.SSHConfig:
    if path is None:
        return paramiko.SSHConfig()
    expanded = os.path.expanduser(path)
    if not os.path.exists(expanded):
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(expanded)
    except (OSError, paramiko.ConfigParseError, ValueError) as exc:
        raise UsageError(f"cannot read SSH config {expanded}: {exc}") from exc


def _config_port(value: str | None, source: str | None) -> int:
    if value is None:
        return DEFAULT_PORT
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise UsageError(f"{source}: Port {value!r} is not a number in 1..65535")
    return int(value)


# -- host keys ------------------------------------------------------------------------


def known_hosts_files(options: SshOptions) -> list[str]:
    """The known_hosts files to check: the user's, the system's, then each one given."""
    defaults = [os.path.expanduser(USER_KNOWN_HOSTS), SYSTEM_KNOWN_HOSTS]
    given = [os.path.expanduser(p) for p in options.known_hosts]
    for path in given:
        if not os.path.isfile(path):
            raise UsageError(f"--known-hosts {path}: no such file")
    return [p for p in defaults if os.path.isfile(p)] + given


class _RefuseUnknownHost(paramiko.RejectPolicy):
    """Reject, like ``RejectPolicy``, with a message that says how to add the host, or that
    its key was revoked (a revoked key is never trusted, so it always arrives here)."""

    def __init__(self, endpoint: Endpoint, files: Sequence[str], known: KnownHosts) -> None:
        self._endpoint = endpoint
        self._files = list(files)
        self._known = known

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        endpoint = self._endpoint
        kind = key.get_name()
        revoked = _revoked(self._known, hostname, key)
        if revoked is not None:
            raise revoked
        port = "" if endpoint.port == DEFAULT_PORT else f"-p {endpoint.port} "
        checked = ", ".join(self._files) or "none exist"
        authorities = ""
        if self._known.authorities:
            authorities = (
                f" ({', '.join(dict.fromkeys(self._known.authorities))} trusts hosts by "
                "@cert-authority, but paddock does not check host certificates: it needs "
                "the host's own key)"
            )
        raise HostKeyUnknown(
            f"{hostname} is not a known host (known_hosts files checked: {checked}){authorities}; "
            f"it offered the {kind} key {key.fingerprint}. Compare that fingerprint with "
            f"`ssh-keygen -lf {_host_key_file(kind)}` run on the target, then add it: "
            f"ssh-keyscan {port}-t {kind} {endpoint.hostname} >> ~/.ssh/known_hosts "
            "(or append to a file given with --known-hosts)"
        )


def _revoked(known: KnownHosts, hostname: str, key: paramiko.PKey) -> HostKeyRevoked | None:
    """The refusal of ``key`` if a known_hosts file revoked it (whatever else it lists)."""
    revoked_in = known.revoked_by(key)
    if revoked_in is None:
        return None
    return HostKeyRevoked(
        f"{hostname} offered the {key.get_name()} key {key.fingerprint}, which {revoked_in} "
        "marks @revoked; refusing to connect. Someone may be intercepting the "
        "connection, or the host still has a key it should have replaced"
    )


def _host_key_file(key_type: str) -> str:
    """Where OpenSSH keeps the host's public key of ``key_type``, to read its fingerprint."""
    kind = next((k for k in ("ed25519", "ecdsa", "rsa") if k in key_type), "*")
    return f"/etc/ssh/ssh_host_{kind}_key.pub"


def _changed_key(
    endpoint: Endpoint, files: Sequence[str], exc: paramiko.BadHostKeyException
) -> HostKeyChanged:
    name = endpoint.known_hosts_name
    return HostKeyChanged(
        f"the host key of {name} has CHANGED: known_hosts ({', '.join(files)}) holds "
        f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the server offered "
        f"{exc.key.get_name()} {exc.key.fingerprint}. Someone may be intercepting the "
        "connection, or the host was reinstalled; refusing to connect. If you know why it "
        f"changed, check the new fingerprint on the target, remove the old entry "
        f"(ssh-keygen -R '{name}' -f FILE) and add the new one"
    )


# -- authentication -------------------------------------------------------------------


class _LockedKeyFile(PrivateKey):
    """A passphrase-protected key file, decrypted only when its turn to be offered comes."""

    def __init__(self, username: str, path: str, passphrase: PassphraseSource | None) -> None:
        super().__init__(username=username)
        self.path = path
        self._passphrase = passphrase

    def __repr__(self) -> str:
        return str(self._repr(path=self.path))  # never the passphrase

    def authenticate(self, transport: paramiko.Transport) -> list[str]:
        secret = self._passphrase(self.path) if self._passphrase is not None else None
        if secret is None:
            raise paramiko.PasswordRequiredException(
                f"{self.path} needs a passphrase and none was given (load it into the "
                "agent with ssh-add, or set PADDOCK_SSH_PASSPHRASE; from Python, passphrase=)"
            )
        try:
            self.pkey = paramiko.PKey.from_path(self.path, secret.encode())
        except (paramiko.SSHException, ValueError) as exc:
            raise paramiko.AuthenticationException(
                f"{self.path}: the passphrase does not unlock it"
            ) from exc
        result: list[str] = super().authenticate(transport)
        return result


class _KeyFile(PrivateKey):
    def __init__(self, username: str, path: str, pkey: paramiko.PKey) -> None:
        super().__init__(username=username)
        self.path = path
        self.pkey = pkey

    def __repr__(self) -> str:
        return str(self._repr(path=self.path))


class _Keys(AuthStrategy):
    """Offers keys in the order this module's docstring gives, each at most once."""

    def __init__(
        self,
        endpoint: Endpoint,
        options: SshOptions,
        proven: paramiko.PKey | None,
        agent: paramiko.Agent | None,
    ) -> None:
        super().__init__(ssh_config=None)
        self._endpoint = endpoint
        self._options = options
        self._proven = proven
        self._agent = agent
        self.unusable: list[str] = []
        """Key files that could not be offered at all, and why."""

    def get_sources(self) -> Iterator[AuthSource]:
        user = self._endpoint.user
        if self._proven is not None:
            yield InMemoryPrivateKey(user, self._proven)  # reconnecting: it worked before
        locked: list[str] = []
        for path in self._identity_files():
            try:
                yield _KeyFile(user, path, paramiko.PKey.from_path(path))
            except (paramiko.PasswordRequiredException, TypeError):
                # cryptography says TypeError for an OpenSSH-format key that needs a passphrase.
                locked.append(path)
            except (OSError, paramiko.SSHException, ValueError) as exc:
                self.unusable.append(f"{path} ({exc})")
        if self._agent is not None:
            for key in self._agent.get_keys():
                yield InMemoryPrivateKey(user, key)
        for path in locked:
            yield _LockedKeyFile(user, path, self._options.passphrase)

    def _identity_files(self) -> list[str]:
        if self._endpoint.identity_files:
            return [p for p in self._endpoint.identity_files if os.path.isfile(p)]
        defaults = (os.path.expanduser(p) for p in DEFAULT_IDENTITIES)
        return [p for p in defaults if os.path.isfile(p)]


def _auth_failed(
    endpoint: Endpoint, keys: _Keys, exc: paramiko.AuthenticationException
) -> SshAuthFailed:
    results: list[SourceResult] = list(exc.result) if isinstance(exc, AuthFailure) else []
    tried = [f"{_described(r.source)}: {r.result}" for r in results]
    tried += [f"{bad}: unreadable" for bad in keys.unusable]
    if not tried:
        return SshAuthFailed(
            f"{endpoint}: no key to offer; give -i KEY, add a key to ssh-agent, "
            "or create ~/.ssh/id_ed25519"
        )
    return SshAuthFailed(
        f"{endpoint} accepted none of the keys offered ({'; '.join(tried)}); check the public "
        f"key is in ~{endpoint.user}/.ssh/authorized_keys on the target, or name the right "
        "one with -i KEY"
    )


def _described(source: AuthSource) -> str:
    path = getattr(source, "path", None)
    if path is not None:
        return str(path)
    pkey = getattr(source, "pkey", None)
    if isinstance(pkey, paramiko.AgentKey):
        return f"agent key {pkey.fingerprint}"
    return "the key that worked before"


# -- the connection -------------------------------------------------------------------


class SshConnection:
    """One paramiko ``SSHClient`` to the target host, shared by every channel.

    ``open_channel`` reconnects when the connection has dropped, waiting
    between failed attempts (doubling from ``first_delay_s``, capped), so a
    stream resuming after a drop finds the link re-established underneath.
    Thread-safe: the Ctrl-C forwarder opens channels beside the event stream.
    """

    first_delay_s = 0.2
    max_delay_s = 5.0

    def __init__(self, endpoint: Endpoint, options: SshOptions) -> None:
        self.endpoint = endpoint
        self._options = options
        self._known_hosts = known_hosts_files(options)
        self._lock = threading.Lock()
        self._client: paramiko.SSHClient | None = None
        self._proven_key: paramiko.PKey | None = None
        self._failures = 0
        self._last_failure = 0.0
        self._closed = False
        self.connects = 0
        """How many SSH connections were established (1, plus one per reconnect)."""

    def __repr__(self) -> str:
        return f"SshConnection({str(self.endpoint)!r}, connects={self.connects})"

    def connect(self) -> None:
        """Make sure the connection is up; raises the reason when it cannot be."""
        self._transport()

    def open_channel(self, host: str, port: int, timeout: float | None = None) -> paramiko.Channel:
        """A ``direct-tcpip`` channel to ``host:port`` as seen from the SSH server."""
        limit = timeout if timeout is not None else self._options.timeouts.channel
        transport = self._transport()
        try:
            return self._open(transport, host, port, limit)
        except SshUnreachable:
            # A link that died silently still looks active until a channel cannot open.
            self._discard(transport)
            return self._open(self._transport(), host, port, limit)

    def close(self) -> None:
        """Close the connection and every channel on it; no reconnecting after this."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def drop(self) -> None:
        """Close the current connection as a network failure would; the next use reconnects."""
        with self._lock:
            client = self._client
        if client is not None:
            self._discard(client.get_transport())

    def _open(
        self, transport: paramiko.Transport, host: str, port: int, timeout: float
    ) -> paramiko.Channel:
        options = self._options
        try:
            return transport.open_channel(
                "direct-tcpip",
                (host, port),
                ("127.0.0.1", 0),
                window_size=options.window_size,
                max_packet_size=options.max_packet_size,
                timeout=timeout,
            )
        except paramiko.ChannelException as exc:
            raise _channel_refused(self.endpoint, host, port, exc) from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise SshUnreachable(
                f"could not open a channel through {self.endpoint} ({exc or type(exc).__name__})"
            ) from exc

    def transport(self) -> paramiko.Transport:
        """The live, verified transport (reconnecting if it died), for sessions such as SFTP."""
        return self._transport()

    def read_file(self, path: str, limit: int = REMOTE_FILE_LIMIT) -> bytes | None:
        """The bytes of ``path`` on the SSH host, read over SFTP; None if it does not exist."""
        try:
            sftp = paramiko.SFTPClient.from_transport(self._transport())
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise SshFailure(f"{self.endpoint} offers no SFTP session ({exc})") from exc
        if sftp is None:
            raise SshFailure(f"{self.endpoint} offers no SFTP session")
        with sftp:
            try:
                with sftp.open(path, "rb") as remote:
                    data: bytes = remote.read(limit + 1)
            except FileNotFoundError:
                return None
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise SshFailure(f"cannot read {path} on {self.endpoint}: {exc}") from exc
        if len(data) > limit:
            raise SshFailure(f"{path} on {self.endpoint} is larger than {limit} bytes")
        return data

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._closed:
                raise RuntimeError("this SSH connection is closed; make a new one")
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return transport
                self._client.close()
                self._client = None
            self._wait_before_retry()
            try:
                self._client = self._connect()
            except AgentError:
                self._failures += 1
                self._last_failure = time.monotonic()
                raise
            self._failures = 0
            self.connects += 1
            transport = self._client.get_transport()
            if transport is None:  # connect() returned, so paramiko holds a transport
                raise SshUnreachable(f"{self.endpoint}: the connection closed at once")
            return transport

    def _wait_before_retry(self) -> None:
        if not self._failures:
            return
        delay = min(self.first_delay_s * 2 ** (self._failures - 1), self.max_delay_s)
        remaining = self._last_failure + delay - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def _discard(self, transport: paramiko.Transport | None) -> None:
        with self._lock:
            if self._client is not None and self._client.get_transport() is transport:
                self._client.close()
                self._client = None

    def _connect(self) -> paramiko.SSHClient:
        endpoint, options = self.endpoint, self._options
        timeouts = options.timeouts
        known = _read_known_hosts(self._known_hosts)
        sock = _tcp_connect(endpoint, timeouts)
        client = paramiko.SSHClient()
        known.trust(client, endpoint.known_hosts_name)
        client.set_missing_host_key_policy(_RefuseUnknownHost(endpoint, self._known_hosts, known))
        with _agent(options.use_agent) as agent:
            keys = _Keys(endpoint, options, self._proven_key, agent)
            try:
                # With an auth_strategy, connect() returns what each key offered came to.
                result = client.connect(
                    endpoint.hostname,
                    endpoint.port,
                    username=endpoint.user,
                    sock=sock,
                    timeout=timeouts.connect,
                    banner_timeout=timeouts.banner,
                    auth_timeout=timeouts.auth,
                    channel_timeout=timeouts.channel,
                    transport_factory=functools.partial(
                        paramiko.Transport,
                        default_window_size=options.window_size,
                        default_max_packet_size=options.max_packet_size,
                    ),
                    auth_strategy=keys,
                )
            except Exception as exc:
                client.close()
                sock.close()
                mapped = self._mapped(exc, keys, known)
                if mapped is exc:
                    raise
                raise mapped from exc
            except BaseException:
                client.close()
                sock.close()
                raise
        self._remember(result)
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(max(1, round(timeouts.keepalive)))
        return client

    def _remember(self, result: Sequence[SourceResult]) -> None:
        # The last key offered is the one that worked. An agent key stays in the agent.
        pkey = getattr(result[-1].source, "pkey", None) if result else None
        if isinstance(pkey, paramiko.PKey) and not isinstance(pkey, paramiko.AgentKey):
            self._proven_key = pkey

    def _mapped(self, exc: Exception, keys: _Keys, known: KnownHosts) -> Exception:
        endpoint = self.endpoint
        if isinstance(exc, paramiko.BadHostKeyException):
            # Another key of its type is listed: if the one offered is revoked, say that.
            revoked = _revoked(known, endpoint.known_hosts_name, exc.key)
            return revoked or _changed_key(endpoint, self._known_hosts, exc)
        if isinstance(exc, paramiko.AuthenticationException):
            return _auth_failed(endpoint, keys, exc)
        if isinstance(exc, paramiko.SSHException | EOFError | OSError):
            return SshUnreachable(
                f"the SSH handshake with {endpoint} failed ({exc or type(exc).__name__}); "
                "check that an SSH server answers there"
            )
        return exc  # an AgentError raised on purpose (unknown host), or a bug: as it is


class _QuickAckSocket(socket.socket):
    """A TCP socket that acknowledges every read at once.

    sshd forwards without TCP_NODELAY, and the target writes a response's
    headers and body separately: sshd then holds the body until its first
    piece is acknowledged, and a delayed ACK costs ~40 ms per exchange. Linux
    clears TCP_QUICKACK after use, so it is set again after every read.
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        with contextlib.suppress(OSError):
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return data


def _tcp_connect(endpoint: Endpoint, timeouts: SshTimeouts) -> socket.socket:
    host, where = endpoint.hostname, f"{endpoint.hostname}:{endpoint.port}"
    try:
        sock = socket.create_connection((host, endpoint.port), timeouts.connect)
    except socket.gaierror as exc:
        raise SshUnreachable(f"cannot resolve SSH host {host}: {exc.strerror}") from exc
    except TimeoutError as exc:
        raise SshUnreachable(f"no answer from {where} within {timeouts.connect:g} s") from exc
    except OSError as exc:
        raise SshUnreachable(f"cannot connect to SSH server {where}: {exc.strerror}") from exc
    if hasattr(socket, "TCP_QUICKACK"):
        sock = _QuickAckSocket(fileno=sock.detach())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small HTTP requests go at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        # Keepalives alone never fail: without this a dead link holds for ~15 minutes.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeouts.dead_link * 1000))
    return sock


def _read_known_hosts(paths: Sequence[str]) -> KnownHosts:
    # Read at every connection: a key added or revoked since counts at the next one.
    try:
        return KnownHosts.read(paths)
    except OSError as exc:
        raise UsageError(f"cannot read known_hosts file {exc.filename}: {exc.strerror}") from exc


@contextlib.contextmanager
def _agent(wanted: bool) -> Iterator[paramiko.Agent | None]:
    if not wanted or not os.environ.get("SSH_AUTH_SOCK"):
        yield None
        return
    try:
        agent = paramiko.Agent()
    except paramiko.SSHException:
        yield None  # a stale SSH_AUTH_SOCK: go on with the key files
        return
    try:
        yield agent
    finally:
        agent.close()


def _channel_refused(
    endpoint: Endpoint, host: str, port: int, exc: paramiko.ChannelException
) -> AgentError:
    if exc.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
        return TargetUnreachable(
            f"{endpoint} could not connect to {host}:{port} ({exc.text}); check paddock-target "
            "runs there and --target names its listener as seen from that host"
        )
    if exc.code == paramiko.common.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED:
        return SshFailure(
            f"{endpoint} refused to forward to {host}:{port} ({exc.text}); its sshd_config "
            "must allow it (AllowTcpForwarding yes, or local, for this user)"
        )
    return SshFailure(f"{endpoint} refused a channel to {host}:{port}: {exc.text} ({exc.code})")


def interactive_passphrase(path: str) -> str | None:
    """Ask on the terminal for ``path``'s passphrase; None when not run from a terminal.

    Only when stdin is a terminal too: a job whose controlling terminal is
    nobody's must fail with a message, not wait for an answer that never comes.
    """
    if sys.stdin is None or not sys.stdin.isatty():
        return None
    try:
        with open("/dev/tty", "rb"):
            pass
    except OSError:
        return None
    return getpass.getpass(f"Passphrase for key {path}: ")
