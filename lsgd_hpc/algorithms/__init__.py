"""Training methods, one small module each, over the communication interface."""

from .allreduce import AllreduceSGD
from .base import Algorithm, uncounted
from .diloco import DiLoCo
from .easgd import EASGD
from .gossip import GossipSGD
from .local_sgd import LocalSGD
from .lsgd import LeaderSGD
from .lsgd_async import AsyncLeaderSGD
from .slowmo import SlowMo

__all__ = ["Algorithm", "AllreduceSGD", "AsyncLeaderSGD", "DiLoCo", "EASGD", "GossipSGD",
           "LeaderSGD", "LocalSGD", "SlowMo", "uncounted"]

