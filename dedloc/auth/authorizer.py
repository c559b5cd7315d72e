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
import os
import time
from abc import ABC, abstractmethod

from dedloc.auth.invitation import Invitation, Revocations, owner_public_key
from dedloc.errors import ConfigError, Unauthorized

logger = logging.getLogger(__name__)
CACHE = 4096
"""Verified invitations remembered (by token), so a check is a lookup after the first; and peers
remembered as having proven membership."""
RENEW_CHECK_S = 10.0
"""How often a peer looks at its invitation file for a renewal (and at its invitation's expiry)."""


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

    def proven(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has shown this peer a credential that ``admit`` accepted (on a stream,
        a DHT request or a record it signed) and that is still valid now (unexpired, unrevoked).
        Open runs: every peer."""
        return True

    def backbone_invited(self) -> bool:
        """Whether this peer's own invitation lets it act as a backbone (open runs: True)."""
        return True

    def may_be_backbone(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s published checkpoint step may count as the run's: in an invite-only
        run only a proven member whose invitation says so (`dedloc invite --backbone`); in an open
        run every peer (anyone may be anyone there)."""
        return True

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
    peer's own invitation and raises ConfigError naming what is wrong with it.

    The invitation may be given as a file (``invitation`` is then its path): the file is re-read
    when it changes (looked at every ``RENEW_CHECK_S``), so a volunteer renews a running peer by
    writing the owner's new token into it. A new token is adopted only if it is valid for this peer
    and lasts longer than the one held; otherwise it is ignored with a WARNING. A WARNING also says,
    once, when the held invitation has less than a day left, and again once it has expired."""

    invite_only = True

    def __init__(self, run_id: str, owner: str, invitation: str, peer_id: str):
        self.run_id, self.owner, self.peer_id = run_id, owner_public_key(owner), peer_id
        self.path: str | None = None
        if not Invitation.is_token(invitation):
            self.path = invitation
            invitation = self._read_file()
        try:
            own = self._check_own(invitation)
        except Unauthorized as e:
            raise ConfigError(f"invalid config: invite: {e}") from None
        self._own, self._own_inv = invitation, own
        self._seen = (invitation, self._mtime())
        self._next_look = time.monotonic() + RENEW_CHECK_S
        self._warned: set[str] = set()
        self._verified: dict[str, Invitation] = {}
        self._proven: dict[str, str] = {}
        """Peer id -> the credential it was last admitted with (at most CACHE, oldest dropped)."""
        self._revocations: Revocations | None = None
        self._revocations_text: str | None = None
        left = own.expires - time.time()
        logger.info(f"invite-only run {run_id!r}: this peer's invitation expires in {left / 86400:.1f} days")

    def _read_file(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except FileNotFoundError:
            if os.sep not in self.path and len(self.path) > 40:  # a token whose start was cut off when pasted
                raise ConfigError(f"invalid config: invite: {self.path[:12]}... is neither an invitation (a token "
                                  f"starts with '{Invitation.START}': was its start cut off?) nor a file") from None
            raise ConfigError(f"invalid config: invite: no invitation file {self.path} (a token starts with "
                              f"'{Invitation.START}')") from None
        except OSError as e:
            raise ConfigError(f"invalid config: invite: cannot read the invitation file {self.path}: "
                              f"{e.strerror or e}") from None

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime if self.path else None
        except OSError:
            return None

    def _check_own(self, text: str) -> Invitation:
        own = Invitation.verify(text, self.owner, self.run_id)
        if own.peer_id != self.peer_id:
            raise Unauthorized(f"the invitation is for peer {own.peer_id}, but this peer is {self.peer_id} "
                               f"(send the owner this peer id; `dedloc identity` prints it)")
        return own

    def credential(self) -> str | None:
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + RENEW_CHECK_S
            self._renew()
        return self._own

    def _renew(self) -> None:
        """Adopt a newer invitation from the file, and warn about the held one's expiry."""
        if self.path is not None and self._mtime() != self._seen[1]:
            try:
                text = self._read_file()
            except ConfigError as e:
                text = None
                self._warn_once(str(e), str(e))
            if text is not None and text != self._seen[0]:
                self._seen = (text, self._mtime())
                try:
                    new = self._check_own(text)
                    if new.expires <= self._own_inv.expires:
                        raise Unauthorized("it expires no later than the one held")
                except Unauthorized as e:
                    logger.warning(f"ignored the new invitation in {self.path}: {e}")
                else:
                    self._own, self._own_inv = text, new
                    self._warned.clear()
                    logger.info(f"renewed this peer's invitation: it expires in "
                                f"{(new.expires - time.time()) / 86400:.1f} days")
        left = self._own_inv.expires - time.time()
        where = f"write it into {self.path}" if self.path else "restart with it (or pass --invite a file to renew "\
                                                                "without a restart)"
        if left <= 0:
            self._warn_once("expired", f"this peer's invitation has expired: other peers now refuse it. Ask the run "
                                       f"owner for a new one (`dedloc invite {self.peer_id}`) and {where}")
        elif left < 86400:
            self._warn_once("soon", f"this peer's invitation expires in {left / 3600:.1f} h. Ask the run owner for a "
                                    f"new one (`dedloc invite {self.peer_id}`) and {where}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

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
        self._proven.pop(peer_id, None)
        self._proven[peer_id] = credential
        while len(self._proven) > CACHE:
            self._proven.pop(next(iter(self._proven)))

    def proven(self, peer_id: str) -> bool:
        if peer_id == self.peer_id:
            return True
        credential = self._proven.get(peer_id)
        if credential is None:
            return False
        try:
            self.admit(peer_id, credential)
        except Unauthorized:
            self._proven.pop(peer_id, None)
            return False
        return True

    def backbone_invited(self) -> bool:
        return self._own_inv.backbone

    def may_be_backbone(self, peer_id: str) -> bool:
        return self.proven(peer_id) and self._verified[self._proven[peer_id]].backbone

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
