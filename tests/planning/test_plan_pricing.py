"""The planner's rho, --params, and its pricing of int4/int2 and top-k, against hand
computations (in-process, and ``python -m lsgd_hpc.plan``'s main() in this process)."""

import dataclasses
import json
import math

import pytest

from lsgd_hpc.planning import costmodel as cm
from lsgd_hpc.planning.plan import PlanInputs, WIRE_BYTES, main, params_facts, plan
from plan_util import plan_main

# 2 nodes of 4 ranks; between nodes 8 Gbit/s (beta 1e-9 s/byte), no latency
CLUSTER = ["--nodes", "2", "--ranks-per-node", "4", "--inter-gbps", "8",
           "--inter-latency-us", "0", "--intra-gbps", "800"]


plan_cli = plan_main


def plan_json(args):
    proc = plan_cli(args + ["--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def method(result, name):
    return next(m for m in result["methods"] if m["method"] == name)


# -- rho ---------------------------------------------------------------------------------------
def test_rho_by_hand():
    # 4 nodes x 2 ranks; 1000 parameters = 4000 fp32 bytes; inter alpha 10 us, beta 1 ns/byte
    c = cm.Cluster(4, 2, cm.Link(1e-6, 1e-11), cm.Link(1e-5, 1e-9))
    t = 2 * 3 * 1e-5 + 2 * 3 / 4 * 4000 * 1e-9          # 6.6e-5 s: one ring over 4 nodes
    assert cm.between_nodes_allreduce_time(4000, c) == pytest.approx(t)
    assert cm.rho(1000, c, 1e-3) == pytest.approx(t / 1e-3)
    # the intra-node link plays no part; one node: nothing crosses
    fast = cm.Cluster(4, 2, cm.Link(0.0, 0.0), cm.Link(1e-5, 1e-9))
    assert cm.rho(1000, fast, 1e-3) == pytest.approx(0.066)
    assert cm.rho(1000, cm.Cluster(1, 8, c.intra, c.inter), 1e-3) == 0.0


def test_plan_reports_rho_by_hand():
    inp = PlanInputs("custom", None, 4, 2, cm.Link(1e-6, 1e-11), cm.Link(1e-5, 1e-9), 1e-3,
                     "given", "given", None, math.inf, 0.1)
    r = plan(inp, params_facts(1000))["rho"]
    assert r["fp32_bytes"] == 4000
    assert r["allreduce_between_nodes_s"] == pytest.approx(6.6e-5)
    assert r["compute_s"] == 1e-3 and r["rho"] == pytest.approx(0.066)


def test_cli_rho_in_json_and_text():
    # 1e6 parameters = 4e6 bytes; 2 nodes: 2 (1/2) 4e6 x 1e-9 = 4 ms; step 10 ms: rho 0.4
    args = ["--params", "1e6", *CLUSTER, "--step-ms", "10"]
    r = plan_json(args)["rho"]
    assert r["allreduce_between_nodes_s"] == pytest.approx(4e-3)
    assert r["rho"] == pytest.approx(0.4)
    text = plan_cli(args).stdout
    assert "rho = 0.4:" in text
    # a zoo model: the same formula on its parameter count
    z = plan_json(["--model", "mlp", *CLUSTER, "--step-ms", "10"])
    n = z["inputs"]["n_params"]
    assert z["rho"]["rho"] == pytest.approx(4 * n * 1e-9 / 10e-3)


# -- --params ----------------------------------------------------------------------------------
def test_cli_params_accepted():
    result = plan_json(["--params", "1e9", "--nodes", "16", "--ranks-per-node", "8",
                        "--inter-gbps", "400", "--intra-gbps", "3600", "--step-ms", "120"])
    i = result["inputs"]
    assert i["n_params"] == 10 ** 9 and i["n_buffers"] == 0 and i["dataset"] is None
    assert i["step_s"] == pytest.approx(0.12) and i["step_source"] == "given"
    assert {m["method"] for m in result["methods"]} >= {"allreduce", "lsgd", "diloco"}
    # 4 GB over 400 Gbit/s, 16 nodes: 2 (15/16) 4e9 x 8 / 400e9 + 30 x 5 us = 150.15 ms
    assert result["rho"]["rho"] == pytest.approx((0.15 + 30 * 5e-6) / 0.12)


@pytest.mark.parametrize("args, needle", [
    (["--model", "mlp", *CLUSTER, "--tokens-per-step", "8"], "--tokens-per-step: for --params"),
    (["--params", "0", *CLUSTER, "--step-ms", "1"], "--params"),
    (["--params", "2.5", *CLUSTER, "--step-ms", "1"], "--params"),
    (["--params", "inf", *CLUSTER, "--step-ms", "1"], "--params"),
    (["--params", "nan", *CLUSTER, "--step-ms", "1"], "--params"),
    (["--params", "many", *CLUSTER, "--step-ms", "1"], "--params"),
    (["--params", "1e6", "--model", "mlp", *CLUSTER, "--step-ms", "1"], "exactly one"),
    ([*CLUSTER, "--step-ms", "1"], "exactly one"),
    (["--params", "1e6", "--dataset", "digits", *CLUSTER, "--step-ms", "1"], "--dataset"),
    (["--params", "1e6", "--nodes", "2", "--step-ms", "1"], "required without --measure"),
])
def test_cli_params_refused_one_line_exit_2(args, needle):
    p = plan_cli(args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


# -- int4, int2 and top-k ----------------------------------------------------------------------
def test_int4_int2_bytes_by_hand():
    # 8192 elements = 2 blocks of 4096: int4 4096 + 2 x 4 scale bytes, int2 2048 + 8
    assert 8192 * WIRE_BYTES["int4"] == 4104 and 8192 * WIRE_BYTES["int2"] == 2056
    c = cm.Cluster(2, 1, cm.Link(0.0, 0.0), cm.Link(0.0, 1e-9))
    for dtype, nbytes in (("int4", 4104), ("int2", 2056)):
        w = cm.Workload(8192, 0, 1.0, element_bytes=WIRE_BYTES[dtype], comm_dtype=dtype)
        d = cm.diloco(w, c, 4)                  # one rank a node: the flat compressed allreduce
        assert d.bytes_per_step == pytest.approx(nbytes / 4)
        assert d.comm_s == pytest.approx(nbytes * 1e-9 / 4)     # ring of 2: 2 (1/2) n beta


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_cli_int4_int2_bytes(dtype):
    result = plan_json(["--params", "8192", *CLUSTER, "--step-ms", "10", "--comm-dtype", dtype])
    nbytes = {"int4": 4104, "int2": 2056}[dtype]
    # 2 nodes x 4 ranks: hierarchical, the node roots exchange 4096 or 2048 bytes and 2 chunks x
    # 1 scale between the 2 nodes; mean over the 4 ranks of a node
    for name, period in (("diloco", "H"), ("local-sgd", "T")):
        m = method(result, name)
        assert m["bytes_per_step"] == pytest.approx(
            nbytes / 4 / result["recommended"][name][period])
    # allreduce SGD's gradient (issue 47): the same exchange every step, in one bucket
    assert method(result, "allreduce")["bytes_per_step"] == pytest.approx(nbytes / 4)


def test_topk_payload_by_hand():
    # 10000 elements: 3 chunks of 4096 (the last padded); k = ceil(0.01 x 4096) = 41
    # int2: 4 scale + 41 x 2 index + ceil(82 / 8) = 11 value bytes = 97 per chunk
    assert cm.topk_payload_bytes(10000, 0.01, 2) == 3 * (4 + 82 + 11)
    assert cm.topk_payload_bytes(10000, 0.01, 4) == 3 * (4 + 82 + 21)
    assert cm.topk_payload_bytes(10000, 0.01, 8) == 3 * (4 + 82 + 41)
    assert cm.topk_payload_bytes(10000, 0.01, 32) == 3 * (82 + 164)     # fp32: no scale
    assert cm.topk_payload_bytes(10000, 0.01, 16) == 3 * (82 + 82)      # bf16: no scale
    # fewer elements than a chunk: one chunk of n
    assert cm.topk_payload_bytes(100, 0.5, 2) == 4 + 50 * 2 + 13


def test_topk_payload_matches_the_package():
    from lsgd_hpc.comm import sparse
    assert cm.VALUE_BITS == sparse.VALUE_BITS and cm.TOPK_CHUNK == sparse.CHUNK
    for n in (1, 100, 4096, 10000, 123457):
        for f in (0.001, 0.01, 0.03, 0.5, 1.0):
            for kind, bits in cm.VALUE_BITS.items():
                assert cm.topk_payload_bytes(n, f, bits) == \
                    sparse.payload_bytes(n, 3, f, kind)[0], (n, f, kind)


def test_topk_periodic_methods_cost_by_hand():
    # 2 nodes x 2 ranks: hierarchical, as the package runs it: a float32 ring allreduce inside
    # the node (2 (1) 1e-6 + 2 (1/2) 40000 1e-10), then the 2 node roots' allgather of the
    # records, 1 step on the inter link; a root sends S, its neighbour nothing: S / 2 a rank
    c = cm.Cluster(2, 2, cm.Link(1e-6, 1e-10), cm.Link(1e-5, 1e-9))
    s = 3 * (4 + 82 + 11)                                       # 10000 elements, 1 %, int2
    w = cm.Workload(10000, 0, 1.0, element_bytes=WIRE_BYTES["int2"], topk=0.01, value_bits=2,
                    comm_dtype="int2")
    inside = 2e-6 + 40000 * 1e-10
    for cost in (cm.diloco(w, c, 4), cm.easgd(w, c, 4), cm.local_sgd(w, c, 4),
                 cm.slowmo(w, c, 4, 8)):
        assert cost.bytes_per_step == pytest.approx(s / 2 / 4)
        assert cost.comm_s == pytest.approx((inside + 1e-5 + s * 1e-9) / 4)
        assert "top-k 0.01" in cost.setting
    # dense (topk 1), int2 between the roots: 2500 bytes and 2 chunks x ceil(5000 / 4096) = 2
    # scales of 4 bytes (allreduce_bytes(10000, 2))
    dense = cm.local_sgd(dataclasses.replace(w, topk=1.0), c, 4)
    assert dense.bytes_per_step == pytest.approx((2500 + 4 * 2 * 2) / 2 / 4)
    assert dense.comm_s == pytest.approx((inside + 2 * 1e-5 + 2516 * 1e-9) / 4)
    # the flat allgather (one node, or one rank a node) is still there for the plan's users
    assert cm.ring_allgather_time(s, c) == pytest.approx(3 * (1e-5 + s * 1e-9))


def test_cli_topk_prices_the_averaging_methods():
    result = plan_json(["--params", "10000", *CLUSTER, "--step-ms", "10",
                        "--comm-dtype", "int2", "--topk", "0.01"])
    s = 3 * (4 + 82 + 11)
    rec = result["recommended"]
    # 2 nodes x 4 ranks: the node roots send S (top-k) or allreduce_bytes(10000, 2, int2) =
    # 2500 + 4 x 2 x 2 (dense), the other 3 ranks of a node nothing: / 4 a rank
    assert method(result, "diloco")["bytes_per_step"] == pytest.approx(s / 4 / rec["diloco"]["H"])
    assert method(result, "easgd")["bytes_per_step"] == pytest.approx(s / 4 / rec["easgd"]["tau"])
    assert method(result, "local-sgd")["bytes_per_step"] == pytest.approx(
        s / 4 / rec["local-sgd"]["T"])
    assert "top-k 0.01" in method(result, "slowmo")["setting"]
    # allreduce SGD's gradient (issue 47): the roots' top-k records every step (one bucket)
    assert "top-k 0.01" in method(result, "allreduce")["setting"]
    assert method(result, "allreduce")["bytes_per_step"] == pytest.approx(s / 4)
    # a zoo model with BatchNorm buffers: DiLoCo stays dense (the trainer refuses top-k)
    z = plan_json(["--model", "resnet20", *CLUSTER, "--step-ms", "10", "--topk", "0.01"])
    assert "top-k" not in method(z, "diloco")["setting"]
    assert "top-k 0.01" in method(z, "easgd")["setting"]


@pytest.mark.parametrize("args, needle", [
    (["--topk", "0"], "--topk"),
    (["--topk", "1.5"], "--topk"),
])
def test_cli_topk_refused(args, needle):
    p = plan_cli(["--params", "1e6", *CLUSTER, "--step-ms", "1", *args])
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


# -- compressed rounds in the methods' table: hierarchical or flat, as the package runs them --
INTRA, INTER = cm.Link(1e-6, 1e-11), cm.Link(1e-5, 1e-9)


def table(nodes, rpn, dtype, n=12 * 4096, step_s=0.01, intra=INTRA):
    inp = PlanInputs(params_facts(n).model, None, nodes, rpn, intra, INTER, step_s, "given",
                     "given", None, math.inf, 0.1, "auto", dtype)
    return plan(inp, params_facts(n))


def test_table_prices_int8_diloco_hierarchically_by_hand():
    # 4 nodes x 2 ranks, 49,152 elements (12 blocks of 4096), passes free. int8 between the 4
    # node roots: chunks of 12,288 = 3 blocks, B = 49,152 + 4 x 4 x 3 = 49,200 bytes
    n, B = 12 * 4096, 49_200
    inside = 2 * 1 * 1e-6 + 2 * (1 / 2) * 4 * n * 1e-11     # float32 ring over the node's 2
    between = 2 * 3 * 1e-5 + 2 * (3 / 4) * B * 1e-9         # int8 ring over the 4 roots
    result = table(4, 2, "int8")
    d = method(result, "diloco")
    H = result["recommended"]["diloco"]["H"]
    assert d["setting"] == f"H {H}"
    assert d["comm_s"] == pytest.approx((inside + between) / H)
    assert d["bytes_per_step"] == pytest.approx(B / 2 / H)      # the root sends B, the other 0
    # the same figure as --recommend's pricing of that candidate
    from lsgd_hpc.planning import recommend as rc
    w = cm.Workload(n, 0, 0.01)
    assert d["comm_s"] == pytest.approx(rc.diloco_cost(w, cm.Cluster(4, 2, INTRA, INTER), H,
                                                       "int8").comm_s)


def test_table_prices_a_single_node_flat_by_hand():
    # 1 node x 8 ranks: nothing crosses a node, the package runs the flat int8 allreduce over
    # all 8 ranks on the node's link: chunks of 6,144 = 2 blocks, B = 49,152 + 4 x 8 x 2
    B = 49_216
    intra = cm.Link(1e-6, 1e-9)
    result = table(1, 8, "int8", intra=intra)
    d = method(result, "diloco")
    H = result["recommended"]["diloco"]["H"]
    assert d["comm_s"] == pytest.approx((2 * 7 * 1e-6 + 2 * (7 / 8) * B * 1e-9) / H)
    assert d["bytes_per_step"] == pytest.approx(B / H)          # every rank sends B
    # one rank a node (4 x 1): flat over the 4 ranks on the network link, B = 49,200
    result = table(4, 1, "int8")
    d = method(result, "diloco")
    H = result["recommended"]["diloco"]["H"]
    assert d["comm_s"] == pytest.approx((2 * 3 * 1e-5 + 2 * (3 / 4) * 49_200 * 1e-9) / H)
    assert d["bytes_per_step"] == pytest.approx(49_200 / H)
