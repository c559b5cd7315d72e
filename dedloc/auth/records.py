"""Owner-bound DHT records: a record under subkey ``P`` is valid only if peer ``P`` signed it.

Every dedloc record is stored under its writer's peer id as the subkey (progress, capabilities,
ready, closed, left, revocations). This validator, installed in the DHT node (hivemind's record
validator seam), signs what this peer stores and checks every record that arrives, whether another
peer asks to store it or returns it to a search:

- the subkey must be an Ed25519 peer id (its public key is inside it, see auth/identity.py);
- the value carries that peer's signature over (key, subkey, value, expiration time), so nobody
  can write, overwrite, or extend the life of another peer's record;
- in an invite-only run the value also carries the writer's invitation, which the authorizer
  checks: records written by an uninvited identity are refused too;
- it expires within ``MAX_LIFE`` seconds: a member cannot plant a record that outlives its
  revocation (readers also skip records of peers no longer admitted, net/node.py ``get``).

A refused record is dropped (its store fails, or a search skips it) and logged with the subkey and,
for a store request, the peer that sent it (at most once per peer per minute at WARNING).
"""

from __future__ import annotations

import contextvars
import logging
import struct
import time

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from dedloc.auth.authorizer import Authorizer
from dedloc.errors import Unauthorized
from dedloc.framing import framed
from dedloc.logs import PerPeerWarnings
from dedloc.auth.identity import public_key_of

logger = logging.getLogger(__name__)
_DOMAIN = b"dedloc record v1\x00"
MAX_LIFE = 3600.0
"""The longest a record may live (the longest dedloc stores: a leave mark, 2 x ``progress_ttl``)."""
sender: contextvars.ContextVar[str | None] = contextvars.ContextVar("dedloc_dht_sender", default=None)
"""The peer whose DHT request is being served (set by auth/dht.py), for naming a forger in logs."""
_warnings = PerPeerWarnings(logger)


def _signed_bytes(record: DHTRecord, value: bytes) -> bytes:
    return _DOMAIN + framed(record.key, record.subkey, width=2) + struct.pack(">d", record.expiration_time) + value


class SignedRecords(RecordValidatorBase):
    """Signs this peer's records and refuses any record not signed by the peer its subkey names."""

    def __init__(self, key: ed25519.Ed25519PrivateKey, peer_id: str, authorizer: Authorizer):
        self._key, self.peer_id, self.authorizer = key, peer_id, authorizer
        self._subkey = msgpack.packb(peer_id, use_bin_type=True)

    def __getstate__(self):
        raise TypeError("SignedRecords holds a private key and never leaves its process")

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.subkey != self._subkey:
            return record.value  # not ours to sign: every node, this one included, refuses it
        signature = self._key.sign(_signed_bytes(record, record.value))
        return msgpack.packb([record.value, signature, self.authorizer.credential()], use_bin_type=True)

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
            return True
        except Unauthorized as e:
            source = sender.get()
            who = f"from peer {source}" if source else "in a DHT answer"
            _warnings.warn(source or "dht-answer", f"refused a DHT record {who}: {e}")
            return False

    def _check(self, record: DHTRecord) -> None:
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except Exception:
            subkey = None
        if not isinstance(subkey, str):
            raise Unauthorized("its subkey is not a peer id (every record belongs to the peer named by its subkey)")
        if record.expiration_time > time.time() + MAX_LIFE:
            raise Unauthorized(f"the record under {subkey} would live {record.expiration_time - time.time():.0f} s, more "
                               f"than the {MAX_LIFE:.0f} s any record may")
        try:
            public = public_key_of(subkey)
        except ValueError as e:
            raise Unauthorized(f"its subkey: {e}") from None
        try:
            value, signature, credential = msgpack.unpackb(record.value, raw=False)
            if not isinstance(value, bytes) or not isinstance(signature, bytes) or \
                    not (credential is None or isinstance(credential, str)):
                raise ValueError
        except Exception:
            raise Unauthorized(f"the record under {subkey} is not a signed record") from None
        try:
            public.verify(signature, _signed_bytes(record, value))
        except InvalidSignature:
            raise Unauthorized(f"the record under {subkey} is not signed by {subkey}") from None
        self.authorizer.admit(subkey, credential)

    def strip_value(self, record: DHTRecord) -> bytes:
        return msgpack.unpackb(record.value, raw=False)[0]
