"""Membership on the DHT's own requests (store, find, ping), through hivemind's authorizer seam.

hivemind hands the authorizer each request without the libp2p channel it came on, so the sender
proves who it is: every request carries the sender's peer id, its invitation (invite-only runs)
and an Ed25519 signature over the request by the key inside that peer id; every answer is signed
the same way by the answering peer, over the request's nonce too. A request or answer that fails
any check is dropped: the requester sees an error, and a node that answers unsigned is treated as
unresponsive (hivemind drops it from its routing table). Refusals are logged with the peer id.

Each member may send ``DHT_RATE`` requests per second to this peer, in bursts of ``DHT_BURST``
(auth/limits.py); counted after the signature check, so nobody can spend another peer's budget.
Above it, requests are dropped like refused ones, with a WARNING naming the peer.

A request is accepted within ``MAX_SKEW`` seconds of its timestamp, only by the peer it is
addressed to (the recipient's peer id is signed with it), and only once (its nonce is remembered
for ``MAX_SKEW`` seconds; at most ``MAX_NONCES``). A member that received another member's request
and replayed it 800 times to a third peer got that honest member cut off ("too many DHT requests");
a replay is now refused before it is counted against anyone's budget. hivemind builds each
request's stub without naming its recipient (``DHTProtocol.get_stub``); ``_addressed_stub`` names
it, for the pinned hivemind 1.1.12 (tests/test_members.py fails if that changes).
"""

from __future__ import annotations

import collections
import logging
import os
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import PeerID
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase, AuthRole, AuthRPCWrapper

from dedloc.auth.authorizer import Authorizer
from dedloc.auth.records import sender
from dedloc.errors import Unauthorized
from dedloc.logs import PerPeerWarnings
from dedloc.auth.limits import PeerLimits
from dedloc.auth.identity import public_key_of

logger = logging.getLogger(__name__)
MAX_SKEW = 120.0
MAX_NONCES = 1 << 20
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
        self._address = PeerID.from_base58(peer_id).to_bytes()
        self.limits = PeerLimits(DHT_RATE, DHT_BURST)
        self._nonces: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        """Nonces of the requests admitted in the last MAX_SKEW seconds -> when they may be forgotten."""

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
        """Sign ``request`` for the peer ``service_public_key`` names (a PeerID, ``_addressed_stub``)."""
        auth = request.auth
        auth.service_public_key = service_public_key.to_bytes() if isinstance(service_public_key, PeerID) else b""
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
            if request.auth.service_public_key != self._address:
                raise Unauthorized("it is addressed to another peer (a captured request, replayed)")
            self._remember(peer, request.auth.nonce, request.auth.time)
            if self.limits.acquire(peer) is None:
                raise Unauthorized(f"too many DHT requests from this peer ({self.limits.describe()})")
        except Unauthorized as e:
            _warnings.warn(f"{peer} {type(request).__name__}", f"refused a DHT {type(request).__name__} from {peer or 'an unnamed peer'}: {e}")
            return False
        sender.set(peer)  # this task now serves the request: records it stores name their sender
        return True

    def _remember(self, peer: str, nonce: bytes, sent: float) -> None:
        """Admit ``nonce`` once in its window (Unauthorized for a replay; a full memory refuses too,
        rather than forget a nonce still in its window)."""
        now = time.time()
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        key = peer.encode() + b"/" + nonce
        if key in self._nonces:
            raise Unauthorized("it was already received (a replay)")
        if len(self._nonces) >= MAX_NONCES:
            raise Unauthorized(f"this peer remembers {MAX_NONCES} recent requests already")
        self._nonces[key] = max(now, sent + MAX_SKEW)

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


def _addressed_stub(self: DHTProtocol, peer: PeerID) -> AuthRPCWrapper:
    """hivemind's ``DHTProtocol.get_stub``, naming the recipient to the signer (see module docstring)."""
    stub = super(DHTProtocol, self).get_stub(self.p2p, peer)
    return AuthRPCWrapper(stub, AuthRole.CLIENT, self.authorizer, service_public_key=peer)


DHTProtocol.get_stub = _addressed_stub
