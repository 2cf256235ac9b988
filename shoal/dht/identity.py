"""A node's identity: one RSA key that is both its libp2p identity (peer id) and its DHT signing key.

Why one key. A DHT record is signed by the key in its `[owner:...]` subkey (hivemind's
RSASignatureValidator); a node record also names a `peer_id`, the libp2p identity others dial.
hivemind's libp2p identities are RSA keys (`P2P.generate_identity`), and a libp2p peer id is the
multihash of the public key (`sha2-256(protobuf PublicKey{RSA, DER SubjectPublicKeyInfo})`). So when
a node signs its records with its libp2p key, every validator can recompute the peer id from the
owner key alone and refuse a record that names anyone else: the binding needs no extra field, no
second signature and no trust in the record's content. The alternative (two keys plus a record
carrying the libp2p public key and its signature over the DHT key) needs the libp2p private key
anyway to make that signature, so it adds bytes and a check without adding any safety.

The key lives in the identity file, in hivemind's own format (a libp2p `PrivateKey` protobuf), so a
restarted node keeps its peer id *and* still owns its records. A fresh identity (no file) is written
to a private temporary file only while the libp2p daemon starts (see `SwarmDHT.create`).
Identity files of older versions load as they are; their `.rsa` sidecar is no longer read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from shoal.errors import UsageError
from shoal.files import atomic_write

_SHA2_256 = b"\x12\x20"  # multihash prefix: sha2-256, 32 bytes


@dataclass(frozen=True)
class Identity:
    signing_key: RSAPrivateKey  # also the libp2p key: the peer id is derived from it
    path: str | None  # the identity file; None: an ephemeral identity, never written
    created: bool  # written just now, so no running peer can be using it yet

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.signing_key.get_public_key().to_bytes())

    def libp2p_key(self) -> bytes:
        """The private key as the libp2p daemon reads it (what `P2P.generate_identity` writes)."""
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.signing_key.to_bytes())
        return key.SerializeToString()


@lru_cache(maxsize=4096)
def peer_id_of(ssh_public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in the OpenSSH form hivemind signs with."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256 + hashlib.sha256(encoded).digest()).to_base58()


def _rsa_from_der(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own (DER) restore path
    return key


def load_identity(path: str | None) -> Identity:
    """Load the identity at `path` (creating it the first time), or a fresh one if `path` is None."""
    if path is None:
        return Identity(RSAPrivateKey(), None, created=True)
    file = Path(path)
    if not file.parent.is_dir():
        raise UsageError(f"--identity: folder {str(file.parent)!r} does not exist")
    if file.exists():
        try:
            stored = crypto_pb2.PrivateKey.FromString(file.read_bytes())
            if stored.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError(f"key type {crypto_pb2.KeyType.Name(stored.key_type)}, not RSA")
            return Identity(_rsa_from_der(stored.data), str(file), created=False)
        except Exception as e:
            raise UsageError(f"--identity: {file} is not a libp2p RSA identity ({e})") from None
    identity = Identity(RSAPrivateKey(), str(file), created=True)
    atomic_write(file, identity.libp2p_key(), mode=0o600)
    return identity
