"""Membership on the DHT's own requests (store, find, ping), through hivemind's authorizer seam.

hivemind hands the authorizer each request without the libp2p channel it came on, so the sender
proves who it is: every request carries the sender's peer id, its invitation (invite-only runs)
and an Ed25519 signature over the request by the key inside that peer id; every answer is signed
the same way by the answering peer, over the request's nonce too. A request or answer that fails
any check is dropped: the requester sees an error, and a node that answers unsigned is treated as
unresponsive (hivemind drops it from its routing table). Refusals are logged with the peer id.

Each member may send ``DHT_RATE`` requests per second to this peer, in bursts of ``DHT_BURST``
(net/limits.py); counted after the signature check, so nobody can spend another peer's budget.
Above it, requests are dropped like refused ones, with a WARNING naming the peer.

A request is accepted within ``MAX_SKEW`` seconds of its timestamp. Replaying a captured request is
harmless: only its recipient can read it (the channel is encrypted), a stored record is itself
signed by its owner (auth/records.py), and a search's answer goes to whoever asks.
"""

from __future__ import annotations

import logging
import os
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase

from dedloc.auth.authorizer import Authorizer
from dedloc.auth.records import sender
from dedloc.errors import Unauthorized
from dedloc.logs import PerPeerWarnings
from dedloc.net.limits import PeerLimits
from dedloc.net.identity import public_key_of

logger = logging.getLogger(__name__)
MAX_SKEW = 300.0
DHT_RATE = 100.0
DHT_BURST = 500.0
_REQUEST, _RESPONSE = b"dedloc dht request v1\x00", b"dedloc dht response v1\x00"
_warnings = PerPeerWarnings(logger)


def _unsigned(message, field: str) -> bytes:
    copy = type(message)()
    copy.CopyFrom(message)
    getattr(copy.auth, field)  # present on every hivemind DHT message
    copy.auth.signature = b""
    return copy.SerializeToString(deterministic=True)


class DHTAccess(AuthorizerBase):
    """Signs this peer's DHT requests and answers; admits only members' (see module docstring)."""

    def __init__(self, key: ed25519.Ed25519PrivateKey, peer_id: str, authorizer: Authorizer):
        self._key, self.peer_id, self.authorizer = key, peer_id, authorizer
        self.limits = PeerLimits(DHT_RATE, DHT_BURST)

    def __getstate__(self):
        raise TypeError("DHTAccess holds a private key and never leaves its process")

    def _verify(self, peer: str, credential: bytes, signature: bytes, signed: bytes) -> None:
        try:
            public_key_of(peer).verify(signature, signed)
        except (ValueError, InvalidSignature):
            raise Unauthorized(f"its signature is not by {peer!r}") from None
        try:
            self.authorizer.admit(peer, credential.decode() or None)
        except UnicodeDecodeError:
            raise Unauthorized("its invitation is not text") from None

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key=None) -> None:
        auth = request.auth
        auth.client_access_token.username = self.peer_id
        auth.client_access_token.public_key = (self.authorizer.credential() or "").encode()
        auth.time = time.time()
        auth.nonce = os.urandom(8)
        auth.signature = self._key.sign(_REQUEST + _unsigned(request, "client_access_token"))

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        peer = request.auth.client_access_token.username
        try:
            if abs(time.time() - request.auth.time) > MAX_SKEW:
                raise Unauthorized(f"its timestamp is more than {MAX_SKEW:.0f} s from this peer's clock")
            self._verify(peer, request.auth.client_access_token.public_key, request.auth.signature,
                         _REQUEST + _unsigned(request, "client_access_token"))
            if self.limits.acquire(peer) is None:
                raise Unauthorized(f"too many DHT requests from this peer ({self.limits.describe()})")
        except Unauthorized as e:
            _warnings.warn(f"{peer} {type(request).__name__}", f"refused a DHT {type(request).__name__} from {peer or 'an unnamed peer'}: {e}")
            return False
        sender.set(peer)  # this task now serves the request: records it stores name their sender
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.service_access_token.username = self.peer_id
        auth.service_access_token.public_key = (self.authorizer.credential() or "").encode()
        auth.nonce = request.auth.nonce
        auth.signature = self._key.sign(_RESPONSE + _unsigned(response, "service_access_token"))

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        peer = response.auth.service_access_token.username
        try:
            if response.auth.nonce != request.auth.nonce:
                raise Unauthorized("it answers another request")
            self._verify(peer, response.auth.service_access_token.public_key, response.auth.signature,
                         _RESPONSE + _unsigned(response, "service_access_token"))
        except Unauthorized as e:
            _warnings.warn(peer or "unnamed", f"dropped a DHT answer from {peer or 'an unnamed peer'}: {e}")
            return False
        return True
