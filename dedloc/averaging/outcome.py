"""What one averaging round came to, as its member saw it: the one record ``Peer.average`` returns
and the optimizer, the service's round reports and credits, the metrics and the tools read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundOutcome:
    step: int
    round_id: str
    """Hex of the group's round id."""
    peers: tuple[str, ...]
    """The group's members, in group order (contributing or not)."""
    weights: tuple[float, ...]
    """Each member's sample weight, in group order."""
    shares: tuple[float, ...]
    """Each member's share of the vector to aggregate (the leader's plan), in group order."""
    strategy: str
    failovers: int = 0
    """Parts this member took from a backup instead of their aggregator."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Peer id -> why a part this member saw left its contribution out."""
    verified: int = 0
    """Parts whose result this member checked against its backup's recomputation (verified rounds)."""
    accepted: dict[str, float] = field(default_factory=dict)
    """As an aggregator: each contributor's weight it reduced (the credits' source)."""
    accepted_fraction: float = 0.0
    """The fraction of the vector this member aggregated."""
    contributors: tuple[str, ...] | None = None
    """Peer ids whose contributions every part averaged (weight > 0); None for hierarchical groups,
    in which no member sees every subgroup's."""
    streams: dict[str, int] = field(default_factory=lambda: {"direct": 0, "libp2p": 0})
    """Streams this member opened in the round, by path."""
    queue_s: float = 0.0
    """The longest a payload of this member waited in its send queue."""
    total_weight: float = 0.0
    """Samples in the averaged vector (0: every contribution overflowed or was refused)."""
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.peers)

    def share_of(self, peer_id: str) -> float:
        """``peer_id``'s share of the vector in this round's plan."""
        return self.shares[self.peers.index(peer_id)]


__all__ = ["RoundOutcome"]
