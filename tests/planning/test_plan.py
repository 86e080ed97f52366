"""The cost model on constructed inputs (hand-computed values, limiting cases), its bytes against
a real 4-rank run's counters, and the planner's command line (python -m lsgd_hpc.plan), with
--measure under mpirun -np 2 and -np 4."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from lsgd_hpc.planning import costmodel as cm
from mpi_util import REPO, mpi_env, run_mpi
from plan_util import plan_main

A, B = 1e-6, 1e-9                  # 1 us, 1 GB/s
LINK = cm.Link(A, B)
FAST = cm.Link(0.0, 0.0)
N_BYTES = 1e6


def cluster(nodes, q, intra=LINK, inter=LINK, **kw):
    return cm.Cluster(nodes, q, intra, inter, **kw)


# -- collectives ---------------------------------------------------------------------------------
def test_link_from_gbps():
    link = cm.Link.from_gbps(8, 5)          # 8 Gbit/s = 1 GB/s
    assert link.alpha_s == pytest.approx(5e-6)
    assert link.beta_s == pytest.approx(1e-9)
    assert link.gbps == pytest.approx(8)
    assert cm.Link.from_gbps(math.inf, 0).beta_s == 0


def test_single_link_collectives_by_hand():
    # ring: 2 (g-1) alpha + 2 (g-1)/g n beta = 6 us + 1.5 ms
    assert cm.ring_allreduce(N_BYTES, 4, LINK) == pytest.approx(6e-6 + 1.5e-3)
    # recursive doubling: 2 (alpha + n beta)
    assert cm.doubling_allreduce(N_BYTES, 4, LINK) == pytest.approx(2 * (1e-6 + 1e-3))
    # binomial broadcast over 5 ranks: ceil(log2 5) = 3 steps
    assert cm.binomial_broadcast(N_BYTES, 5, LINK) == pytest.approx(3 * (1e-6 + 1e-3))
    # scatter-allgather over 8: (3 + 7) alpha + 2 * 7/8 n beta
    assert cm.scatter_allgather_broadcast(N_BYTES, 8, LINK) == pytest.approx(10e-6 + 1.75e-3)
    assert cm.broadcast_time(N_BYTES, 8, LINK) == pytest.approx(1.76e-3)
    for f in (cm.ring_allreduce, cm.doubling_allreduce, cm.binomial_broadcast,
              cm.scatter_allgather_broadcast, cm.broadcast_time):
        assert f(N_BYTES, 1, LINK) == 0


def test_cluster_allreduce_algorithms_by_hand():
    intra, inter = cm.Link(1e-6, 1e-10), cm.Link(1e-5, 1e-9)
    c = cluster(2, 2, intra, inter)
    ring = cm.allreduce_time(N_BYTES, c, cm.Collectives("ring"))
    hier = cm.allreduce_time(N_BYTES, c, cm.Collectives("hierarchical"))
    dbl = cm.allreduce_time(N_BYTES, c, cm.Collectives("doubling"))
    # flat ring over 4: 6 alpha_e + 1.5 n beta_e
    assert ring == pytest.approx(6e-5 + 1.5e-3)
    # inside (2 alpha_i + n beta_i) + between (2 alpha_e + n beta_e)
    assert hier == pytest.approx(2e-6 + 1e-4 + 2e-5 + 1e-3)
    # one step inside (alpha_i + n beta_i), one between, both ranks sending (alpha_e + 2 n beta_e)
    assert dbl == pytest.approx(1e-6 + 1e-4 + 1e-5 + 2e-3)
    assert cm.allreduce_time(N_BYTES, c) == pytest.approx(min(ring, hier, dbl)) == hier
    with pytest.raises(ValueError):
        cm.Collectives("butterfly")


def test_one_node_never_touches_the_network():
    w = cm.Workload(250_000, 100, 0.01)
    slow, fast = cluster(1, 8, inter=cm.Link(1.0, 1.0)), cluster(1, 8, inter=FAST)
    for method, kw in (("allreduce", {}), ("lsgd", dict(tau_local=2, tau_global=4)),
                       ("easgd", dict(easgd_tau=4)), ("local-sgd", dict(local_steps=4)),
                       ("diloco", dict(local_steps=4)),
                       ("slowmo", dict(local_steps=2, slowmo_every=8)),
                       ("gossip", dict(topology="exponential"))):
        a = cm.method_cost(method, w, slow, kw)
        b = cm.method_cost(method, w, fast, kw)
        assert a.comm_s == pytest.approx(b.comm_s) and a.comm_s > 0, method


def test_one_rank_costs_nothing():
    w = cm.Workload(1000, 0, 0.02)
    for method in ("allreduce", "lsgd", "easgd", "local-sgd", "diloco", "slowmo", "gossip"):
        r = cm.method_cost(method, w, cluster(1, 1))
        assert r.comm_s == 0 and r.step_s == 0.02 and r.comm_share == 0, method


def test_infinite_bandwidth_leaves_only_latency():
    c = cluster(1, 4, intra=cm.Link(A, 0.0))
    # doubling wins: log2 4 = 2 latencies, whatever the size
    assert cm.allreduce_time(1e12, c) == pytest.approx(2 * A)
    # LSGD, one node, tau 1: election (2 alpha) + binomial broadcast (2 alpha)
    w = cm.Workload(10 ** 9, 0, 0.0)
    assert cm.lsgd(w, c, 1, 1).comm_s == pytest.approx(4 * A)


def test_periods_amortise_exactly():
    w = cm.Workload(500_000, 2000, 0.05)
    c = cluster(4, 4, cm.Link(2e-6, 1e-11), cm.Link(5e-6, 8e-11), mem_Bps=1e12, checks=True,
                call_overhead_s=3e-5)
    assert cm.lsgd(w, c, 8, 32).comm_s == pytest.approx(cm.lsgd(w, c, 1, 4).comm_s / 8)
    assert cm.local_sgd(w, c, 16).comm_s == pytest.approx(cm.local_sgd(w, c, 1).comm_s / 16)
    assert cm.easgd(w, c, 5).comm_s == pytest.approx(cm.easgd(w, c, 1).comm_s / 5)
    assert cm.local_sgd(w, c, 16).bytes_per_step == pytest.approx(w.flat_bytes / 16)
    with pytest.raises(ValueError):
        cm.lsgd(w, c, 3, 4)


def test_local_sgd_T1_is_one_allreduce_of_the_model_like_easgd_tau1():
    w = cm.Workload(300_000, 0, 0.01)
    c = cluster(4, 2, cm.Link(1e-6, 1e-11), cm.Link(5e-6, 1e-10))
    t = cm.allreduce_time(w.flat_bytes, c)
    assert cm.local_sgd(w, c, 1).comm_s == pytest.approx(t)
    assert cm.easgd(w, c, 1).comm_s == pytest.approx(t)
    # allreduce SGD of a model without buffers: the same allreduce, every step
    assert cm.allreduce_sgd(w, c).comm_s == pytest.approx(t)
    # overlap hides up to that fraction of compute
    assert cm.allreduce_sgd(w, c, overlap=1.0).comm_s == pytest.approx(max(0.0, t - 0.01))
    # 3 buckets: three allreduces of a third each (more latency, the same bytes)
    b = cm.allreduce_sgd(w, c, bucket_bytes=w.grad_bytes / 3)
    assert b.comm_s == pytest.approx(3 * cm.allreduce_time(w.grad_bytes / 3, c)) and b.comm_s > t
    assert b.bytes_per_step == w.grad_bytes and "3 buckets" in b.setting


def test_hierarchical_broadcast_crosses_each_node_once():
    """With free links inside nodes, the global broadcast costs one broadcast among the node
    roots, however many ranks each node holds."""
    inter = cm.Link(5e-6, 1e-9)
    costs = [cm.hierarchical_broadcast_time(N_BYTES, cluster(8, q, FAST, inter))
             for q in (1, 2, 8, 64)]
    assert costs == pytest.approx([cm.broadcast_time(N_BYTES, 8, inter)] * 4)
    # and a broadcast over all 8 x 8 ranks on the network link alone would cost more
    assert cm.broadcast_time(N_BYTES, 64, inter) > costs[0]


def test_lsgd_multi_leader_by_hand():
    """2 nodes x 2 ranks, free memory passes, no software cost: local round = node election
    (recursive doubling of 16 bytes: one step) + node broadcast (alpha_i + n beta_i); global
    round = world election (one step inside, one between with both ranks of a node sending)
    + (1/2) node broadcast + roots broadcast + node broadcast."""
    intra, inter = cm.Link(1e-6, 1e-10), cm.Link(1e-5, 1e-9)
    n = 1_000_000
    w = cm.Workload(n // 4, 0, 0.1)
    c = cluster(2, 2, intra, inter)
    b_in, b_out = 1e-6 + n * 1e-10, 1e-5 + n * 1e-9
    e_node = 1e-6 + 16 * 1e-10
    e_world = e_node + 1e-5 + 2 * 16 * 1e-9
    local = e_node + b_in
    glob = e_world + 0.5 * b_in + b_out + b_in
    r = cm.lsgd(w, c, 2, 4)
    assert r.comm_s == pytest.approx(local / 2 + glob / 4)
    assert r.bytes_per_step == pytest.approx(n / 2 / 2 + 3 * n / 4 / 4)
    assert "tau_L 2" in r.setting


def test_gossip_bytes_and_shared_node_link():
    w = cm.Workload(1000, 0, 0.0)
    n = w.flat_bytes
    inter = cm.Link(0.0, 1e-9)
    c = cluster(4, 2, FAST, inter)
    ring = cm.gossip(w, c, "ring")
    # every rank sends to 2 neighbours; each node has 2 edges leaving it -> 2 n on its link
    assert ring.bytes_per_step == pytest.approx(2 * n)
    assert ring.comm_s == pytest.approx(2 * n * 1e-9)
    complete = cm.gossip(w, c, "complete")
    assert complete.bytes_per_step == pytest.approx(7 * n)
    # each of the 2 ranks of a node sends to the 6 ranks of other nodes -> 12 n on its link
    assert complete.comm_s == pytest.approx(12 * n * 1e-9)
    assert cm.neighbor_degrees([[1, 2], [0], [3], [2]], 2) == [(1, 1), (1, 0), (1, 0), (1, 0)]
    # the counted degrees of the complete graph equal the topology module's
    assert cm.topology_degrees("complete", c) == cm.neighbor_degrees(
        [[j for j in range(8) if j != i] for i in range(8)], 2)


def test_smallest_period_meets_the_target_and_one_less_does_not():
    w = cm.Workload(10_000_000, 0, 0.01)
    c = cluster(8, 4, cm.Link(2e-6, 1e-11), cm.Link(5e-6, 8e-10))
    T, cost = cm.smallest_period(lambda t: cm.local_sgd(w, c, t), 0.1)
    assert cost.comm_share <= 0.1 < cm.local_sgd(w, c, T // 2).comm_share
    T, cost = cm.smallest_period(lambda t: cm.local_sgd(w, c, t), 1e-9, periods=(1, 2))
    assert T == 2 and cost.comm_share > 1e-9      # none meets it: the largest


# -- the model's bytes are the bytes lsgd_hpc counts -------------------------------------------
_RUN_METHODS = textwrap.dedent("""
    import json, sys
    import h5py
    from mpi4py import MPI
    from lsgd_hpc.cli import train
    out = {}
    base = sys.argv[1]
    runs = {"allreduce": [], "lsgd": ["--tau-local", "2", "--tau-global", "4"],
            "easgd": ["--easgd-tau", "4"], "local-sgd": ["--local-steps", "4"],
            "diloco": ["--local-steps", "4"],
            "slowmo": ["--local-steps", "4", "--slowmo-every", "8"],
            "gossip": ["--topology", "ring"]}
    for name, opts in runs.items():
        d = f"{base}/{name}"
        code = train.main(["--algorithm", name, *opts, "--max-steps", "8", "--epochs", "100",
                           "--eval-every", "8", "--ranks-per-node", "2", "--run-dir", d])
        assert code == 0, (name, code)
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 0:
            sent = []
            for r in range(4):
                with h5py.File(f"{d}/metrics/rank{r:05d}.h5", "r") as h:
                    sent.append(float(h["train/comm_bytes_sent"][-1]) / int(h["train/step"][-1]))
            out[name] = sum(sent) / 4
    if MPI.COMM_WORLD.rank == 0:
        print("BYTES " + json.dumps(out))
