"""Point-to-point communication for the PipeFusion engine: channels, buffers, timeouts, errors, counters.

Knows nothing about models: it moves labelled tensors ("hidden", "skip", "latent", ...)
between global ranks over torch.distributed. See ``p2p.py`` for the rules.
"""

from .buffers import RecvBufferPool
from .errors import CommError, CommTimeout, InflightLimitError, PeerLost
from .groups import DirectionGroups, make_direction_groups
from .p2p import P2PChannels, PendingRecv, PendingSend, Recv, Send
from .stats import OpLog, OpRecord, TrafficCounters

__all__ = [
    "CommError",
    "CommTimeout",
    "DirectionGroups",
    "InflightLimitError",
    "OpLog",
    "OpRecord",
    "P2PChannels",
    "PeerLost",
    "PendingRecv",
    "PendingSend",
    "Recv",
    "RecvBufferPool",
    "Send",
    "TrafficCounters",
    "make_direction_groups",
]
