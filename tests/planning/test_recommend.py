"""The planner's pricing of hierarchical compression, top-k, Streaming DiLoCo's overlap and
LSGD's delayed, compressed pull (lsgd_hpc.planning.recommend) against hand computations, and
its recommendation (``python -m lsgd_hpc.plan --recommend``)."""

import json
import math
import subprocess
import sys

import pytest

from lsgd_hpc.planning import costmodel as cm
from lsgd_hpc.planning import recommend as rc
from lsgd_hpc.planning.plan import main

# 4 nodes x 2 ranks; inside a node alpha 1 us, beta 1e-11 s/byte; between nodes alpha 10 us,
# beta 1 ns/byte (8 Gbit/s); elementwise passes free
C = cm.Cluster(4, 2, cm.Link(1e-6, 1e-11), cm.Link(1e-5, 1e-9))


def test_hierarchical_int8_by_hand():
    n = 12 * 4096                     # 12 blocks of 4096: 49,152 elements, 196,608 fp32 bytes
    # int8 between nodes: one byte an element (0.25 of fp32) + one 4-byte scale per block
    b = n + 4 * 12
    assert rc.wire_bytes(n, 4, "int8") == b == 49_200
    inside = 2 * 1 * 1e-6 + 2 * 1 / 2 * 4 * n * 1e-11          # fp32 ring over the 2 ranks
    between = 2 * 3 * 1e-5 + 2 * 3 / 4 * b * 1e-9              # int8 ring over the 4 nodes
    assert rc.hier_allreduce_time(n, C, "int8") == pytest.approx(inside + between)
    w = cm.Workload(n, 0, 0.01)
    d = rc.diloco_cost(w, C, 16, "int8")
    assert d.comm_s == pytest.approx((inside + between) / 16)
    assert d.step_s == pytest.approx(0.01 + (inside + between) / 16)
    # int4 and int2: an eighth and a sixteenth of fp32, the same scales
    assert rc.wire_bytes(n, 4, "int4") == n // 2 + 48
    assert rc.wire_bytes(n, 4, "int2") == n // 4 + 48
    # fp32 dense is the package's own allreduce (the fastest algorithm), as the methods' table
    assert rc.diloco_cost(w, C, 16).comm_s == pytest.approx(cm.allreduce_time(4 * n, C) / 16)


def test_topk_by_hand():
    n = 10 * 4096                     # 10 chunks
    k = 41                            # ceil(0.01 * 4096)
    s_int2 = 10 * (4 + 2 * k + math.ceil(k * 2 / 8))             # scale, int16 index, 2 bits
    s_fp32 = 10 * (2 * k + 4 * k)                                # no scale for fp32 values
    assert rc.wire_bytes(n, 4, "int2", 0.01) == s_int2 == 970
    assert rc.wire_bytes(n, 4, "fp32", 0.01) == s_fp32 == 2460
    inside = 2 * 1e-6 + 4 * n * 1e-11
    between = 3 * (1e-5 + s_int2 * 1e-9)                         # allgather of the records
    assert rc.hier_allreduce_time(n, C, "int2", 0.01) == pytest.approx(inside + between)
    w = cm.Workload(n, 0, 0.01)
    assert rc.easgd_cost(w, C, 4, "int2", 0.01).comm_s == pytest.approx((inside + between) / 4)
    # LSGD's compressed pull: the top-k records of the parameters, broadcast
    assert rc.pull_bytes(n, "int2", 0.01) == s_int2
    one = cm.Cluster(4, 1, C.intra, C.inter)                    # single leader, flat broadcast
    t = rc.lsgd_cost(w, one, 8, 8, 0, "int2", 0.01).comm_s
    want = (cm.election_time(one) + cm.broadcast_time(s_int2, 4, one.inter)) / 8
    assert t == pytest.approx(want)


