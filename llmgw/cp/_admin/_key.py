"""The admin key: made once as a 0600 file in the state directory, read back, and checked
against a request's Bearer token (compared as digests, in constant time)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from llmgw.web.asgi import Scope

ADMIN_KEY_FILE = "admin.key"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def ensure_admin_key(state_dir: Path) -> tuple[Path, bool]:
    """Create the first admin key on first start: a 0600 file in the state directory.

    Returns the file and whether it was created now.
    """
    path = state_dir / ADMIN_KEY_FILE
    if path.exists():
        return path, False
    state_dir.mkdir(parents=True, exist_ok=True)
    key = "llmgw-admin-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path, True


def read_admin_key(path: Path) -> str:
    return path.read_text().strip()


def authorised(scope: Scope, key_digest: bytes) -> bool:
    """Whether the request carries `Authorization: Bearer <the admin key>`."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return hmac.compare_digest(digest(token.strip()), key_digest)
    return False
