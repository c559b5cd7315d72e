"""dedloc: collaborative deep learning over unreliable, heterogeneous peers."""

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import (AveragingError, ConfigError, DedlocError, JoinError, MatchmakingError, MissedRoundError,
                           ProtocolError)
from dedloc.peer import Peer

__all__ = ["Peer", "PeerConfig", "AveragingConfig", "DedlocError", "ConfigError", "JoinError", "ProtocolError",
           "MatchmakingError", "MissedRoundError", "AveragingError"]
__version__ = "0.1.0"