""")


@pytest.mark.slow
def test_model_bytes_equal_the_counted_bytes_of_a_real_run(tmp_path):
    """4 ranks as 2 nodes, digits, 8 steps: the model's payload bytes per step per rank (mean
    over ranks) equal what the trainer's counters recorded, for every method."""
    script = tmp_path / "run.py"
    script.write_text(_RUN_METHODS)
    proc = run_mpi(4, [sys.executable, str(script), str(tmp_path)], timeout=600)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("BYTES "))
    measured = json.loads(line[6:])
    from lsgd_hpc.planning.plan import model_facts
    facts = model_facts("digits_cnn", "digits")
    w = cm.Workload(facts.n_params, facts.n_buffers, 0.0)
    c = cluster(2, 2)
    predicted = {
        "allreduce": cm.allreduce_sgd(w, c), "lsgd": cm.lsgd(w, c, 2, 4),
        "easgd": cm.easgd(w, c, 4), "local-sgd": cm.local_sgd(w, c, 4),
        "diloco": cm.diloco(w, c, 4), "slowmo": cm.slowmo(w, c, 4, 8),
        "gossip": cm.gossip(w, c, "ring")}
    # elections are counted too (16 bytes each): add them to the model's payload
    predicted_bytes = {k: v.bytes_per_step for k, v in predicted.items()}
    predicted_bytes["lsgd"] += cm.ELECTION_BYTES * (1 / 2 + 1 / 4)
    for name, b in measured.items():
        assert b == pytest.approx(predicted_bytes[name], rel=1e-6), name
    # the default --lsgd-bn keep sends parameters only; copy/pull send the BN buffers too
    assert (cm.lsgd(w, c, 2, 4, bn="copy").bytes_per_step - predicted["lsgd"].bytes_per_step
            == pytest.approx(facts.n_buffers * 4 * (1 / 2 / 2 + 3 / 4 / 4)))


