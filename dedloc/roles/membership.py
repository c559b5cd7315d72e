"""The owner's and the volunteer's membership commands: `dedloc run init`, `dedloc invite`,
`dedloc revoke` and `dedloc identity` (docs/security.md shows the whole flow)."""

from __future__ import annotations

import os
import re

from dedloc.files import make_dir
from dedloc.auth.invitation import RunOwner
from dedloc.errors import ConfigError
from dedloc.auth.identity import create_identity, load_identity, peer_id_of, public_key_of

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` (or plain seconds) -> seconds; ConfigError if not."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def run_init(directory: str, run_id: str) -> str:
    owner = RunOwner.init(directory, run_id)
    return (f"invite-only run {run_id!r} created in {directory} (keep owner.key secret)\n"
            f"owner key: {owner.public}\n"
            f"every peer joins with: --run-id {run_id} --owner={owner.public} --invite <its invitation>\n"
            f"one token for all of it:  dedloc run manifest --run-id {run_id} --owner={owner.public} --recipe ... "
            f"--tokenizer ... --data ... --initial-peers ...\n"
            f"invite the backbone:  dedloc invite BACKBONE_PEER_ID --run {directory} --expires 30d --backbone\n"
            f"invite a peer:  dedloc invite PEER_ID --run {directory} --expires 7d\n"
            f"revoke a peer:  dedloc revoke PEER_ID --run {directory}  (the owner's backbone publishes "
            f"{os.path.join(directory, 'revoked')} with --revocations)")


def invite(directory: str, peer_id: str, expires: str, backbone: bool = False) -> str:
    try:
        public_key_of(peer_id)
    except ValueError as e:
        raise ConfigError(f"cannot invite {peer_id!r}: {e}") from None
    return RunOwner.load(directory).invite(peer_id, parse_duration(expires), backbone)


def revoke(directory: str, peer_id: str) -> str:
    rev = RunOwner.load(directory).revoke(peer_id)
    return (f"revoked every invitation of {peer_id} issued until now (revocation list {rev.serial}, "
            f"{len(rev.revoked)} peer(s)); peers refuse it once the list reaches them (about 30 s after the "
            f"backbone started with --revocations {os.path.join(directory, 'revoked')} reads it)")


def identity(path: str) -> str:
    """The peer id of the identity at ``path``, created (Ed25519, mode 0600) if missing."""
    if os.path.isdir(path):
        raise ConfigError(f"--identity-path {path}: a directory; give the path of a key file (created if missing)")
    if not os.path.exists(path):
        make_dir(os.path.dirname(os.path.abspath(path)), "--identity-path's directory")
        return create_identity(path)
    try:
        return peer_id_of(load_identity(path).public_key())
    except ValueError as e:
        raise ConfigError(str(e)) from None
