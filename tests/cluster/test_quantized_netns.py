"""The compressed allreduce between two emulated nodes (scripts/cluster.sh network namespaces,
2 ranks each), its bytes read from the nodes' network interfaces: hierarchical int8, and
hierarchical top-k with int2 values and error feedback (lsgd_hpc.comm.quantized: node sums
over shared memory, the compressed exchange between the node roots only), against fp32's MPI
allreduce over the world. One job measures the three wires in turn (the fixture ``measured``,
run once for the module); each test reads its ratio to fp32 from it. Needs root and the
cluster's tools; skips, naming what is missing, without (tests/cluster/test_netns.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List

import pytest

from test_netns import NETNS_DIR, run_on_nodes

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

#: a 1000 x 1000 linear layer: 1 001 000 parameters, 4 MB in fp32 per outer allreduce
WIDTH = 1000
N = WIDTH * WIDTH + WIDTH
#: DiLoCo's 8 steps of H = 2 (tests/netns/diloco_bytes.py): 4 outer allreduces
OUTER = 4
#: the top-k wire: --topk 0.01 --comm-dtype int2 --error-feedback
TOPK = 0.01
#: the wires, as tests/netns/diloco_bytes.py takes them (KIND[:TOPK[:ef]])
WIRES = {"fp32": "fp32", "int8": "int8", "topk": f"int2:{TOPK}:ef"}
#: the job runs DiLoCo three times (mpirun is killed past this)
JOB_TIMEOUT_S = 360


@dataclasses.dataclass
class Measured:
    sent: Dict[str, List[int]]      # wire -> bytes node i sent through its interface
    counted: Dict[str, int]         # wire -> comm_bytes_sent of all ranks together
    log: str

    def total(self, wire: str) -> int:
        return sum(self.sent[wire])


@pytest.fixture(scope="module")
def measured(cluster_nodes) -> Measured:
    """DiLoCo, 8 steps of H = 2 (4 outer allreduces of 1 001 000 elements), in fp32, int8
    and top-k int2 with error feedback, one job: the bytes each node sent through its
    interface and the bytes the package counted, per wire; every rank ends each run with
    the same outer state."""
    proc, log = run_on_nodes(cluster_nodes, [NETNS_DIR / "diloco_bytes.py", WIDTH,
                                             *WIRES.values()], timeout=JOB_TIMEOUT_S)
    name = {spec: wire for wire, spec in WIRES.items()}
    found = re.findall(r"^BYTES wire=(\S+) sent=([\d,]+) counted=(\d+)", proc.stdout, re.M)
    sent = {name.get(w, w): [int(x) for x in s.split(",")] for w, s, _ in found}
    counted = {name.get(w, w): int(c) for w, _, c in found}
    assert set(sent) == set(WIRES) and all(len(v) == 2 for v in sent.values()), log
    digests = re.findall(r"^DIGEST wire=(\S+) same=(\w+)", proc.stdout, re.M)
    assert digests == [(spec, "True") for spec in WIRES.values()], log
    return Measured(sent, counted, log)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)          # (the module's job runs in the first test)
def test_int8_diloco_crosses_nodes_in_a_quarter_of_fp32s_bytes(measured):
    """int8: the bytes both nodes sent through their interfaces are at most 0.27 of fp32's
    (int8's quarter plus scales, headers and the small exact collectives; fp32's MPI
    allreduce crosses the node boundary with at least the payload); the bytes the package
    counts for int8 are those of the node roots' exchange (allreduce_bytes(n, 2) each way
    a root and outer allreduce)."""
    from lsgd_hpc.comm.quantized import allreduce_bytes
    sent, counted = measured.sent, measured.counted
    fp32, int8 = measured.total("fp32"), measured.total("int8")
    assert fp32 >= OUTER * 4 * N, (sent, measured.log)   # at least the payload crosses, each round
    ratio = int8 / fp32
    print(f"\nbytes between the nodes: fp32 {fp32}, int8 {int8}, ratio {ratio:.4f}; "
          f"counted: {counted}")
    assert ratio <= 0.27, (ratio, sent)
    # the roots' exchange: ceil(n) + 4 * 2 * b each way, each root, each outer allreduce
    # (what else the ranks count, the small exact collectives, is a few kB)
    exchange = 2 * OUTER * allreduce_bytes(N, 2)
    assert exchange <= counted["int8"] <= exchange + 65536, (counted, exchange)
    # through the interfaces: what each root sends the other (its half of phase 1 and its
    # reduced chunk in phase 2: allreduce_bytes(n, 2) with padding), plus TCP/IP headers
    assert exchange <= int8 <= 1.1 * exchange + 200_000, (int8, exchange)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_topk_int2_diloco_crosses_nodes_in_a_hundredth_of_fp32s_bytes(measured):
    """Top-k 0.01, int2 values, error feedback: the bytes both nodes sent through their
    interfaces are at most 0.01 of fp32's. The formula (lsgd_hpc/comm/sparse.py): chunks of
    c = 4096, m = ceil(n / c) = 245, k = ceil(0.01 c) = 41 a chunk; S = m (2 k + ceil(2 k /
    8) + 4) = 245 (82 + 11 + 4) = 23 765 bytes a root and outer allreduce (the allgather
    between the 2 roots: each sends its message once), S / 4n = 0.0059 of fp32's payload;
    on the wire each record is padded to 4 bytes (100, so 24 500 a message). What crossed is
    not less than the roots' padded messages (a measurement that missed traffic would be),
    and the package counts S a root and round (plus the small exact collectives)."""
    from lsgd_hpc.comm.sparse import payload_bytes, sparse_layout
    lay = sparse_layout(N, TOPK, "int2")
    s, received = payload_bytes(N, 2, TOPK, "int2")
    assert (lay.m, lay.k, lay.record, s, received) == (245, 41, 100, 23765, 23765), lay
    payload = 2 * OUTER * s                      # both roots, each outer allreduce: S once
    messages = 2 * OUTER * lay.m * lay.record    # the same with the records' padding
    sent, counted = measured.sent, measured.counted
    fp32, topk = measured.total("fp32"), measured.total("topk")
    ratio = topk / fp32
    numbers = (f"bytes between the nodes: fp32 {fp32} {sent['fp32']}, topk+int2 {topk} "
               f"{sent['topk']}, ratio {ratio:.5f} (bound 0.01); formula: payload {payload} "
               f"(S / 4n = {s / (4 * N):.5f}, {payload / fp32:.5f} of the measured fp32), "
               f"padded messages {messages}; counted {counted['topk']}")
    print("\n" + numbers)
    assert fp32 >= OUTER * 4 * N, numbers
    assert ratio <= 0.01, numbers
    assert topk >= messages >= payload, numbers
    for node_sent in sent["topk"]:               # each node: its root's messages at least
        assert node_sent >= OUTER * lay.m * lay.record, numbers
    assert payload <= counted["topk"] <= payload + 65536, numbers