# -- command line ----------------------------------------------------------------------------------
PLAN = [sys.executable, "-m", "lsgd_hpc.plan"]
EXAMPLE = ["--model", "resnet20", "--nodes", "64", "--ranks-per-node", "8", "--inter-gbps", "100",
           "--intra-gbps", "600"]


def plan_cli(args, timeout=120):
    return subprocess.run(PLAN + args, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(), cwd=REPO)


def test_cli_prints_every_method_and_the_recommendations():
    p = plan_cli(EXAMPLE + ["--step-ms", "45"])
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "269,722 parameters" in out          # the real ResNet-20
    assert "64 nodes x 8 ranks = 512 ranks" in out
    for method in ("allreduce", "lsgd", "easgd", "local-sgd", "diloco", "slowmo", "gossip"):
        assert any(line.startswith(method) for line in out.splitlines()), method
    for field in ("step ms", "comm share", "bytes/step/rank", "--tau-local", "--tau-global",
                  "--local-steps", "--topology"):
        assert field in out, field


def test_cli_json_is_consistent_with_the_model():
    p = plan_main(EXAMPLE + ["--step-ms", "45", "--inter-gbps", "1", "--json"])
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["inputs"]["n_params"] == 269_722 and doc["inputs"]["ranks"] == 512
    by = {m["method"]: m for m in doc["methods"]}
    for m in by.values():
        assert m["step_s"] == pytest.approx(m["compute_s"] + m["comm_s"])
        assert m["compute_s"] == pytest.approx(0.045)
    rec = doc["recommended"]
    assert by["lsgd"]["comm_share"] <= 0.1 and by["local-sgd"]["comm_share"] <= 0.1
    # the recommended T is the smallest that meets the target: half of it does not
    facts_bytes = doc["inputs"]["model_bytes"]
    assert by["local-sgd"]["bytes_per_step"] == pytest.approx(facts_bytes / rec["local-sgd"]["T"])
    assert rec["local-sgd"]["T"] > 1       # at 1 Gbit/s a 1 MB allreduce per step is too dear
    assert by["allreduce"]["comm_share"] > 0.1
    assert rec["gossip"]["topology"] in {g["topology"] for g in doc["gossip"]}
    # slower network, higher share: the planner reacts to its inputs
    fast = json.loads(plan_main(EXAMPLE + ["--step-ms", "45", "--json"]).stdout)
    assert fast["methods"][0]["comm_share"] < by["allreduce"]["comm_share"]


