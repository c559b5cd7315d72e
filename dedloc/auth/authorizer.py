"""The membership seam: who may take part in a run.

Every entry point asks the peer's one :class:`Authorizer` before it reads anything else: stream
protocols (net/serve.py), DHT requests (auth/dht.py) and DHT records (auth/records.py). The remote
peer id always comes from libp2p's authenticated channel or from a signature checked against it,
never from a claim.

- :class:`OpenRun` admits every peer (the local demo, public experiments).
- :class:`InviteOnly` admits a peer that presents an invitation signed by the run owner for its
  own peer id, unexpired and not revoked. A login service (sahajBERT admitted Hugging Face
  accounts) would issue the same invitations from the owner key.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

from dedloc.auth.invitation import Invitation, Revocations, owner_public_key
from dedloc.errors import ConfigError, Unauthorized

logger = logging.getLogger(__name__)
CACHE = 4096
"""Verified invitations remembered (by token), so a check is a lookup after the first."""


class Authorizer(ABC):
    """Decides whether a remote peer is a member. Guarantees: ``admit`` raises :class:`Unauthorized`
    naming the reason, never anything else, and is cheap after a peer's first check."""

    invite_only: bool = False

    @abstractmethod
    def credential(self) -> str | None:
        """What this peer presents to others (None in an open run)."""

    @abstractmethod
    def admit(self, peer_id: str, credential: str | None) -> None:
        """Return if ``peer_id`` (authenticated by the caller) may take part, given the credential
        it presented; else raise Unauthorized."""

    def update_revocations(self, text: str) -> bool:
        """Apply a revocation list (ignored if older than the one held); True if it was newer."""
        return False

    def revocations(self) -> str | None:
        """The newest valid revocation list held, to pass on (None if none)."""
        return None


class OpenRun(Authorizer):
    """Every peer is a member."""

    def credential(self) -> str | None:
        return None

    def admit(self, peer_id: str, credential: str | None) -> None:
        return None


class InviteOnly(Authorizer):
    """Members hold an owner-signed invitation for their own peer id. Construction checks this
    peer's own invitation and raises ConfigError naming what is wrong with it."""

    invite_only = True

    def __init__(self, run_id: str, owner: str, invitation: str, peer_id: str):
        self.run_id, self.owner = run_id, owner_public_key(owner)
        try:
            own = Invitation.verify(invitation, self.owner, run_id)
        except Unauthorized as e:
            raise ConfigError(f"invalid config: invite: {e}") from None
        if own.peer_id != peer_id:
            raise ConfigError(f"invalid config: invite: the invitation is for peer {own.peer_id}, but this peer is "
                              f"{peer_id} (send the owner this peer id; `dedloc identity` prints it)")
        self._own = invitation
        self._verified: dict[str, Invitation] = {}
        self._revocations: Revocations | None = None
        self._revocations_text: str | None = None
        left = own.expires - time.time()
        logger.info(f"invite-only run {run_id!r}: this peer's invitation expires in {left / 86400:.1f} days")

    def credential(self) -> str | None:
        return self._own

    def admit(self, peer_id: str, credential: str | None) -> None:
        if not credential:
            raise Unauthorized(f"peer {peer_id} presented no invitation (run {self.run_id!r} is invite-only)")
        inv = self._verified.get(credential)
        if inv is None:
            inv = Invitation.verify(credential, self.owner, self.run_id)
            self._verified[credential] = inv
            while len(self._verified) > CACHE:
                self._verified.pop(next(iter(self._verified)))
        if inv.peer_id != peer_id:
            raise Unauthorized(f"peer {peer_id} presented the invitation of {inv.peer_id}")
        if inv.expires <= time.time():
            raise Unauthorized(f"the invitation of {peer_id} has expired")
        if self._revocations is not None and self._revocations.voids(inv):
            raise Unauthorized(f"the invitation of {peer_id} was revoked")

    def update_revocations(self, text: str) -> bool:
        rev = Revocations.verify(text, self.owner, self.run_id)
        if self._revocations is not None and rev.serial <= self._revocations.serial:
            return False
        added = sorted(set(rev.revoked) - set(self._revocations.revoked if self._revocations else {}))
        self._revocations, self._revocations_text = rev, text
        if added:
            logger.info(f"revocation list {rev.serial}: revoked {', '.join(added)}")
        return True

    def revocations(self) -> str | None:
        return self._revocations_text


def make_authorizer(run_id: str, owner: str, invitation: str, peer_id: str) -> Authorizer:
    """The authorizer a peer's config asks for: invite-only when an owner key is given."""
    if not owner:
        return OpenRun()
    if not invitation:
        raise ConfigError(f"invalid config: invite: run {run_id!r} is invite-only (an owner key is set); pass the "
                          f"invitation the owner issued for peer {peer_id} (`dedloc invite {peer_id}`)")
    return InviteOnly(run_id, owner, invitation, peer_id)
