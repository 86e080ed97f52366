"""Latency and bandwidth inside a node and between nodes, measured by MPI ping-pong.

API (stable; the doctor and the planner use it)::

    from lsgd_hpc.planning.netprobe import probe_network
    result = probe_network(comm, node_of, sizes=(8, 65536, 1 << 20), repeats=10)

``comm`` is an mpi4py communicator (``MPI.COMM_WORLD``, or ``.comm`` of an
:class:`~lsgd_hpc.comm.mpi.MPICommunicator`) and ``node_of[r]`` the node index of rank r in
it (:func:`~lsgd_hpc.comm.groups.node_layout`, or ``NodeGroups.node_of``).
:func:`probe_groups` does the same from a :class:`~lsgd_hpc.comm.groups.NodeGroups`.
Collective over ``comm``; every rank returns the same dict::

    {"sizes": [8, 65536, 1048576], "repeats": 10, "n_nodes": 2,
     "intra": LINK or None,      # None: no node holds two ranks
     "inter": LINK or None}      # None: one node only
    LINK = {"pairs": [[a, b], ...],          # ranks of comm that were measured
            "one_way_s": [t(s) for s in sizes],   # worst pair, per size
            "latency_s": t(sizes[0]),             # one-way time of the smallest message
            "bandwidth_Bps": sizes[-1] / t(sizes[-1]),
            "alpha_s": a, "beta_s_per_byte": b}   # least-squares fit t(n) = a + b n

Method. A pair (a, b) measures each size by ping-pong: a sends n bytes to b, b sends them
back; after one warm-up round trip the one-way time is half the *median* of ``repeats`` round
trips (the median resists a scheduler hiccup on a loaded node). Inside nodes, the pair is the
node's two lowest ranks, and all nodes measure at once (their links are disjoint). Between
nodes, the root of node 0 pings the root of every other node in turn (one pair at a time: they
share node 0's link). Over several pairs the *worst* one is reported (max time per size),
because a collective waits for its slowest link. The Hockney fit ``t(n) = alpha + beta n``
over the sizes gives the per-message latency and the inverse bandwidth a cost model needs.

Command line (prints the dict as JSON on rank 0)::

    mpirun -np 8 python -m lsgd_hpc.netprobe [--ranks-per-node K] [--sizes 8 65536 1048576]

The probe's traffic goes straight through mpi4py: it is not counted in any ``CommStats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["probe_network", "probe_groups", "DEFAULT_SIZES", "DEFAULT_REPEATS"]

#: Message sizes in bytes: a latency-bound one, a mid-size one, a bandwidth-bound one.
DEFAULT_SIZES: Tuple[int, ...] = (8, 64 * 1024, 1024 * 1024)
DEFAULT_REPEATS = 10
_TAG = 7301  # a tag of its own, so probe messages never match anything else


def _ping_pong(comm, me: int, peer: int, initiator: bool, sizes: Sequence[int],
               repeats: int) -> List[float]:
    """One-way seconds per size between ``me`` and ``peer`` (only the initiator's are used)."""
    from mpi4py import MPI
    byte = MPI.BYTE
    out = []
    buf = np.zeros(max(sizes), dtype=np.uint8)
    for n in sizes:
        view = buf[:n]
        trips = []
        for i in range(repeats + 1):       # round 0 warms up the connection and caches
            if initiator:
                t0 = time.perf_counter()
                comm.Send([view, n, byte], dest=peer, tag=_TAG)
                comm.Recv([view, n, byte], source=peer, tag=_TAG)
                if i:
                    trips.append(time.perf_counter() - t0)
            else:
                comm.Recv([view, n, byte], source=peer, tag=_TAG)
                comm.Send([view, n, byte], dest=peer, tag=_TAG)
        out.append(statistics.median(trips) / 2 if trips else 0.0)
    return out


def _fit(sizes: Sequence[int], times: Sequence[float]) -> Tuple[float, float]:
    """Least-squares alpha, beta of t = alpha + beta * n (both clipped at 0: noise can make
    the intercept of a fast link slightly negative)."""
    if len(sizes) < 2:
        return float(times[0]), 0.0
    beta, alpha = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def _link(pairs: List[List[int]], per_pair: List[List[float]], sizes: Sequence[int]) -> Dict:
    worst = [max(t[k] for t in per_pair) for k in range(len(sizes))]
    alpha, beta = _fit(sizes, worst)
    return {"pairs": pairs, "one_way_s": worst, "latency_s": worst[0],
            "bandwidth_Bps": sizes[-1] / worst[-1] if worst[-1] > 0 else float("inf"),
            "alpha_s": alpha, "beta_s_per_byte": beta}


def probe_network(comm, node_of: Sequence[int], sizes: Sequence[int] = DEFAULT_SIZES,
                  repeats: int = DEFAULT_REPEATS) -> Dict:
    """Measure intra- and inter-node links of ``comm`` (see the module docstring)."""
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 1 for s in sizes) or sizes != sorted(sizes):
        raise ValueError(f"sizes must be positive and increasing, got {sizes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    me, size = comm.Get_rank(), comm.Get_size()
    node_of = [int(n) for n in node_of]
    if len(node_of) != size:
        raise ValueError(f"node_of has {len(node_of)} entries for {size} ranks")
    n_nodes = len(set(node_of))
    members: Dict[int, List[int]] = {}
    for r, n in enumerate(node_of):
        members.setdefault(n, []).append(r)
    nodes = sorted(members, key=lambda n: members[n][0])

    # Inside nodes: every node with two ranks at once.
    intra_pairs = [members[n][:2] for n in nodes if len(members[n]) >= 2]
    mine: Optional[List[float]] = None
    comm.Barrier()
    for a, b in intra_pairs:
        if me in (a, b):
            t = _ping_pong(comm, me, b if me == a else a, me == a, sizes, repeats)
            if me == a:
                mine = t
    intra_times = comm.gather(mine, root=0)

    # Between nodes: node 0's root with each other root, one pair at a time.
    roots = [members[n][0] for n in nodes]
    inter_pairs = [[roots[0], r] for r in roots[1:]]
    inter_times = []
    for a, b in inter_pairs:
        comm.Barrier()
        if me in (a, b):
            t = _ping_pong(comm, me, b if me == a else a, me == a, sizes, repeats)
            if me == a:
                inter_times.append(t)

    result = None
    if me == 0:
        # rank 0 is the root of node 0: it started every inter-node pair and holds their times
        intra_t = [intra_times[a] for a, _ in intra_pairs]
        result = {"sizes": sizes, "repeats": repeats, "n_nodes": n_nodes,
                  "intra": _link(intra_pairs, intra_t, sizes) if intra_pairs else None,
                  "inter": _link(inter_pairs, inter_times, sizes) if inter_pairs else None}
    return comm.bcast(result, root=0)


def probe_groups(groups, sizes: Sequence[int] = DEFAULT_SIZES,
                 repeats: int = DEFAULT_REPEATS) -> Dict:
    """:func:`probe_network` over a :class:`~lsgd_hpc.comm.groups.NodeGroups` whose world is
    an MPI backend communicator (the probe needs point-to-point messages)."""
    comm = getattr(groups.world, "comm", None)
    if comm is None:
        raise TypeError("probe_groups needs a NodeGroups built on the MPI backend "
                        "(its world communicator must expose .comm, an mpi4py communicator)")
    return probe_network(comm, groups.node_of, sizes, repeats)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lsgd_hpc.netprobe",
                                description="MPI ping-pong inside and between nodes (JSON).")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                   help="message sizes in bytes, increasing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="round trips per size; the median counts (default: %(default)s)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="group K consecutive ranks as one node (default: by host name)")
    args = p.parse_args(argv)
    import socket

    from mpi4py import MPI

    from lsgd_hpc.comm.groups import node_layout
    comm = MPI.COMM_WORLD
    try:
        node_of = node_layout(comm.allgather(socket.gethostname()), args.ranks_per_node)
        result = probe_network(comm, node_of, args.sizes, args.repeats)
    except ValueError as exc:  # checked before any message, alike on every rank
        if comm.Get_rank() == 0:
            print(f"lsgd_hpc.netprobe: error: {exc}")
        return 2
    if comm.Get_rank() == 0:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
