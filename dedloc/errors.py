"""Every error dedloc raises on purpose. Each names the peer, the step and the cause where known."""

from __future__ import annotations

_REGISTRY: dict[str, type[DedlocError]] = {}
"""Every DedlocError class by name: how an error raised in a peer's background process is rebuilt
with its type in the training process (``to_wire``/``from_wire``)."""


class DedlocError(Exception):
    """Base class of all dedloc errors. ``peers``: the peers it is about, where the caller acts on
    them (e.g. donors refused as forks); they travel with it from the background process."""

    def __init__(self, *args: object, peers: tuple[str, ...] = ()):
        super().__init__(*args)
        self.peers = tuple(peers)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if _REGISTRY.setdefault(cls.__name__, cls) is not cls:
            raise TypeError(f"two error classes are named {cls.__name__}: {_REGISTRY[cls.__name__]} and {cls}")


class PeerTimeoutError(DedlocError, TimeoutError):
    """A wait inside the peer's background process timed out (a TimeoutError there): both a
    DedlocError and a TimeoutError here."""


_REGISTRY["DedlocError"] = DedlocError
_BUILTIN = {"TimeoutError": PeerTimeoutError}
"""Built-in errors that keep their type across the boundary (as a class that is also a DedlocError)."""


def to_wire(e: BaseException) -> tuple[str, str, tuple[str, ...]]:
    """What crosses the process boundary of an error: its class name, message and peers."""
    return type(e).__name__, str(e), tuple(getattr(e, "peers", ()))


def from_wire(name: str, message: str, peers: tuple[str, ...] = ()) -> DedlocError:
    """The error ``to_wire`` described: a DedlocError of its own class, a built-in timeout as
    PeerTimeoutError, and anything else (a bug in the service) as a DedlocError naming its class."""
    cls = _REGISTRY.get(name) or _BUILTIN.get(name)
    if cls is None:
        return DedlocError(f"{name}: {message}", peers=tuple(peers))
    return cls(message, peers=tuple(peers))


class ConfigError(DedlocError, ValueError):
    """A configuration value is invalid; the message names the field."""


class JoinError(DedlocError):
    """The peer could not start or could not reach any initial peer."""


class BootstrapError(JoinError):
    """None of the initial peers answered (they may be restarting: ``PeerConfig.join_timeout``)."""


class SettingsMismatch(JoinError):
    """This peer's run-wide settings are not the run's (``OptimizerConfig.run_hash``): it joins nothing."""


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


class LoneStepDeclined(MatchmakingError):
    """This peer led a group in which it was the only contributor while other trainers are at the
    step (matchmaking rule 14): the step stays open for a group with them, and the gradients in hand
    are kept for it."""


class AveragingError(DedlocError):
    """An averaging round could not complete; the local tensor was left untouched."""


class RuntimeClosedError(DedlocError):
    """The background networking process is gone (closed or crashed)."""


class StateError(DedlocError):
    """No peer could provide the collaboration's training state (joining or resyncing failed)."""


class DataError(DedlocError):
    """A data source or tokenizer is missing, empty or malformed; the message names it."""
