"""Gossip topologies: the graphs and their mixing weights (graphs, with the TOPOLOGIES
registry), their spectral analysis (analysis), and ``python -m lsgd_hpc.topology`` (cli)."""

from .analysis import (DEFAULT_GAMMAS, SPECTRAL_GAP_DEFINITION, analyse, diameter,
                       effective_neighbors, second_eigenvalue_modulus, second_singular_value,
                       spectral_gap)
from .cli import main
from .graphs import TOPOLOGIES, Topology, build_topology

__all__ = ["TOPOLOGIES", "DEFAULT_GAMMAS", "SPECTRAL_GAP_DEFINITION", "Topology", "build_topology",
           "spectral_gap", "second_eigenvalue_modulus", "second_singular_value",
           "effective_neighbors", "diameter", "analyse", "main"]
