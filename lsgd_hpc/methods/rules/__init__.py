"""Training methods, one small module each, over the communication interface."""

from lsgd_hpc.methods.rules.allreduce import AllreduceSGD
from lsgd_hpc.methods.rules.base import Algorithm, uncounted
from lsgd_hpc.methods.rules.diloco import DiLoCo
from lsgd_hpc.methods.rules.easgd import EASGD
from lsgd_hpc.methods.rules.gossip import GossipSGD
from lsgd_hpc.methods.rules.local_sgd import LocalSGD
from lsgd_hpc.methods.rules.lsgd import LeaderSGD
from lsgd_hpc.methods.rules.lsgd_async import AsyncLeaderSGD
from lsgd_hpc.methods.rules.slowmo import SlowMo

__all__ = ["Algorithm", "AllreduceSGD", "AsyncLeaderSGD", "DiLoCo", "EASGD", "GossipSGD",
           "LeaderSGD", "LocalSGD", "SlowMo", "uncounted"]

