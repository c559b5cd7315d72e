"""Invitations and revocations: short strings signed by the run owner's Ed25519 key.

An invitation binds one peer id to one run until an expiry. A revocation list names peers and when
they were revoked: it voids every invitation of that peer issued before then (the owner can invite
the same peer again later). Both verify from the owner's public key alone, so any peer can check
them and pass them on. Parsing is bounded: a string above ``MAX_TOKEN`` / ``MAX_REVOCATIONS``
characters is refused before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from dedloc.files import make_dir
from dedloc.errors import ConfigError, Unauthorized
from dedloc.files import write_atomically
from dedloc.auth.identity import raw_public, write_private

MAX_TOKEN = 1024
MAX_REVOCATIONS = 1 << 16
_INVITE = b"dedloc invitation v1\x00"
_REVOKE = b"dedloc revocations v1\x00"
_PREFIX, _REVOKED_PREFIX = "inv1", "rev1"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def owner_public_key(text: str) -> ed25519.Ed25519PublicKey:
    """The owner's public key from its printed form; ConfigError if malformed."""
    try:
        raw = unb64(text)
        if len(raw) != 32:
            raise ValueError
        return ed25519.Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error):
        raise ConfigError(f"invalid config: owner {text!r} is not an owner public key (43 base64url "
                          f"characters, as `dedloc run init` prints)") from None


def _sign(key: ed25519.Ed25519PrivateKey, domain: bytes, prefix: str, payload: dict) -> str:
    body = msgpack.packb(payload, use_bin_type=True)
    return f"{prefix}.{b64(body)}.{b64(key.sign(domain + body))}"


SIGNATURE_BYTES = 64
"""An Ed25519 signature's length."""


def _open(token: str, owner: ed25519.Ed25519PublicKey, domain: bytes, prefix: str, limit: int, what: str) -> dict:
    if not isinstance(token, str) or len(token) > limit:
        raise Unauthorized(f"{what} is not a string of at most {limit} characters")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != prefix:
        raise Unauthorized(f"{what} is malformed or incomplete (expected {prefix}.<payload>.<signature>)")
    try:
        body, signature = unb64(parts[1]), unb64(parts[2])
    except (ValueError, binascii.Error):
        raise Unauthorized(f"{what} is not base64url (was all of it copied?)") from None
    if len(signature) != SIGNATURE_BYTES:  # the end cut off when pasted, most often
        raise Unauthorized(f"{what} is incomplete: its signature has {len(signature)} of {SIGNATURE_BYTES} bytes "
                           f"(was all of it copied?)")
    try:
        owner.verify(signature, domain + body)
    except InvalidSignature:
        raise Unauthorized(f"{what} is not signed by this run's owner") from None
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:
        raise Unauthorized(f"{what} holds malformed data") from None
    if not isinstance(payload, dict):
        raise Unauthorized(f"{what} holds malformed data")
    return payload


@dataclass(frozen=True)
class Invitation:
    """One peer's admission to one run, until ``expires`` (unix seconds)."""

    run_id: str
    peer_id: str
    issued: float
    expires: float
    backbone: bool = False
    """The owner lets this peer act as a backbone: the checkpoint step it publishes counts as the
    run's (records.py ``CollaborationView.global_step``). A member without it that claims the role
    is not counted (service.py)."""

    START = _PREFIX + "."
    """How every invitation token begins."""

    @staticmethod
    def is_token(text: str) -> bool:
        """Whether ``text`` has an invitation token's form (else a config names a file holding one)."""
        return text.startswith(Invitation.START)

    @classmethod
    def verify(cls, token: str, owner: ed25519.Ed25519PublicKey, run_id: str, now: float | None = None) -> "Invitation":
        """The invitation ``token`` holds; Unauthorized naming why if it is forged, malformed, for
        another run, or expired."""
        p = _open(token, owner, _INVITE, _PREFIX, MAX_TOKEN, "the invitation")
        try:
            inv = cls(run_id=str(p["r"]), peer_id=str(p["p"]), issued=float(p["i"]), expires=float(p["e"]),
                      backbone=p.get("b", False) is True)
        except (KeyError, TypeError, ValueError):
            raise Unauthorized("the invitation holds malformed data") from None
        if inv.run_id != run_id:
            raise Unauthorized(f"the invitation is for run {inv.run_id!r}, not {run_id!r}")
        if inv.expires <= (time.time() if now is None else now):
            raise Unauthorized(f"the invitation of {inv.peer_id} expired at "
                               f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(inv.expires))}")
        return inv


