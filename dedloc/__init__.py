"""dedloc: collaborative deep learning over unreliable, heterogeneous peers."""

from dedloc.config import AveragingConfig, BackboneConfig, OptimizerConfig, PeerConfig
from dedloc.errors import (AveragingError, ConfigError, DedlocError, JoinError, MatchmakingError, MissedRoundError,
                           ProtocolError, StateError)
from dedloc.optim import CollaborativeOptimizer, StepOutcome
from dedloc.peer import Peer

__all__ = ["Peer", "PeerConfig", "AveragingConfig", "OptimizerConfig", "BackboneConfig", "CollaborativeOptimizer",
           "StepOutcome", "DedlocError", "ConfigError", "JoinError", "ProtocolError", "MatchmakingError",
           "MissedRoundError", "AveragingError", "StateError"]
__version__ = "0.1.0"