def test_overlap_hides_up_to_the_delay():
    n = 10 * 4096
    w = cm.Workload(n, 0, 1e-4)
    # Streaming DiLoCo: P fragments of n / P, each exposed beyond tau steps of compute (fp32:
    # the package's own allreduce of the fragment)
    frag = cm.allreduce_time(4 * (n // 4), C)
    for delay in (0, 1, 3):
        got = rc.streaming_diloco_cost(w, C, 16, 4, delay).comm_s
        assert got == pytest.approx(4 * max(0.0, frag - delay * 1e-4) / 16)
    with pytest.raises(ValueError):
        rc.streaming_diloco_cost(w, C, 16, 4, 4)                 # delay must be < H / P
    # LSGD's pull delay: a long enough delay leaves the elections only
    slow = cm.Workload(n, 0, 10.0)
    hidden = rc.lsgd_cost(slow, C, 4, 8, 3)
    assert hidden.comm_s == pytest.approx(cm.election_time(C, "node") / 4
                                          + cm.election_time(C) / 8)
    assert rc.lsgd_cost(slow, C, 4, 8, 0).comm_s > hidden.comm_s
    # no delay, fp32: costmodel's LSGD
    assert rc.lsgd_cost(w, C, 4, 8).comm_s == pytest.approx(cm.lsgd(w, C, 4, 8).comm_s)


def _cluster(gbps):
    return cm.Cluster(4, 8, cm.Link.from_gbps(2400, 2), cm.Link.from_gbps(gbps, 5),
                      mem_Bps=1.5e12)


def test_recommendation_follows_rho():
    # rho << 1 (10 M parameters over 400 Gbit/s, 120 ms a step): allreduce or LSGD
    small = rc.recommend(cm.Workload(10 ** 7, 0, 0.12), _cluster(400))
    assert cm.rho(10 ** 7, _cluster(400), 0.12) < 0.05
    assert small["recommended"]["method"] in ("allreduce", "lsgd")
    assert small["recommended"]["wire_fraction"] == 1.0
    # rho ~ 400 (1e9 parameters over 1 Gbit/s): a compressed periodic method
    big_c = _cluster(1)
    assert 300 <= cm.rho(10 ** 9, big_c, 0.12) <= 500
    big = rc.recommend(cm.Workload(10 ** 9, 0, 0.12), big_c)
    best = big["recommended"]
    assert best["method"] != "allreduce" and best["period"] > 1
    assert best["wire_fraction"] < 0.25
    assert best["step_s"] <= big["fastest_step_s"] * 1.05 + 1e-12
    # the guard holds for every candidate; a tighter one is obeyed
    assert best["period"] <= 500 and (best["topk"] >= 0.01)
    tight = rc.recommend(cm.Workload(10 ** 9, 0, 0.12), big_c, max_period=16, min_topk=0.03)
    assert tight["recommended"]["period"] <= 16 and tight["recommended"]["topk"] >= 0.03
    for r in tight["runners_up"]:
        assert r["period"] <= 16 and r["topk"] >= 0.03


PLAN = [sys.executable, "-m", "lsgd_hpc.plan"]
BIG = ["--params", "1e9", "--step-ms", "120", "--nodes", "4", "--ranks-per-node", "8",
       "--inter-gbps", "10", "--intra-gbps", "2400"]


def test_cli_recommend_json_has_the_fields():
    p = subprocess.run(PLAN + BIG + ["--recommend", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)["recommendation"]
    assert rec["rho"] == pytest.approx(40, rel=1e-3)
    for key in ("rule", "slack", "max_period", "min_topk", "candidates", "fastest_step_s",
                "recommended", "runners_up"):
        assert key in rec, key
    best = rec["recommended"]
    for key in ("method", "period", "comm_dtype", "topk", "step_s", "comm_s", "comm_share",
                "comm_ratio", "wire_bytes_per_step", "options", "args"):
        assert key in best, key
    assert best["args"].startswith("--algorithm ")
    assert any(r["method"] == "allreduce" for r in rec["runners_up"])


def test_cli_recommend_text(capsys):
    assert main(BIG + ["--recommend", "--inter-gbps", "1"]) == 0
    out = capsys.readouterr().out
    assert "method candidates (rho 400)" in out and "wire/step" in out and "baseline" in out
    # one answer: the last "recommended:" line, its command the candidates' first by the rule
    said = [ln for ln in out.splitlines() if "recommended" in ln.lower()]
    assert len(said) == 1 and said[0].startswith("recommended: "), said
    lines = out.splitlines()
    command = lines[lines.index(said[0]) + 1].strip()
    assert command.startswith("mpirun -np 32 --map-by ppr:8:node python -m lsgd_hpc.train "
                              "--algorithm ")
    first = next(ln for ln in lines if ln.endswith("first by the rule"))
    assert first.split()[0] in said[0]


@pytest.mark.parametrize("extra, needle", [
    (["--topk", "0"], "--topk"),
    (["--nodes", "0"], "--nodes"),
    (["--recommend-slack", "1"], "--recommend-slack"),
    (["--max-period", "0"], "--max-period"),
    (["--min-topk", "0"], "--min-topk"),
    (["--worker-ranks", "node"], "--recommend"),
])
def test_cli_recommend_bad_input_one_line_exit_2(extra, needle, capsys):
    assert main(BIG + ["--recommend"] + extra) == 2
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err.err
    assert err.out == ""


def test_lsgd_compressed_global_pull_multi_leader_by_hand():
    # 4 nodes x 2 ranks: the local pull is int8's dense broadcast inside the node, the global
    # pull the top-k records, broadcast hierarchically (once across each node's link)
    n = 10 * 4096
    w = cm.Workload(n, 0, 0.01)
    b_loc = rc.pull_bytes(n, "int8")
    s = rc.pull_bytes(n, "int8", 0.01)
    assert b_loc == n + 4 * 10 and s == 10 * (4 + 2 * 41 + 41)
    local = cm.election_time(C, "node") + cm.broadcast_time(b_loc, 2, C.intra)
    glob = cm.election_time(C) + cm.hierarchical_broadcast_time(s, C)
    got = rc.lsgd_cost(w, C, 4, 8, 0, "int8", 0.01)
    assert got.comm_s == pytest.approx(local / 4 + glob / 8)
    # a pull delay of 1 step: the records (bytes in a non-blocking broadcast) hide behind
    # its compute as fp32 does; the local pull, a dense int8 broadcast, hides nothing
    delayed = rc.lsgd_cost(w, C, 4, 8, 1, "int8", 0.01)
    hidden = max(0.0, cm.hierarchical_broadcast_time(s, C) - w.compute_s)
    assert delayed.comm_s == pytest.approx(local / 4 + (cm.election_time(C) + hidden) / 8)
    assert delayed.comm_s < got.comm_s


def test_compressed_allreduce_hides_compressed_broadcast_only_when_assumed():
    n = 10 * 4096
    w = cm.Workload(n, 0, 1.0)            # a long step: any overlap hides the whole round
    assert rc.streaming_diloco_cost(w, C, 16, 4, 3).comm_s == 0.0            # fp32 hides
    # the compressed allreduce is staged non-blocking: it hides as fp32 does
    assert rc.streaming_diloco_cost(w, C, 16, 4, 3, "int8").comm_s == 0.0
    assert rc.streaming_diloco_cost(w, C, 16, 4, 0, "int8").comm_s > 0.0     # no delay, no hiding
    # LSGD's int8 pull is a compressed broadcast, which runs at once: a delay hides nothing
    # of it unless assumed
    shown = rc.lsgd_cost(w, C, 4, 8, 2, "int8").comm_s
    assert shown > rc.lsgd_cost(w, C, 4, 8, 2, "int8", compressed_overlap=True).comm_s
    assert shown == pytest.approx(rc.lsgd_cost(w, C, 4, 8, 0, "int8").comm_s)


def test_methods_table_prices_lsgd_topk_pull(capsys):
    # 2 nodes x 4 ranks, 10,000 parameters: the local pull is int2's dense broadcast (2,500
    # bytes + 3 scales), the global pull the top-k records (3 chunks of 4 + 2 41 + 11 bytes)
    args = ["--params", "10000", "--step-ms", "10", "--nodes", "2", "--ranks-per-node", "4",
            "--inter-gbps", "8", "--intra-gbps", "800", "--comm-dtype", "int2",
            "--topk", "0.01", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    lsgd = next(m for m in doc["methods"] if m["method"] == "lsgd")
    tau_l, tau_g = (doc["recommended"]["lsgd"][k] for k in ("tau_local", "tau_global"))
    assert "top-k 0.01" in lsgd["setting"]
    b_loc, s = 2500 + 4 * 3, 3 * (4 + 82 + 11)
    assert lsgd["bytes_per_step"] == pytest.approx(b_loc / 4 / tau_l + 3 * s / 8 / tau_g)


def test_command_line_of_each_compressor_is_one_the_trainer_accepts():
    """The recommendation's command line: error feedback with every compressor but LSGD's
    pull; top-k DiLoCo in SparseLoCo's form (outer momentum 0, outer lr 1, residual decay
    0.95); and the trainer parses each line without a refusal."""
    from lsgd_hpc.cli.config import parse_config
    from lsgd_hpc.planning.recommend import _args
    sparse = _args("diloco", {"H": 64}, "int2", 0.01)
    assert sparse.split() == ["--algorithm", "diloco", "--local-steps", "64", "--comm-dtype",
                              "int2", "--topk", "0.01", "--error-feedback", "--outer-momentum",
                              "0", "--outer-lr", "1", "--error-feedback-decay", "0.95"]
    assert "--error-feedback-decay" not in _args("diloco", {"H": 64}, "int8", 1.0)
    assert "--error-feedback" not in _args("lsgd", {"tau_local": 4, "tau_global": 16},
                                           "int8", 0.01)
    for line in (sparse, _args("streaming-diloco", {"H": 64, "fragments": 4, "sync_delay": 1},
                               "int4", 0.01),
                 _args("lsgd", {"tau_local": 4, "tau_global": 16, "pull_delay": 2}, "int8",
                       0.01)):
        cfg = parse_config(line.split(), env={})
        assert cfg.topk == 0.01
