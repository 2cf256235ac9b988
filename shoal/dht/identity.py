"""A node's persistent identity: its libp2p key (peer id) and its RSA key for signing DHT records.

Both live under one path so a restarted node keeps its peer id *and* still owns its records.
hivemind's default RSA key is process-wide, which would make peers in one process one owner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from shoal.errors import UsageError


@dataclass(frozen=True)
class Identity:
    p2p_key_path: str | None  # None: an ephemeral libp2p identity
    signing_key: RSAPrivateKey


def _load_rsa(path: Path) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": path.read_bytes()})  # hivemind's own (DER) restore path
    return key


def load_identity(path: str | None) -> Identity:
    """Load the identity at `path` (creating it the first time), or a fresh one if `path` is None."""
    if path is None:
        return Identity(None, RSAPrivateKey())
    p2p_key = Path(path)
    rsa_path = p2p_key.with_name(p2p_key.name + ".rsa")
    if not p2p_key.parent.is_dir():
        raise UsageError(f"--identity: folder {str(p2p_key.parent)!r} does not exist")
    if rsa_path.exists():
        try:
            signing_key = _load_rsa(rsa_path)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--identity: {rsa_path} is not an RSA key ({e})") from None
    else:
        signing_key = RSAPrivateKey()
        tmp = rsa_path.with_name(f".{rsa_path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signing_key.to_bytes())
        os.replace(tmp, rsa_path)
    return Identity(str(p2p_key), signing_key)
