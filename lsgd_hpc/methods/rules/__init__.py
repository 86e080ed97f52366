"""Training methods, one small module each, over the communication interface."""

from lsgd_hpc.methods.rules.allreduce import AllreduceRule
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.rules.diloco import DiLoCoRule
from lsgd_hpc.methods.rules.easgd import EASGDRule
from lsgd_hpc.methods.rules.gossip import GossipRule
from lsgd_hpc.methods.rules.local_sgd import LocalSGDRule
from lsgd_hpc.methods.rules.lsgd import LeaderRule
from lsgd_hpc.methods.rules.lsgd_async import AsyncLeaderRule
from lsgd_hpc.methods.rules.slowmo import SlowMoRule
from lsgd_hpc.methods.rules.state import REPLICA

__all__ = ["Rule", "AllreduceRule", "AsyncLeaderRule", "DiLoCoRule", "EASGDRule", "GossipRule",
           "LeaderRule", "LocalSGDRule", "SlowMoRule", "REPLICA"]