@dataclass(frozen=True)
class Revocations:
    """Peers whose invitations issued before the given time are void. ``serial`` orders lists: a
    peer keeps the highest it has seen."""

    run_id: str
    serial: int
    revoked: dict[str, float]

    @classmethod
    def verify(cls, text: str, owner: ed25519.Ed25519PublicKey, run_id: str) -> "Revocations":
        p = _open(text, owner, _REVOKE, _REVOKED_PREFIX, MAX_REVOCATIONS, "the revocation list")
        try:
            rev = cls(run_id=str(p["r"]), serial=int(p["s"]), revoked={str(k): float(v) for k, v in dict(p["p"]).items()})
        except (KeyError, TypeError, ValueError):
            raise Unauthorized("the revocation list holds malformed data") from None
        if rev.run_id != run_id:
            raise Unauthorized(f"the revocation list is for run {rev.run_id!r}, not {run_id!r}")
        return rev

    def voids(self, inv: Invitation) -> bool:
        return inv.issued <= self.revoked.get(inv.peer_id, -1.0)


@dataclass(frozen=True)
class RunOwner:
    """The owner's side of an invite-only run: its key and the files `dedloc run init` writes in
    ``directory``: ``owner.key`` (secret, mode 0600), ``run.json`` (public: run id and owner key,
    for every peer) and ``revoked`` (the current signed revocation list, public)."""

    directory: str
    run_id: str
    key: ed25519.Ed25519PrivateKey

    @property
    def public(self) -> str:
        return b64(raw_public(self.key.public_key()))

    @classmethod
    def init(cls, directory: str, run_id: str) -> "RunOwner":
        make_dir(directory, "--dir")
        key = ed25519.Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        try:
            write_private(os.path.join(directory, "owner.key"), pem)
        except FileExistsError:
            raise ConfigError(f"{directory} already holds a run's owner key (owner.key); use another directory") from None
        owner = cls(directory, run_id, key)
        with open(os.path.join(directory, "run.json"), "w") as f:
            json.dump({"run_id": run_id, "owner": owner.public}, f, indent=1)
        owner._write_revocations({}, 0)
        return owner

    @classmethod
    def load(cls, directory: str) -> "RunOwner":
        try:
            with open(os.path.join(directory, "run.json")) as f:
                run_id = str(json.load(f)["run_id"])
            with open(os.path.join(directory, "owner.key"), "rb") as f:
                key = serialization.load_pem_private_key(f.read(), None)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{directory} is not a run directory made by `dedloc run init`: {e}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"{directory}/owner.key is not an Ed25519 key")
        return cls(directory, run_id, key)

    def invite(self, peer_id: str, expires_in: float, backbone: bool = False) -> str:
        """An invitation for ``peer_id``; ``backbone``: it may also act as the run's backbone."""
        now = time.time()
        return _sign(self.key, _INVITE, _PREFIX, {"r": self.run_id, "p": peer_id, "i": now, "e": now + expires_in,
                                                  **({"b": True} if backbone else {})})

    def revocations(self) -> Revocations:
        with open(os.path.join(self.directory, "revoked")) as f:
            return Revocations.verify(f.read().strip(), self.key.public_key(), self.run_id)

    def revoke(self, peer_id: str) -> Revocations:
        """Void every invitation of ``peer_id`` issued until now; writes and returns the new list."""
        current = self.revocations()
        self._write_revocations({**current.revoked, peer_id: time.time()}, current.serial + 1)
        return self.revocations()

    def _write_revocations(self, revoked: dict[str, float], serial: int) -> None:
        text = _sign(self.key, _REVOKE, _REVOKED_PREFIX, {"r": self.run_id, "s": serial, "p": revoked})
        write_atomically(os.path.join(self.directory, "revoked"), text + "\n")
