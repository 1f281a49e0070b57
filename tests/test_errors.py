"""Mapping httpx's failures onto the agent side's exceptions (agent_side.errors)."""

from __future__ import annotations

import ssl

import httpx
import pytest

from agent_side.errors import (
    AgentError,
    ConnectionDropped,
    ProtocolError,
    TargetUnreachable,
    TlsFailure,
    UsageError,
    map_transport_error,
    ssl_cause,
)


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


@pytest.mark.parametrize("exc_type", _all_subclasses(httpx.HTTPError), ids=lambda c: c.__name__)
def test_every_httpx_error_maps_to_an_agent_error(exc_type: type[httpx.HTTPError]) -> None:
    if issubclass(exc_type, httpx.HTTPStatusError):
        request = httpx.Request("GET", "https://t/")
        exc: httpx.HTTPError = exc_type(
            "x", request=request, response=httpx.Response(500, request=request)
        )
    else:
        exc = exc_type("boom")
    mapped = map_transport_error(exc, "https://t/v1/x")
    assert isinstance(mapped, AgentError)
    assert type(mapped) is not AgentError


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectError("refused"), TargetUnreachable),
        (httpx.ConnectTimeout("slow"), TargetUnreachable),
        (httpx.ReadError("reset"), ConnectionDropped),
        (httpx.ReadTimeout("quiet"), ConnectionDropped),
        (httpx.RemoteProtocolError("incomplete body"), ConnectionDropped),
        (httpx.UnsupportedProtocol("ftp"), UsageError),
        (httpx.DecodingError("gzip"), ProtocolError),
    ],
)
def test_httpx_errors_map_by_meaning(exc: httpx.HTTPError, expected: type) -> None:
    assert type(map_transport_error(exc, "https://t/v1/x")) is expected


def test_connect_error_caused_by_ssl_is_a_tls_failure() -> None:
    try:
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed")
        except ssl.SSLError as inner:
            raise httpx.ConnectError("handshake") from inner
    except httpx.ConnectError as exc:
        mapped = map_transport_error(exc, "https://t/v1/x")
        assert isinstance(ssl_cause(exc), ssl.SSLCertVerificationError)
    assert isinstance(mapped, TlsFailure)
    assert "--cacert / PADDOCK_CACERT" in str(mapped)


def test_ssl_cause_is_none_without_a_tls_error() -> None:
    assert ssl_cause(httpx.ConnectError("refused")) is None
