"""A peer's libp2p identity: an Ed25519 key on disk, and the public key inside a peer id.

hivemind writes a 2048-bit RSA key when asked to persist an identity; that gave restartable peers
long ``Qm...`` ids while every other peer had an ``12D3KooW...`` one. An Ed25519 peer id holds its
public key inline (an identity multihash), so anything a peer signs can be checked from its id
alone: records and requests are signed this way (see dedloc/auth).
"""

from __future__ import annotations

import functools
import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

_RAW = serialization.Encoding.Raw


def raw_public(key: ed25519.Ed25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, serialization.PublicFormat.Raw)


def raw_private(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def peer_id_of(key: ed25519.Ed25519PublicKey) -> str:
    """The libp2p peer id (base58) of an Ed25519 public key."""
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw_public(key)).SerializeToString()
    return PeerID(bytes([0, len(public)]) + public).to_base58()  # the identity multihash of the public key


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> ed25519.Ed25519PublicKey:
    """The Ed25519 public key inside ``peer_id``; ValueError for any other kind of id (an RSA ``Qm...``
    id hashes its key, so nothing it signs can be checked from the id). Remembers the 4096 most
    recent ids (records and DHT requests check the same few peers over and over)."""
    try:
        raw = PeerID.from_base58(peer_id).to_bytes()
    except Exception:
        raise ValueError(f"{peer_id!r} is not a peer id") from None
    if len(raw) < 2 or raw[0] != 0 or raw[1] != len(raw) - 2:
        raise ValueError(f"peer id {peer_id} does not hold its public key (not an Ed25519 identity)")
    public = crypto_pb2.PublicKey()
    try:
        public.ParseFromString(raw[2:])
    except Exception:
        raise ValueError(f"peer id {peer_id} holds a malformed public key") from None
    if public.key_type != crypto_pb2.KeyType.Ed25519 or len(public.data) != 32:
        raise ValueError(f"peer id {peer_id} is not an Ed25519 identity")
    return ed25519.Ed25519PublicKey.from_public_bytes(public.data)


def _blob(key: ed25519.Ed25519PrivateKey) -> bytes:
    raw = raw_private(key) + raw_public(key.public_key())
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw).SerializeToString()


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Write a secret file readable only by its owner (mode 0600); FileExistsError if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def create_identity(path: str | os.PathLike) -> str:
    """Write a fresh Ed25519 identity to ``path`` (mode 0600; FileExistsError if it exists); its peer id."""
    key = ed25519.Ed25519PrivateKey.generate()
    write_private(path, _blob(key))
    return peer_id_of(key.public_key())


def load_identity(path: str | os.PathLike) -> ed25519.Ed25519PrivateKey:
    """The Ed25519 key of an identity file; ValueError naming the file if it holds another kind."""
    with open(path, "rb") as f:
        blob = f.read()
    key = crypto_pb2.PrivateKey()
    try:
        key.ParseFromString(blob)
    except Exception:
        raise ValueError(f"identity file {path} is not a libp2p private key") from None
    if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) not in (32, 64):
        raise ValueError(f"identity file {path} is not an Ed25519 key (an old RSA identity? delete it and "
                         f"restart: the peer gets a new id, and an invite-only run needs a new invitation)")
    return ed25519.Ed25519PrivateKey.from_private_bytes(key.data[:32])
