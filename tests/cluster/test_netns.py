"""Ranks on two emulated nodes: network namespaces with their own host names (scripts/cluster.sh).

NodeGroups groups ranks into nodes by socket.gethostname(); every other test runs all ranks on
one host and fakes nodes with --ranks-per-node. Here mpirun starts its daemons through the
cluster's launch agent (used in place of ssh) inside two network namespaces named
<cluster>-node0 / -node1, joined by a bridge; ranks talk over real TCP between the namespaces
(shared memory within one), so what crosses a node boundary goes through a network interface
whose counters can be read. Needs root, `ip`, `unshare` and `nsenter`; skips, naming what is
missing, without (and with CI=true that skip is a failure).
"""

from __future__ import annotations

import re
import sys

import pytest

from mpi_util import REPO, mpi_env, mpirun_cmd, mpirun_path, run_group

NETNS_DIR = REPO / "tests" / "netns"
RANKS_PER_NODE = 2
TIMEOUT_S = 240          # mpirun past this is killed (its whole process group) and fails

pytestmark = [pytest.mark.netns, pytest.mark.mpi]


def run_on_nodes(cluster, program: list, timeout: float = TIMEOUT_S):
    nodes = cluster.nodes[:2]
    assert len(nodes) == 2, cluster.nodes
    env = mpi_env()
    assert "LSGD_HPC_RANKS_PER_NODE" not in env
    args = [*cluster.mpirun_args(RANKS_PER_NODE), "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
            "-x", "OMP_NUM_THREADS"]
    # Only the first two nodes (the cluster may have more): --host lists every node.
    hosts = ",".join(f"{a}:{RANKS_PER_NODE}" for a in cluster.addrs[:2])
    args[args.index("--host") + 1] = hosts
    cmd = mpirun_cmd(2 * RANKS_PER_NODE, [sys.executable, *map(str, program)], args)
    proc = run_group(cmd, env=env, cwd=REPO, timeout=timeout)
    log = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode is not None, f"mpirun across namespaces hung for {timeout} s\n{log}"
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}\n{log}"
    return proc, log


@pytest.mark.timeout(300)
def test_node_groups_by_hostname_across_namespaces(cluster_nodes):
    expected = [name for name in cluster_nodes.nodes[:2] for _ in range(RANKS_PER_NODE)]
    proc, log = run_on_nodes(cluster_nodes, [NETNS_DIR / "rank_check.py", ",".join(expected)])
    markers = sorted(re.findall(r"^NETNS-OK rank=(\d+) host=(\S+) node=(\d+)", proc.stdout,
                                re.M), key=lambda m: int(m[0]))
    assert [(int(r), h, int(n)) for r, h, n in markers] == \
        [(r, expected[r], r // RANKS_PER_NODE) for r in range(len(expected))], log


@pytest.mark.timeout(300)
def test_mpirun_args_pin_the_layout_over_an_env_mapping_policy(cluster_nodes):
    """With a mapping policy in the environment (a site or a user may set one), mpirun once
    put all four ranks on node0 through `mpirun $(cluster.sh mpirun-args --ranks-per-node 2)
    -np 4`: the --host slots alone lose to it. mpirun-args pins --map-by ppr:2:node."""
    args = cluster_nodes.mpirun_args(RANKS_PER_NODE)
    assert args[args.index("--map-by") + 1] == f"ppr:{RANKS_PER_NODE}:node", args
    program = ["-c", "import os, socket; print('HOST', os.environ['OMPI_COMM_WORLD_RANK'], "
                     "socket.gethostname(), flush=True)"]
    # As a user types it: mpirun_cmd's --oversubscribe would itself override the env policy.
    hosts = ",".join(f"{a}:{RANKS_PER_NODE}" for a in cluster_nodes.addrs[:2])
    args[args.index("--host") + 1] = hosts
    cmd = [mpirun_path(), *args, "-x", "PYTHONPATH", "-np", str(2 * RANKS_PER_NODE),
           sys.executable, *program]
    env = mpi_env({"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"})
    proc = run_group(cmd, env=env, cwd=REPO, timeout=TIMEOUT_S)
    log = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}\n{log}"
    hosts = dict((int(r), h) for r, h in re.findall(r"^HOST (\d+) (\S+)$", proc.stdout, re.M))
    expected = {r: cluster_nodes.nodes[r // RANKS_PER_NODE] for r in range(2 * RANKS_PER_NODE)}
    assert hosts == expected, log


#: 250,000 float32 = 1 MB per broadcast. (At 8 MB Open MPI switches to a pipelined flat
#: broadcast that crosses 1.5 times per broadcast on average over the 4 leaders instead of 2;
#: the hierarchical one still crosses exactly once.)
BROADCAST_NUMEL = 250_000


@pytest.mark.timeout(300)
def test_hierarchical_broadcast_crosses_nodes_once(cluster_nodes):
    """Bytes each node sent through its own network interface while every rank in turn
    broadcast 1 MB: the hierarchical broadcast moves the buffer across the node boundary
    once per broadcast; a flat MPI broadcast over the world (binomial tree) crosses twice on
    average (leaders that are not a node's first rank send across two or three times), so
    the hierarchical one sends about half as much between the nodes."""
    proc, log = run_on_nodes(cluster_nodes, [NETNS_DIR / "broadcast_bytes.py", BROADCAST_NUMEL])
    sent = {m: [int(x) for x in s.split(",")]
            for m, s in re.findall(r"^BYTES method=(\w+) sent=([\d,]+)", proc.stdout, re.M)}
    assert set(sent) == {"hierarchical", "flat"} and all(len(v) == 2 for v in sent.values()), log
    payload = 4 * BROADCAST_NUMEL * 2 * RANKS_PER_NODE      # one copy per broadcast, 4 leaders
    hier, flat = sum(sent["hierarchical"]), sum(sent["flat"])
    # Once across per broadcast: the payload plus TCP/IP headers (a few %), no second copy.
    assert payload <= hier <= 1.1 * payload, (hier, payload, sent)
    # Each node sends its own leaders' two broadcasts once: half the payload each.
    for node_sent in sent["hierarchical"]:
        assert payload / 2 <= node_sent <= 1.1 * payload / 2, sent
    assert 1.8 * payload <= flat, (flat, payload, sent)
    assert 0.4 <= hier / flat <= 0.6, (hier / flat, sent)
