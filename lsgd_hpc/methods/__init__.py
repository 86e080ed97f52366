"""The training methods: one public class per method over the user's model and optimizer
(api), each over its update rule (rules/, one small module per method), and METHODS, the
one registry the CLI, the planner and the docs read."""

from .api import (EASGD, METHODS, AllreduceSGD, AsyncLeaderSGD, DiLoCo, GossipSGD, LeaderSGD,
                  LocalSGD, Method, SlowMo, method_class)

__all__ = ["Method", "LeaderSGD", "AsyncLeaderSGD", "AllreduceSGD", "EASGD", "LocalSGD",
           "DiLoCo", "SlowMo", "GossipSGD", "METHODS", "method_class"]
