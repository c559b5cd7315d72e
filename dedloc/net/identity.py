"""A peer's libp2p identity on disk: an Ed25519 key (the kind the p2p daemon makes for itself when it
is given none), created once and readable only by its owner.

hivemind writes a 2048-bit RSA key when asked to persist an identity; that gave restartable peers
long ``Qm...`` ids while every other peer had an ``12D3KooW...`` one. An Ed25519 peer id holds its
public key inline, so anything a peer signs can be checked from its id alone.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2


def create_identity(path: str | os.PathLike) -> str:
    """Write a fresh Ed25519 identity to ``path`` (mode 0600; FileExistsError if it exists); its peer id."""
    key = ed25519.Ed25519PrivateKey.generate()
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw + pub).SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=pub).SerializeToString()
    return PeerID(bytes([0, len(public)]) + public).to_base58()  # the identity multihash of the public key