@pytest.mark.parametrize("args, needle", [
    (["--model", "resnet21", "--nodes", "2", "--ranks-per-node", "2", "--inter-gbps", "1",
      "--intra-gbps", "1"], "--model"),
    (EXAMPLE[:2] + ["--nodes", "0"] + EXAMPLE[4:], "--nodes"),
    (EXAMPLE + ["--step-ms", "-1"], "--step-ms"),
    (EXAMPLE + ["--inter-gbps", "nan"], "--inter-gbps"),
    (EXAMPLE + ["--max-comm-share", "1.5"], "--max-comm-share"),
    (["--model", "resnet20", "--nodes", "4"], "required without --measure"),
    (["--model", "vgg16"] + EXAMPLE[2:] + ["--dataset", "digits"], "--model"),   # needs 32x32
])
def test_cli_bad_input_one_line_exit_2(args, needle):
    p = plan_main(args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.slow
def test_measure_under_mpirun_4_ranks_as_2_nodes():
    proc = run_mpi(4, PLAN + ["--model", "mlp", "--measure", "--measure-ranks-per-node", "2",
                              "--nodes", "16", "--json"], timeout=300)
    doc = json.loads(proc.stdout)
    m = doc["measured"]
    assert (m["nodes"], m["ranks_per_node"]) == (2, 2)
    assert m["probe"]["n_nodes"] == 2
    for kind in ("intra", "inter"):
        assert m[kind]["alpha_s"] >= 0 and m[kind]["beta_s"] >= 0
        assert f"{kind} measured" in doc["inputs"]["link_source"]
    assert m["step_s"] > 0 and doc["inputs"]["step_s"] == pytest.approx(m["step_s"])
    assert doc["inputs"]["step_source"].startswith("measured")
    # planned for 16 nodes of the job's 2 ranks each
    assert doc["inputs"]["ranks"] == 32


@pytest.mark.slow
def test_measure_one_node_needs_the_network_figure_exit_2_printed_once():
    proc = run_mpi(2, PLAN + ["--model", "mlp", "--measure"], timeout=300, check=False)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert text.count("lsgd_hpc.plan: error:") == 1 and "--inter-gbps" in text
    ok = run_mpi(2, PLAN + ["--model", "mlp", "--measure", "--inter-gbps", "10"], timeout=300)
    assert "1 nodes x 2 ranks" in ok.stdout and "intra measured, inter given" in ok.stdout


def test_diloco_and_slowmo_cost_one_model_allreduce_per_period():
    w = cm.Workload(500_000, 2000, 0.05)
    c = cluster(4, 4, cm.Link(2e-6, 1e-11), cm.Link(5e-6, 8e-11), mem_Bps=1e12)
    # the same allreduce of the whole flat vector as local SGD, every H (DiLoCo) or T steps
    assert cm.diloco(w, c, 16).bytes_per_step == pytest.approx(w.flat_bytes / 16)
    assert cm.slowmo(w, c, 4, 48).bytes_per_step == pytest.approx(w.flat_bytes / 4)
    assert cm.diloco(w, c, 16).comm_s == pytest.approx(cm.diloco(w, c, 1).comm_s / 16)
    # the outer optimizer's and the slow step's passes come on top of local SGD's round
    assert cm.diloco(w, c, 8).comm_s > cm.local_sgd(w, c, 8).comm_s
    slow = cm.slowmo(w, c, 4, 48).comm_s - cm.local_sgd(w, c, 4).comm_s
    assert slow == pytest.approx(5 * 2 * w.flat_bytes / 1e12 / 48)
    with pytest.raises(ValueError):
        cm.slowmo(w, c, 4, 6)
    assert cm.method_cost("slowmo", w, c, {"local_steps": 4}).setting == "T 4, slow every 48"
    # every method's cost comes from its spec, with the spec's checks
    with pytest.raises(ValueError, match="slowmo_every must be a multiple of local_steps"):
        cm.method_cost("slowmo", w, c, {"local_steps": 5})


def test_comm_dtype_bf16_halves_every_methods_bytes():
    """The planner knows what --comm-dtype bf16 sends: two bytes per element."""
    out = {}
    for dtype in ("fp32", "bf16"):
        proc = plan_main(["--model", "resnet20", "--nodes", "4", "--ranks-per-node", "4",
                          "--inter-gbps", "10", "--intra-gbps", "100", "--comm-dtype", dtype,
                          "--json"])
        assert proc.returncode == 0, proc.stderr
        out[dtype] = {(m["method"], m["setting"]): m["bytes_per_step"]
                      for m in json.loads(proc.stdout)["methods"]}
    for key, fp32 in out["fp32"].items():
        if key in out["bf16"] and fp32 > 0:
            assert abs(out["bf16"][key] / fp32 - 0.5) < 0.02, (key, fp32, out["bf16"][key])


# -- workers that span ranks (--worker-ranks) ------------------------------------------------------
def test_diloco_between_node_workers_by_hand():
    """One worker per node of q ranks: the gradient's allreduce inside it every step (a ring
    of q on the intra link, in float32), the outer allreduce between the N workers every H
    steps on the inter link, and its result spread inside each worker (a broadcast over q)."""
    inter, intra = cm.Link(5e-6, 8e-9), cm.Link(1e-6, 1e-10)
    c = cluster(2, 4, intra=intra, inter=inter)
    w = cm.Workload(250_000, 0, 0.01, element_bytes=2)         # bf16 between workers
    H = 8
    got = cm.method_cost("diloco", w, c, {"local_steps": H}, worker_ranks="node")
    assert isinstance(got, cm.WorkerCost) and (got.worker_ranks, got.n_workers) == (4, 2)
    grad = 4 * 250_000                     # float32 inside the worker
    inside = cm.allreduce_sgd(cm.Workload(250_000, 0, 0.01), cluster(1, 4, intra, intra),
                              bucket_bytes=2 ** 20)
    assert got.inside_s == pytest.approx(inside.comm_s)
    n = w.flat_bytes
    between = min(cm.ring_allreduce(n, 2, inter), cm.doubling_allreduce(n, 2, inter)) / H
    spread = cm.broadcast_time(n, 4, intra) / H
    assert got.between_s == pytest.approx(between + spread)
    assert got.comm_s == pytest.approx(inside.comm_s + between + spread)
    assert got.bytes_per_step == pytest.approx(n / H / 4)       # first ranks only
    assert got.worker_bytes_per_step == pytest.approx(grad + n / H / 4)


def test_workers_cut_the_methods_bytes_by_the_worker_size():
    c = cluster(4, 8)
    w = cm.Workload(1_000_000, 1000, 0.05)
    for method, opts in (("diloco", {"local_steps": 16}), ("local-sgd", {"local_steps": 4}),
                         ("easgd", {"easgd_tau": 4}), ("slowmo", {"local_steps": 2})):
        per_rank = cm.method_cost(method, w, c, opts)
        for wr, q_w in (("node", 8), (2, 2)):
            assert cm.method_cost(method, w, c, opts, worker_ranks=wr).bytes_per_step == \
                pytest.approx(per_rank.bytes_per_step / q_w), (method, wr)
    # allreduce SGD: one replica over all ranks already, the grouping changes nothing
    assert cm.method_cost("allreduce", w, c, worker_ranks="node") == \
        cm.method_cost("allreduce", w, c)
    with pytest.raises(ValueError, match="must divide the ranks of every node"):
        cm.method_cost("diloco", w, c, worker_ranks=3)
    with pytest.raises(ValueError, match="not supported by lsgd-async"):
        cm.method_cost("lsgd-async", w, c, worker_ranks=2)


def test_cli_plans_between_workers(capsys):
    from lsgd_hpc.planning.plan import main
    assert main(EXAMPLE + ["--worker-ranks", "node", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["inputs"]["worker_size"], doc["inputs"]["n_workers"]) == \
        (doc["inputs"]["ranks_per_node"], doc["inputs"]["nodes"])
    rows = {m["method"]: m for m in doc["methods"]}
    assert "worker_bytes_per_step" in rows["diloco"] and "worker_bytes_per_step" not in \
        rows["allreduce"]
    assert main(EXAMPLE + ["--worker-ranks", "node"]) == 0
    text = capsys.readouterr().out
    assert "workers: " in text and "inside/step/rank" in text
    assert main(EXAMPLE + ["--worker-ranks", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "lsgd_hpc.plan: error: --worker-ranks: must divide the ranks of every node" in err


def test_comm_dtype_int8_quarters_the_quantized_methods_bytes():
    """int8 (and fp8): 1 byte per element plus one 4-byte scale per 4096, for the methods
    that take it (allreduce SGD its gradient, issue 47); gossip
    (CHOCO-SGD) sends one byte an element to each neighbour."""
    from lsgd_hpc.planning import plan as pl
    facts = pl.model_facts("resnet20", None)
    inp = lambda dtype: pl.PlanInputs(  # noqa: E731
        "resnet20", facts.dataset, 4, 4, cm.Link.from_gbps(100, 2), cm.Link.from_gbps(10, 5),
        0.05, "given", "given", 128, 1e12, 0.1, "auto", dtype)
    plans = {d: pl.plan(inp(d), facts) for d in ("fp32", "int8")}
    fp32, int8 = ({m["method"]: m["bytes_per_step"] for m in plans[d]["methods"]}
                  for d in ("fp32", "int8"))
    # LSGD's broadcasts forward the quantized bytes: a quarter of fp32's, plus the scales
    assert int8["lsgd"] / fp32["lsgd"] == pytest.approx((1 + 4 / 4096) / 4, rel=0.02)
    # the averaging methods' int8 allreduce is hierarchical on 4 nodes x 4 ranks: a node
    # root sends B = m + 4 N b bytes between the 4 roots (b = ceil(ceil(m / 4) / 4096)
    # scales a chunk), the other ranks nothing: B / 4 a rank, mean over the 16 ranks
    m = facts.n_params + facts.n_buffers
    b = -(-(-(-m // 4)) // 4096)
    B = m + 4 * 4 * b
    from lsgd_hpc.comm.quantized import allreduce_bytes
    assert allreduce_bytes(m, 4, kind="int8") == B
    rec = plans["int8"]["recommended"]
    for method, period in (("easgd", rec["easgd"]["tau"]), ("local-sgd", rec["local-sgd"]["T"]),
                           ("diloco", rec["diloco"]["H"]), ("slowmo", rec["slowmo"]["T"])):
        assert int8[method] == pytest.approx(B / 4 / period), method
    # allreduce SGD's gradient (issue 47): each 1 MB bucket of the float32 gradient a
    # hierarchical int8 allreduce (its node root's bytes / 4 a rank), the BatchNorm
    # statistics' float32 broadcast beside it
    k = -(-4 * facts.n_params // 2 ** 20)
    mb = -(-facts.n_params // k)
    want = k * allreduce_bytes(mb, 4, kind="int8") / 4 + 4 * facts.n_buffers / 16
    assert int8["allreduce"] == pytest.approx(want), (int8["allreduce"], want)
    assert int8["allreduce"] < fp32["allreduce"] / 3.9
    assert int8["gossip"] == pytest.approx(fp32["gossip"] / 4, rel=0.01)
