"""Every error dedloc raises on purpose. Each names the peer, the step and the cause where known."""


class DedlocError(Exception):
    """Base class of all dedloc errors. ``peers``: the peers it is about, where the caller acts on
    them (e.g. donors refused as forks); they travel with it from the background process."""

    def __init__(self, *args: object, peers: tuple[str, ...] = ()):
        super().__init__(*args)
        self.peers = tuple(peers)


class ConfigError(DedlocError, ValueError):
    """A configuration value is invalid; the message names the field."""


class JoinError(DedlocError):
    """The peer could not start or could not reach any initial peer."""


class BootstrapError(JoinError):
    """None of the initial peers answered (they may be restarting: ``PeerConfig.join_timeout``)."""


class ProtocolError(DedlocError):
    """A peer sent a malformed, hostile or incompatible message."""


class Unauthorized(ProtocolError):
    """A peer is not a member of this run (no, a forged, an expired or a revoked invitation), or
    something it sent is not signed by whom it claims."""


class ForkError(ProtocolError):
    """A donor's state rewrites steps that the collaboration took with other parameters (a fork,
    state/lineage.py): refused."""


class MatchmakingError(DedlocError):
    """No group could be agreed for this step within the deadline."""


class MissedRoundError(MatchmakingError):
    """The group for this step was already closed when this peer asked to join."""


class LeftToTrainersError(MatchmakingError):
    """This peer led a group that could hand no state on (clients and aggregator-only peers) while
    a trainer that can was at the step: the step is left to that trainer's group, which this peer
    may still join (matchmaking rule 4)."""


class AveragingError(DedlocError):
    """An averaging round could not complete; the local tensor was left untouched."""


class RuntimeClosedError(DedlocError):
    """The background networking process is gone (closed or crashed)."""


class StateError(DedlocError):
    """No peer could provide the collaboration's training state (joining or resyncing failed)."""


class DataError(DedlocError):
    """A data source or tokenizer is missing, empty or malformed; the message names it."""
