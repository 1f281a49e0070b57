"""Bearer tokens: each role holds the sha256 of its token; the token itself is never stored."""

from __future__ import annotations

import hashlib
import hmac

from target_side.config import Settings
from target_side.errors import AuthError, RoleNotHeld


def token_sha256(token: str) -> str:
    """The hex sha256 a role's config stores for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRoles:
    """Maps a presented bearer token to the roles whose hash it matches."""

    def __init__(self, settings: Settings) -> None:
        self._hashes = tuple((name, role.token_sha256) for name, role in settings.roles.items())

    def roles_for(self, authorization: str | None) -> frozenset[str]:
        """The roles ``authorization`` (an HTTP header value) holds; ``AuthError`` if none."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("send 'Authorization: Bearer <token>'")
        presented = token_sha256(token.strip())
        # Compare against every role, matched or not, so timing says nothing about which.
        held = [name for name, digest in self._hashes if hmac.compare_digest(presented, digest)]
        if not held:
            raise AuthError("the bearer token matches no role on this target")
        return frozenset(held)


def require_role(held: frozenset[str], role: str) -> None:
    """Raise ``RoleNotHeld`` unless ``role`` is among ``held``."""
    if role not in held:
        raise RoleNotHeld(f"this token does not hold role {role!r}")
