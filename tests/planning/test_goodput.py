"""The failure planner's goodput model (lsgd_hpc.planning.goodput) against hand computations,
its limits and a small simulation of its own assumptions, and its command line
(python -m lsgd_hpc.plan --mtbf-hours H)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from lsgd_hpc.planning import goodput as gp
from mpi_util import REPO, mpi_env

H = 3600.0


def model(**kw):
    base = dict(nodes=64, node_mtbf_s=5000 * H, checkpoint_s=60.0, restart_s=600.0,
                shrink_pause_s=60.0, heal_pause_s=30.0, replacement_s=300.0, job_s=24 * H,
                survivable=1.0)
    base.update(kw)
    return gp.FailureModel(**base)


# -- by hand ---------------------------------------------------------------------------------
def test_llama3_failure_rate():
    # 2048 nodes, 419 unexpected interruptions in 54 days
    assert gp.llama3_node_mtbf_hours() == pytest.approx(2048 * 54 * 24 / 419)
    assert gp.llama3_node_mtbf_hours() == pytest.approx(6334.6, abs=0.1)
    job = gp.job_mtbf_s(2048, gp.llama3_node_mtbf_hours() * H) / H
    assert job == pytest.approx(3.093, abs=1e-3)


def test_young_and_daly_intervals_by_hand():
    assert gp.young_interval(60, 11_135) == pytest.approx(math.sqrt(2 * 60 * 11_135))
    x = 60 / (2 * 11_135)
    daly = math.sqrt(2 * 60 * 11_135) * (1 + math.sqrt(x) / 3 + x / 9) - 60
    assert gp.daly_interval(60, 11_135) == pytest.approx(daly)
    assert gp.daly_interval(100, 40) == 40                  # delta >= 2M: M
    assert gp.daly_interval(60, math.inf) == math.inf
    assert gp.daly_interval(0, 100) == 0 == gp.young_interval(0, 100)


def test_daly_interval_is_near_the_exact_optimum():
    for delta, mtbf, restart in ((60, 11_135, 600), (5, 300, 20), (0.02, 9, 12)):
        taus = [gp.daly_interval(delta, mtbf) * f for f in (0.5 + 0.01 * i for i in range(151))]
        best = max(gp.abort_goodput(t, delta, mtbf, restart) for t in taus)
        daly = gp.abort_goodput(gp.daly_interval(delta, mtbf), delta, mtbf, restart)
        young = gp.abort_goodput(gp.young_interval(delta, mtbf), delta, mtbf, restart)
        assert best - 1e-4 <= daly <= best + 1e-12 and young <= best + 1e-12


def test_abort_goodput_by_hand_and_first_order():
    tau, delta, m, r, d = 100.0, 10.0, 1000.0, 50.0, 20.0
    assert gp.abort_goodput(tau, delta, m, r, d) == pytest.approx(
        100 / (1020 * math.exp(0.05) * (math.exp(0.11) - 1)))
    # first order: 1 - delta/tau - (tau/2 + R + D)/M for a long MTBF
    m = 1e7
    assert gp.abort_goodput(tau, delta, m, r, d) == pytest.approx(
        1 - delta / (tau + delta) - (tau / 2 + r + d) / m, abs=1e-6)
    assert gp.abort_goodput(tau, delta, math.inf, r) == pytest.approx(tau / (tau + delta))
    assert gp.abort_goodput(math.inf, delta, math.inf, r) == 1.0


def test_poisson_excess_by_hand():
    assert gp.poisson_excess(2.0, 0) == 2.0
    assert gp.poisson_excess(2.0, 1) == pytest.approx(1 + math.exp(-2))
    assert gp.poisson_excess(2.0, 2) == pytest.approx(2 * math.exp(-2) + 2 * math.exp(-2))
    assert gp.poisson_excess(0.0, 3) == 0.0
    assert gp.poisson_excess(500.0, 3) == pytest.approx(497, rel=1e-9)


def test_shrink_closed_form_by_hand_and_against_the_binomial_sum():
    m = model(nodes=8, node_mtbf_s=100 * H)
    w, th = 50 * H, 100 * H
    hand = th * (1 - math.exp(-w / th)) - 60 * 7 / 2 * (1 - math.exp(-2 * w / th))
    assert gp.shrink_work(m, w) == pytest.approx(hand)
    linear = replace(m, capacity=[1 - k / 8 for k in range(9)])
    assert gp.shrink_work(linear, w, steps=256) == pytest.approx(hand, rel=1e-6)
    # replicas of 2 nodes: 4 units failing twice as often
    r2 = replace(m, replica_nodes=2)
    assert gp.shrink_work(r2, w) == pytest.approx(
        th / 2 * (1 - math.exp(-2 * w / th)) - 60 * 3 / 2 * (1 - math.exp(-4 * w / th)))


def test_heal_by_hand():
    m = model(nodes=16, survivable=1.0)
    lam = 16 / (5000 * H)
    cold = 60 + 30 + 300 / 16
    assert gp.heal_losses(m) == {"warm": 90.0, "cold": pytest.approx(cold)}
    assert gp.heal_goodput(m) == pytest.approx(1 - lam * cold)
    # survivable share 0.78: the rest is checkpoint/restart at Daly's interval for M/0.22
    m78 = replace(m, survivable=0.78)
    mtbf = 5000 * H / 16 / 0.22
    kappa = gp.abort_goodput(gp.daly_interval(60, mtbf), 60, mtbf, 600)
    assert gp.heal_goodput(m78) == pytest.approx(kappa * (1 - 0.78 * lam * cold))


# -- limits and shape ------------------------------------------------------------------------
POLICY_KW = dict(spares=2)


@pytest.mark.parametrize("survivable", [1.0, 0.78])
def test_no_failures_no_loss(survivable):
    m = model(node_mtbf_s=1e15, survivable=survivable, **POLICY_KW)
    res = gp.policies(m)
    for row in res["rows"]:
        assert row["goodput"] == pytest.approx(1.0, abs=2e-3), row
    inf = gp.policies(replace(m, node_mtbf_s=math.inf))
    for row in inf["rows"]:
        assert row["goodput"] == 1.0, row


@pytest.mark.parametrize("survivable", [1.0, 0.78])
def test_goodput_grows_with_the_mtbf(survivable):
    prev = None
    for hours in (20, 50, 200, 1000, 5000, 50_000):
        res = gp.policies(model(node_mtbf_s=hours * H, survivable=survivable, **POLICY_KW))
        now = {r["policy"]: r["goodput"] for r in res["rows"]}
        assert all(0 <= g <= 1 for g in now.values()), now
        if prev:
            for k in now:
                assert now[k] >= prev[k] - 1e-6, (hours, k, now[k], prev[k])
        prev = now


def test_heal_beats_shrink_when_the_replacement_is_fast():
    for nodes in (8, 64, 2048):
        m = model(nodes=nodes, node_mtbf_s=1000 * H, heal_pause_s=1.0, replacement_s=10.0,
                  job_s=7 * 24 * H)
        assert gp.heal_goodput(m) >= gp.shrink_goodput(m)
        assert gp.heal_goodput(m) >= gp.shrink_requeue(m)["goodput"]
    # and a slow join at scale turns it around: every failure stalls all 2048 nodes
    slow = model(nodes=2048, node_mtbf_s=1000 * H, heal_pause_s=600.0, job_s=24 * H)
    assert gp.heal_goodput(slow) < gp.shrink_goodput(slow)


def test_spares_help_only_until_they_run_out_and_refills_help():
    m = model(nodes=16, node_mtbf_s=50 * H, replacement_s=3600.0, job_s=200 * H)
    none, two = gp.heal_goodput(m, spares=0), gp.heal_goodput(replace(m, spares=2))
    many = gp.heal_goodput(replace(m, spares=1000))
    assert none < two < many
    assert many == pytest.approx(1 - 16 / (50 * H) * 90, rel=1e-6)    # never cold
    # refilled at a requeue every 10 h: better than 2 spares once, less the requeues' cost
    refill = replace(m, spares=2, requeue_s=10 * H, restart_s=0.0, checkpoint_s=0.0)
    assert gp.heal_goodput(refill) > gp.heal_goodput(replace(m, spares=2, checkpoint_s=0.0))


def test_shrink_requeue_window_is_the_best_and_sqrt_law():
    m = model(nodes=2048, node_mtbf_s=6000 * H, job_s=1000 * H)
    sr = gp.shrink_requeue(m)
    cost = m.checkpoint_s + m.restart_s
    g = lambda h: gp.shrink_work(m, h) / (h + cost)      # noqa: E731  (kappa = 1)
    for f in (0.7, 0.9, 1.1, 1.4):
        assert g(sr["window_s"] * f) <= sr["goodput"] + 1e-9
    # linear capacity, small losses: H* ~ sqrt(2 theta (cost)) (pauses do not depend on H)
    assert sr["window_s"] == pytest.approx(math.sqrt(2 * 6000 * H * cost), rel=0.05)
    assert sr["goodput"] >= gp.shrink_goodput(m)


def test_recommendation_needs_a_margin():
    res = gp.policies(model(nodes=8, node_mtbf_s=5000 * H, spares=2))
    by = {r["policy"]: r["goodput"] for r in res["rows"]}
    assert by["heal+spares"] >= by["heal"]
    assert res["recommended"] != "heal+spares"     # gains < 0.1 point at 8 nodes
    big = gp.policies(model(nodes=2048, node_mtbf_s=gp.llama3_node_mtbf_hours() * H,
                            job_s=54 * 24 * H, survivable=0.78))
    assert big["recommended"] in ("heal", "shrink+requeue")
    assert {r["policy"]: r["goodput"] for r in big["rows"]}["abort"] < 0.9


# -- the model against a simulation of its own assumptions -----------------------------------
def _simulate_abort(tau, delta, mtbf, restart, down, work, rng):
    """Checkpoint/restart with exponential failures: wall seconds to do ``work``."""
    t = done = 0.0
    need_restart = False
    while done < work:
        seg = (restart if need_restart else 0.0) + tau + delta
        life = rng.expovariate(1 / mtbf)
        if life >= seg:
            t += seg
            done += tau
            need_restart = False
        else:
            t += life + down
            need_restart = True
    return t


def test_abort_formula_against_a_simulation():
    rng = random.Random(7)
    tau, delta, mtbf, restart, down = 40.0, 5.0, 300.0, 20.0, 10.0
    work = 400_000.0
    wall = _simulate_abort(tau, delta, mtbf, restart, down, work, rng)
    assert work / wall == pytest.approx(gp.abort_goodput(tau, delta, mtbf, restart, down),
                                        rel=0.02)


def _simulate_shrink(units, theta, pause, horizon, rng):
    """Work (full-size seconds) in ``horizon`` with units dying, each death pausing all."""
    deaths = sorted(rng.expovariate(1 / theta) for _ in range(units))
    work, t, alive = 0.0, 0.0, units
    for d in deaths:
        if d >= horizon:
            break
        work += max(0.0, d - t) * alive / units
        alive -= 1
        t = min(horizon, max(t, d) + pause)      # the pause: nobody works
    if t < horizon:
        work += (horizon - t) * alive / units
    return work


def test_shrink_formula_against_a_simulation():
    rng = random.Random(3)
    m = model(nodes=16, node_mtbf_s=20 * H, shrink_pause_s=120.0)
    horizon = 10 * H
    sims = [_simulate_shrink(16, 20 * H, 120.0, horizon, rng) for _ in range(4000)]
    assert sum(sims) / len(sims) == pytest.approx(gp.shrink_work(m, horizon), rel=0.01)


# -- command line ----------------------------------------------------------------------------
PLAN = [sys.executable, "-m", "lsgd_hpc.plan"]


def plan_cli(args):
    return subprocess.run(PLAN + args, capture_output=True, text=True, timeout=120,
                          env=mpi_env(), cwd=REPO)


def test_cli_prints_the_goodput_table_and_a_recommendation():
    p = plan_cli(["--mtbf-hours", "llama3", "--nodes", "2048", "--job-hours", "1296",
                  "--step-ms", "4000"])
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "2048 nodes x 8 ranks = 16384 ranks" in out and "job MTBF 3.09 h" in out
    assert "419 unexpected interruptions" in out
    for policy in ("abort", "shrink", "shrink+requeue", "heal"):
        assert any(line.split()[:1] == [policy] for line in out.splitlines()), policy
    assert "Young sqrt(2 delta M)" in out and "Daly" in out and "--checkpoint-every" in out
    assert "recommended: " in out


def test_cli_json_matches_the_model(capsys):
    from lsgd_hpc.planning.plan import main
    args = ["--mtbf-hours", "2000", "--nodes", "64", "--checkpoint-seconds", "30",
            "--restart-seconds", "300", "--spares", "4", "--survivable", "1", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    m = model(node_mtbf_s=2000 * H, checkpoint_s=30.0, restart_s=300.0, spares=4)
    want = gp.policies(m)
    got = {r["policy"]: r["goodput"] for r in doc["rows"]}
    assert got == pytest.approx({r["policy"]: r["goodput"] for r in want["rows"]})
    assert doc["daly_s"] == pytest.approx(gp.daly_interval(30, 2000 * H / 64))
    assert doc["recommended"] == want["recommended"]
    assert doc["checkpoint"]["source"] == "given"


def test_cli_measures_the_checkpoint_of_a_model(capsys, tmp_path):
    from lsgd_hpc.planning.plan import main
    assert main(["--mtbf-hours", "5000", "--nodes", "4", "--model", "resnet20",
                 "--write-gbytes-per-s", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    from lsgd_hpc.planning.plan import model_facts
    facts = model_facts("resnet20")
    assert doc["checkpoint"]["bytes"] == 8 * (facts.n_params + facts.n_buffers)  # + momentum
    assert doc["checkpoint"]["seconds"] == pytest.approx(doc["checkpoint"]["bytes"] / 1e9)
    assert main(["--mtbf-hours", "5000", "--nodes", "4", "--model", "mlp",
                 "--checkpoint-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"measured in {tmp_path}" in out and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needle", [
    (["--mtbf-hours", "0", "--nodes", "8"], "--mtbf-hours"),
    (["--mtbf-hours", "inf", "--nodes", "8"], "--mtbf-hours"),
    (["--mtbf-hours", "soon", "--nodes", "8"], "--mtbf-hours"),
    (["--mtbf-hours", "100"], "--nodes"),
    (["--mtbf-hours", "100", "--nodes", "0"], "--nodes"),
    (["--mtbf-hours", "100", "--nodes", "8", "--checkpoint-seconds", "-1"],
     "--checkpoint-seconds"),
    (["--mtbf-hours", "100", "--nodes", "8", "--restart-seconds", "nan"], "--restart-seconds"),
    (["--mtbf-hours", "100", "--nodes", "8", "--survivable", "1.5"], "--survivable"),
    (["--mtbf-hours", "100", "--nodes", "8", "--replica-nodes", "3"], "--replica-nodes"),
    (["--mtbf-hours", "100", "--nodes", "8", "--requeue-hours", "5"], "--requeue-hours"),
    (["--mtbf-hours", "100", "--nodes", "8", "--model", "resnet21"], "--model"),
    (["--mtbf-hours", "100", "--nodes", "8", "--model", "mlp", "--checkpoint-dir",
      "/nonexistent/dir"], "--checkpoint-dir"),
])
def test_cli_bad_input_one_line_exit_2(args, needle):
    p = plan_cli(args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith(
        "lsgd_hpc.plan: error: "), p.stderr
    assert p.stdout == ""
