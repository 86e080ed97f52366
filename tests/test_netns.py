"""Ranks on two emulated nodes: Linux network namespaces with distinct host names.

NodeGroups groups ranks into nodes by socket.gethostname(); every other test runs all ranks on
one host and fakes nodes with --ranks-per-node. Here mpirun starts its daemons through a launch
agent (tests/netns/agent.sh, used in place of ssh) inside two network namespaces, each in its
own UTS namespace named nodeA / nodeB, joined by a bridge; ranks talk over real TCP between the
namespaces (shared memory within one). See /work/shared/ENVIRONMENT.md, "An emulated cluster
network on one machine". Needs root, `ip` and `unshare`; skips, naming what is missing, without.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from mpi_util import REPO, mpi_env, mpirun_cmd, run_group

NETNS_DIR = REPO / "tests" / "netns"
AGENT = NETNS_DIR / "agent.sh"
RANK_PROGRAM = NETNS_DIR / "rank_check.py"
NODES = ("nodeA", "nodeB")
RANKS_PER_HOST = 2
TIMEOUT_S = 120          # mpirun past this is killed (its whole process group) and fails

_NO_PERMISSION = ("Operation not permitted", "Permission denied")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc


def _free_subnet() -> str:
    """A 10.77.X.0/24 that no address or route on this machine touches; X depends on the pid,
    so concurrent runs tend to pick different ones."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    start = os.getpid() % 200
    for i in range(200):
        x = 20 + (start + i) % 200
        if f"10.77.{x}." not in used:
            return f"10.77.{x}"
    raise RuntimeError("no free 10.77.X.0/24 subnet")


@pytest.fixture
def two_namespaces():
    """Bridge (root namespace, PREFIX.1) + one namespace per node (PREFIX.2, PREFIX.3), each
    with a veth on the bridge and lo up. Yields {address: (namespace, host name)}, subnet."""
    if os.geteuid() != 0:
        pytest.skip(f"not root (euid {os.geteuid()}): creating network namespaces needs root")
    for binary in ("ip", "unshare"):
        if shutil.which(binary) is None:
            pytest.skip(f"no `{binary}` binary on PATH")

    tag = str(os.getpid())
    bridge = f"lsgdbr{tag}"
    namespaces, links = [], [bridge]
    try:
        prefix = _free_subnet()
        hosts = {}
        for i, name in enumerate(NODES):
            ns = f"lsgd-{tag}-{name}"
            proc = _ip("netns", "add", ns, check=False)
            if proc.returncode != 0:
                if any(s in proc.stderr for s in _NO_PERMISSION):
                    pytest.skip(f"`ip netns add` not permitted here: {proc.stderr.strip()}")
                raise RuntimeError(f"ip netns add {ns} failed: {proc.stderr.strip()}")
            namespaces.append(ns)
            hosts[f"{prefix}.{2 + i}"] = (ns, name)
        # Separate UTS namespaces (for distinct host names) must be allowed as well.
        probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True,
                               timeout=30)
        if probe.returncode != 0:
            if any(s in probe.stderr for s in _NO_PERMISSION):
                pytest.skip(f"`unshare --uts` not permitted here: {probe.stderr.strip()}")
            raise RuntimeError(f"unshare --uts true failed: {probe.stderr.strip()}")

        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (addr, (ns, name)) in enumerate(hosts.items()):
            outer, inner = f"lsgd{tag}{name[-1]}", f"lsgd{tag}{name[-1]}n"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            links.append(outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
        yield {"hosts": hosts, "subnet": f"{prefix}.0/24"}
    finally:
        # Deleting a namespace removes the veth end in it, and with it the peer on the bridge;
        # the link deletions below catch what is left when setup stopped half-way.
        for ns in namespaces:
            _ip("netns", "del", ns, check=False)
        for link in reversed(links):
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_node_groups_by_hostname_across_namespaces(two_namespaces):
    assert os.access(AGENT, os.X_OK), f"{AGENT} must be executable (chmod +x; git keeps mode 755)"
    hosts = two_namespaces["hosts"]
    expected = [name for _, name in hosts.values() for _ in range(RANKS_PER_HOST)]
    np_ = len(expected)
    host_list = ",".join(f"{addr}:{RANKS_PER_HOST}" for addr in hosts)
    env = mpi_env({
        "LSGD_NETNS_HOSTS": ",".join(f"{a}={ns}:{name}" for a, (ns, name) in hosts.items()),
    })
    assert "LSGD_HPC_RANKS_PER_NODE" not in env
    mpi_args = [
        "--host", host_list,
        "--prtemca", "plm_ssh_agent", str(AGENT),
        "--mca", "pml", "ob1",
        "--mca", "btl", "self,sm,tcp",
        "--mca", "btl_tcp_if_include", two_namespaces["subnet"],
        "--mca", "coll", "^han,xhc,acoll",
        "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED", "-x", "OMP_NUM_THREADS",
    ]
    cmd = mpirun_cmd(np_, [sys.executable, str(RANK_PROGRAM), ",".join(expected)], mpi_args)
    proc = run_group(cmd, env=env, cwd=REPO, timeout=TIMEOUT_S)
    log = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode is not None, f"mpirun across namespaces hung for {TIMEOUT_S} s\n{log}"
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}\n{log}"
    markers = sorted(re.findall(r"^NETNS-OK rank=(\d+) host=(\S+) node=(\d+)", proc.stdout,
                                re.M), key=lambda m: int(m[0]))
    assert [(int(r), h, int(n)) for r, h, n in markers] == \
        [(r, expected[r], r // RANKS_PER_HOST) for r in range(np_)], log
