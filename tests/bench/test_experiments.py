"""A results/ experiment runs end to end as its own command: real MPI trainings (one mpirun),
its CSV tables with their columns and one row per run and per method, and its figure."""

import csv
import math
import os
import shutil
import subprocess
import sys

import pytest

from mpi_util import REPO, mpi_env


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_methods_experiment_writes_its_tables_and_figure(tmp_path):
    out, raw = tmp_path / "out", tmp_path / "raw"
    cmd = [sys.executable, str(REPO / "results" / "experiments" / "methods.py"),
           "--out", str(out), "--raw", str(raw), "--quick", "--ranks", "2", "--tasks", "noisy",
           "--methods", "LSGD multi-leader", "allreduce SGD", "--seeds", "2", "--steps", "20",
           "--eval-every", "10"]
    p = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = _csv(out / "methods_runs.csv")
    assert {"task", "ranks", "method", "seed", "final_acc_leader", "final_acc_mean",
            "training_time_s", "bytes_sent", "time_to_target_s", "bytes_to_target"} <= set(runs[0])
    assert sorted((r["method"], r["seed"]) for r in runs) == [
        ("LSGD multi-leader", "1"), ("LSGD multi-leader", "2"),
        ("allreduce SGD", "1"), ("allreduce SGD", "2")]
    for r in runs:
        assert (r["task"], r["ranks"], r["steps"]) == ("noisy", "2", "20")
        assert 0 < float(r["final_acc_leader"]) <= 1 and float(r["training_time_s"]) > 0
        assert int(r["bytes_sent"]) > 0
    # allreduce averages gradients every step; LSGD pulls every few steps: fewer bytes
    sent = {r["method"]: int(r["bytes_sent"]) for r in runs}
    assert sent["LSGD multi-leader"] < sent["allreduce SGD"]
    summary = _csv(out / "methods_summary.csv")
    assert [(s["method"], s["seeds"]) for s in summary] == [("LSGD multi-leader", "2"),
                                                           ("allreduce SGD", "2")]
    for s in summary:
        accs = [float(r["final_acc_leader"]) for r in runs if r["method"] == s["method"]]
        assert abs(float(s["final_acc_leader_mean"]) - sum(accs) / 2) < 1e-4
    # the tuning grid: 2 settings per method (--quick), one chosen per method, the one with
    # the best validation accuracy, and the summary says which
    grid = _csv(out / "methods_grid.csv")
    for method in ("LSGD multi-leader", "allreduce SGD"):
        mine = [g for g in grid if g["method"] == method]
        assert len(mine) == 2 and len({g["setting"] for g in mine}) == 2
        assert all(g["seeds"] == "0" and 0 <= float(g["val_acc_leader"]) <= 1 for g in mine)
        (best,) = [g for g in mine if g["chosen"] == "yes"]
        assert float(best["val_acc_leader"]) == max(float(g["val_acc_leader"]) for g in mine)
        assert [s["setting"] for s in summary if s["method"] == method] == [best["setting"]]
    png = (out / "methods_noisy_2ranks.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "equal or better accuracy with fewer bytes?" in p.stdout
    assert len(list(raw.glob("np2/noisy/*/metrics/rank00001.h5"))) == 4
    assert len(list(raw.glob("grid-np2/*/metrics/rank00001.h5"))) == 4


@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_lm_experiment_on_the_emulated_cluster(tmp_path):
    """results/experiments/lm.py end to end on 2 emulated nodes at 1 Gbit/s (as root): two
    methods at 4 ranks, 8 steps each; its tables, one row per run and per method, and its
    figure. Its own cluster name and subnet, so that it does not meet make results' cluster."""
    # what benchmarks/time_to_accuracy.py's cluster_available() checks (not imported: it puts
    # benchmarks/ on the path, whose module names would shadow others of this process)
    if os.geteuid() != 0:
        pytest.skip("emulated cluster not available: needs root (network namespaces and tc)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("emulated cluster not available: needs the ip and tc commands (iproute2)")
    out, raw = tmp_path / "out", tmp_path / "raw"
    cmd = [sys.executable, str(REPO / "results" / "experiments" / "lm.py"), "--out", str(out),
           "--raw", str(raw), "--ranks", "4", "--steps", "8", "--eval-every", "8",
           "--lrs", "0.003", "0.01", "--seeds", "1", "2",
           "--methods", "LSGD multi-leader", "allreduce SGD", "--cluster", "lsgdlmt", "10.79.10"]
    p = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                       timeout=200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    runs = _csv(out / "lm_runs.csv")
    assert {"ranks", "method", "seed", "lr", "final_loss", "final_perplexity",
            "training_time_s", "bytes_sent", "bytes_recv", "steps"} <= set(runs[0])
    # tuning: every learning rate once with seed 0; the pick (lowest validation loss) then
    # with the reported seeds 1 and 2
    tune = [r for r in runs if r["role"] == "tune"]
    assert sorted((r["method"], r["lr"], r["seed"]) for r in tune) == [
        (m, lr, "0") for m in ("LSGD multi-leader", "allreduce SGD") for lr in ("0.003", "0.01")]
    picks = {}
    for m in ("LSGD multi-leader", "allreduce SGD"):
        mine = [r for r in tune if r["method"] == m]
        (best,) = [r for r in mine if r["tuned_pick"] == "1"]
        assert float(best["final_val_loss"]) == min(float(r["final_val_loss"]) for r in mine)
        picks[m] = best["lr"]
    report = [r for r in runs if r["role"] == "report"]
    assert sorted((r["method"], r["lr"], r["seed"], r["steps"]) for r in report) == sorted(
        (m, picks[m], seed, "8") for m in picks for seed in ("1", "2"))
    for r in runs:
        assert r["nodes"] == "2"
        assert abs(math.exp(float(r["final_loss"])) - float(r["final_perplexity"])) < 1e-3 * \
            float(r["final_perplexity"])
        assert 1 < float(r["final_perplexity"]) < 256 and float(r["training_time_s"]) > 0
        assert int(r["bytes_sent"]) > 0 and int(r["bytes_recv"]) > 0
        # the learning rate is chosen on the validation windows: another loss than the test's
        assert 0 < float(r["final_val_loss"]) < math.log(256) + 1
        assert float(r["final_val_loss"]) != float(r["final_loss"])
    # allreduce averages gradients every step; LSGD pulls every 4 steps
    sent = {r["method"]: int(r["bytes_sent"]) for r in runs}
    assert sent["LSGD multi-leader"] < sent["allreduce SGD"]
    summary = _csv(out / "lm_summary.csv")
    assert [(s["method"], s["seeds"], s["lr"]) for s in summary] == [
        (m, "2", picks[m]) for m in ("LSGD multi-leader", "allreduce SGD")]
    for s in summary:
        ppl = [float(r["final_perplexity"]) for r in report if r["method"] == s["method"]]
        assert abs(float(s["final_perplexity"]) - sum(ppl) / 2) < 1e-3
    assert all(s["best_baseline"] == "allreduce SGD" for s in summary)
    assert all(float(s["rho"]) > 0 and s["rho_source"] == "predicted" for s in summary)
    png = (out / "lm_4ranks.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "LSGD multi-leader wins against" in p.stdout or \
        "LSGD multi-leader loses against" in p.stdout or "ties" in p.stdout
    assert len(list(raw.glob("np4/*-seed0/metrics/rank00003.h5"))) == 4
    assert len(list(raw.glob("np4/*-seed[12]/metrics/rank00003.h5"))) == 4


def test_every_experiment_imports_in_one_process():
    """make results imports every experiment into one process after loading benchmarks/run_all.py
    (machine_info): module names must not clash (a shared helper named like benchmarks' own
    _common.py, and benchmarks/stragglers.py taken for the experiment, once made two
    experiments fail), and each must be the experiment's own file with make results' run()."""
    code = ("import sys, inspect; sys.argv = ['run_all']; sys.path.insert(0, 'results'); "
            "import run_all; run_all.machine(); "
            "mods = [run_all.load_experiment(n) for n, _ in run_all.EXPERIMENTS]; "
            "assert all('results/experiments/' in m.__file__ for m in mods); "
            "assert all(list(inspect.signature(m.run).parameters)[:3] == ['out', 'quick', 'log'] "
            "for m in mods), [list(inspect.signature(m.run).parameters) for m in mods]; "
            "print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_results_readme_says_where_kept_experiments_come_from(tmp_path):
    """After `run_all.py --only X`, the README's minutes are those of every experiment (not of
    the rerun alone) and it names, per earlier run, which results it kept from it."""
    import importlib.util      # by path: benchmarks/ has a run_all.py too
    spec = importlib.util.spec_from_file_location("results_run_all",
                                                  REPO / "results" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    machine = {"hostname": "h", "nproc": 2, "usable_cpus": 2, "platform": "p", "mpi_library": "m",
               "torch": "t", "mpi4py": "4", "loadavg_start": [1.0], "loadavg_end": [1.0],
               "git_sha": "b" * 40}
    exps = {"methods": {"status": "ok", "seconds": 300, "run_started": "T1", "git_sha": "a" * 40},
            "network": {"status": "ok", "seconds": 120, "run_started": "T2", "git_sha": "b" * 40},
            "stragglers": {"status": "ok", "seconds": 60, "run_started": "T1",
                           "git_sha": "a" * 40}}
    doc = {"command": "python results/run_all.py --only network", "started": "T2",
           "quick": False, "runtime_s": 120, "machine": machine, "experiments": exps,
           "rerun": ["network"], "out": str(tmp_path)}
    text = run_all.readme(doc)
    assert "(about 8 min)" in text                     # 300 + 120 + 60 s, not the rerun's 2
    assert ("It reran network only; the others keep their results, machine and load from "
            "earlier runs: methods, stragglers from the run started T1 (git aaaaaaaaaa).") in text
    del doc["rerun"]                                   # a full run names no earlier one
    assert "It reran" not in run_all.readme(doc)


def test_headline_ratios_against_the_best_tuned_baseline(tmp_path):
    """results/headline.py: per task, LSGD against the best baseline by quality (accuracy up,
    perplexity down), time to target against the fastest baseline, bytes against the best."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_headline",
                                                  REPO / "results" / "headline.py")
    hl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hl)
    (tmp_path / "methods").mkdir()
    cols = ["task", "ranks", "method", "final_acc_leader_mean", "final_acc_leader_std",
            "training_time_s_mean", "time_to_target_s_mean", "bytes_sent_mean",
            "reached_target"]
    rows = [["noisy", 4, "LSGD 1 leader", 0.90, 0.01, 1.0, 0.6, 100, "3/3"],
            ["noisy", 4, "EASGD", 0.94, 0.01, 1.2, 0.4, 1000, "3/3"],
            ["noisy", 4, "local SGD", 0.91, 0.02, 1.1, 0.3, 400, "3/3"],
            ["noisy", 4, "allreduce SGD", 0.80, 0.02, 1.5, None, 5000, "2/3"]]
    with open(tmp_path / "methods" / "methods_summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        w.writerows([["" if v is None else v for v in r] for r in rows])
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "lm_summary.csv").write_text(
        "ranks,method,final_perplexity,training_time_s,bytes_sent,rho\n"
        "4,LSGD multi-leader,9.5,10,200,0.4\n4,DiLoCo,9.0,9,100,0.45\n"
        "4,allreduce SGD,9.2,12,900,0.5\n")
    lines = hl.headline(tmp_path)
    (noisy,) = [r for r in hl.ratios(hl.collect(tmp_path)) if r["task"].startswith("noisy")]
    assert noisy["best_baseline"] == "EASGD" and abs(noisy["quality_diff"] + 0.04) < 1e-12
    assert noisy["fastest_baseline"] == "local SGD"
    assert abs(noisy["time_to_target_ratio"] - 2.0) < 1e-12
    assert abs(noisy["bytes_ratio"] - 0.1) < 1e-12
    (lm,) = [r for r in hl.ratios(hl.collect(tmp_path)) if r["task"].startswith("character")]
    assert lm["best_baseline"] == "DiLoCo" and abs(lm["quality_diff"] - 0.5) < 1e-12
    assert abs(lm["bytes_ratio"] - 2.0) < 1e-12
    assert lm["rho"] == 0.5 and noisy["rho"] is None      # allreduce SGD's; one host: none
    assert any(ln.startswith("| character LM, 4 ranks | 0.5 | LSGD multi-leader |")
               for ln in lines), lines
    assert lines[0] == "## Headline" and (tmp_path / "headline.csv").exists()
    # allreduce did not reach the target in every seed: no time to target in the table
    assert any("| noisy digits (40 % labels wrong), 4 ranks | allreduce SGD | 80.0 % ± 2.0 | "
               "1.50 | n/a |" in ln for ln in lines)


@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_lm_links_experiment_measures_the_bytes_on_the_links(tmp_path):
    """results/experiments/lm_links.py end to end at 1 Gbit/s and 100 Mbit/s (as root):
    allreduce SGD, DiLoCo fp32 and top-k 1 % int2, 8 steps; with no link budget allreduce
    SGD at the slower rate is truncated, its time to its own final perplexity predicted and
    marked so, its training bit-identical to the faster rate's; the bytes between the nodes
    read from the links, far fewer for the top-k DiLoCo than for fp32."""
    if os.geteuid() != 0:
        pytest.skip("emulated cluster not available: needs root (network namespaces and tc)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("emulated cluster not available: needs the ip and tc commands (iproute2)")
    out, raw = tmp_path / "out", tmp_path / "raw"
    topk = "DiLoCo top-k 1% int2+EF"
    cmd = [sys.executable, str(REPO / "results" / "experiments" / "lm_links.py"), "--out",
           str(out), "--raw", str(raw), "--rates", "100mbit", "1gbit", "--steps", "8",
           "--factor", "1", "--eval-every", "8", "--link-budget", "0", "--seeds", "1",
           "--methods", "allreduce SGD", "DiLoCo H=8", topk, "--cluster", "lsgdlkt",
           "10.79.12"]
    p = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                       timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    runs = {(r["rate"], r["method"]): r for r in _csv(out / "links_runs.csv")}
    assert set(runs) == {(rate, m) for rate in ("1gbit", "100mbit")
                         for m in ("allreduce SGD", "DiLoCo H=8", topk)}
    for (rate, m), r in runs.items():
        assert 1 < float(r["final_perplexity"]) < 256 and int(r["link_bytes"]) > 0
        cut = rate == "100mbit" and m == "allreduce SGD"   # 2 rounds of 2 steps; DiLoCo's: 16
        assert (r["run"], r["steps"]) == (("truncated", "4") if cut else ("full", "8"))
        assert r["time_source"] == ("predicted" if cut else "measured")
        if rate == "100mbit":      # the same bits as at 1 Gbit/s over their common steps
            assert r["identical_to_fastest"] == r["steps"], r
    for rate in ("1gbit", "100mbit"):
        fp32, tk = (int(runs[(rate, m)]["link_bytes"]) for m in ("DiLoCo H=8", topk))
        assert tk < fp32 / 10, (rate, tk, fp32)
    summary = {(s["rate"], s["method"]): s for s in _csv(out / "links_summary.csv")}
    ar = summary[("100mbit", "allreduce SGD")]     # its own final perplexity: the 8th step
    assert ar["time_source"] == ar["link_bytes_source"] == "predicted"
    assert float(ar["time_to_target_s"]) == pytest.approx(8 * float(ar["time_per_step_s"]),
                                                          rel=1e-4)
    for s in summary.values():         # rho from the probed link and the run's compute
        assert float(s["rho"]) > 0 and s["rho_source"] == "predicted"
    assert f"| 100mbit | allreduce SGD | {float(ar['time_to_target_s']):.1f}* |" in \
        (out / "links_table.md").read_text()
    for rate in ("1gbit", "100mbit"):
        png = (out / f"links_{rate}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_lm_links_time_to_target_predictions_and_refresh(tmp_path):
    """lm_links' time to a perplexity (linear between evaluations), a truncated run's
    prediction (the fastest rate's step at the target times its own seconds a step, marked
    predicted), the speed-up, the a + b / rate fit, what a rho stands for, and --refresh:
    tables, figures and findings again from links.json alone."""
    import importlib.util
    import json
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(
            "results_lm_links", REPO / "results" / "experiments" / "lm_links.py")
        lk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lk)

        def curve(points):       # (step, training time, perplexity)
            return [{"step": s, "training_time": t, "bytes_sent": 100.0 * s,
                     "loss": math.log(p)} for s, t, p in points]
        c = curve([(0, 0, 20), (8, 10, 10)])
        assert abs(lk.reach(c, math.log(10)) - 10.0) < 1e-9 and lk.reach(c, math.log(5)) is None
        assert abs(lk.reach(c, math.log(10), "step") - 8.0) < 1e-9
        ar_pts, ls_pts = [(0, 0, 300), (8, 30, 12), (16, 60, 9)], [(0, 0, 300), (16, 8, 9.5),
                                                                      (32, 16, 8.5)]
        rows = []
        for rate, method, pts, steps, budget, t in (
                ("100mbit", "allreduce SGD", ar_pts, 16, 16, 60.0),
                ("100mbit", "LSGD worker=node", ls_pts, 32, 32, 16.0),
                ("4mbit", "allreduce SGD", ar_pts[:1] + [(4, 8.0, 40)], 4, 16, 8.0),
                ("4mbit", "LSGD worker=node", [(0, 0, 300), (16, 20, 9.5), (32, 40, 8.5)], 32,
                 32, 40.0)):
            rows.append({"rate": rate, "method": method, "parent": "", "lr": 0.01, "seed": 1,
                         "run": "full" if steps == budget else "truncated", "steps": steps,
                         "steps_budget": budget, "final_val_loss": 1.0,
                         "final_loss": math.log(pts[-1][2]), "final_perplexity": pts[-1][2],
                         "training_time_s": t, "comm_s": 1.0, "bytes_sent": 1000.0,
                         "link_bytes": 1000 * steps, "link_bytes_eval": 0,
                         "link_tx_max_node": 600 * steps, "curve": curve(pts),
                         "identical_to_fastest": "" if rate == "100mbit" else steps})
        out = tmp_path / "lm_links"
        out.mkdir()
        probes = {"100mbit": {"probe": {"inter": {"alpha_s": 0.0, "beta_s_per_byte": 1e-8}}}}
        (out / "links.json").write_text(json.dumps({"runs": rows, "errors": {},
                                                    "probes": probes}))
        res = lk.refresh(out)
        summary = {(s["rate"], s["method"]): s for s in _csv(out / "links_summary.csv")}
        # at 4 Mbit/s allreduce SGD ran 4 steps in 8 s: its 16 steps to 9.0 take 32 s
        ar = summary[("4mbit", "allreduce SGD")]
        assert float(ar["time_to_target_s"]) == pytest.approx(32.0)
        assert ar["time_source"] == ar["link_bytes_source"] == "predicted"
        assert float(ar["link_bytes"]) == pytest.approx(16_000) and float(
            ar["final_perplexity"]) == pytest.approx(9.0)
        # LSGD reaches 9.0 halfway between its evaluations at 16 and 32 steps (log-linear)
        ls = summary[("4mbit", "LSGD worker=node")]
        t_ls = 20 + 20 * (math.log(9.5) - math.log(9.0)) / (math.log(9.5) - math.log(8.5))
        assert ls["time_source"] == "measured"
        assert float(ls["time_to_target_s"]) == pytest.approx(t_ls, rel=1e-5)
        assert float(ls["speedup_over_allreduce"]) == pytest.approx(32.0 / t_ls, rel=1e-5)
        assert "| 4mbit | allreduce SGD | 32.0* |" in (out / "links_table.md").read_text()
        assert res["figures"] == ["links_100mbit.png", "links_4mbit.png"]
        # rho at 100 Mbit/s: 2 (1/2) 4 n 1e-8 s over allreduce SGD's compute (60 - 1) / 16 s
        t = 4 * 470_784 * 1e-8
        assert float(summary[("100mbit", "allreduce SGD")]["rho"]) == pytest.approx(
            t / (59 / 16), rel=1e-5)
        found = "\n".join(res["findings"])
        assert "Bit-identical training across rates: 2 of 2 runs" in found, found
        # --add keeps the other methods' runs and the probes, drops the re-run method's
        kept, kept_probes = lk.recorded_except(out, ["LSGD worker=node"])
        assert {(r["rate"], r["method"]) for r in kept} == {("100mbit", "allreduce SGD"),
                                                           ("4mbit", "allreduce SGD")}
        assert kept_probes == probes
        a, b = lk.fit_rate([(1e8, 1.0 + 2e6 / 1e8), (4e6, 1.0 + 2e6 / 4e6)])
        assert (a, b) == (pytest.approx(1.0), pytest.approx(2e6))
        # the planner's own example: 1 B parameters, 16 x 8, 640 ms, 100 Gbit/s is rho 0.938
        assert "--inter-gbps 100 " in lk.stands_for(0.9375), lk.stands_for(0.9375)
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:     # the experiments' own modules only
            if str(REPO / "results") in str(getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]


def test_rho_of_the_recorded_network_runs_and_the_language_model(tmp_path):
    """rho into the network experiment's recorded tables (--refresh-rho, training nothing),
    by hand from the probed link; the language model's parameter count that rho moves."""
    import importlib.util
    import json
    path, modules = list(sys.path), set(sys.modules)
    try:
        mods = {}
        for name in ("network", "lm"):
            spec = importlib.util.spec_from_file_location(
                f"results_{name}", REPO / "results" / "experiments" / f"{name}.py")
            mods[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mods[name])
        out = tmp_path / "network"
        out.mkdir()
        doc = json.loads((REPO / "results" / "network" / "network.json").read_text())
        for r in doc["rows"]:
            for k in ("rho", "rho_allreduce_s", "rho_compute_s", "rho_source"):
                r.pop(k, None)
        (out / "network.json").write_text(json.dumps(doc))
        found = mods["network"].refresh_rho(out)
        rows = _csv(out / "time_to_accuracy.csv")
        ar = next(r for r in rows if (r["rate"], r["method"]) == ("1gbit", "allreduce"))
        # 2 nodes: 2 (1/2) 4 n beta_e + 2 alpha_e, n = 1,126,410 (mlp_wide on digits)
        inter = doc["prediction"]["1gbit"]["inter"]
        t = 4 * 1_126_410 * inter["beta_s"] + 2 * inter["alpha_s"]
        assert float(ar["rho_allreduce_s"]) == pytest.approx(t, rel=1e-5)
        compute = float(ar["step_time_s"]) - float(ar["comm_s_per_step"])
        assert float(ar["rho"]) == pytest.approx(t / compute, rel=1e-4)
        assert len(found) == 2 and found[0].startswith("rho at 1gbit: ")
        # benchmarks/time_to_accuracy.py: rho per rate in its results and rows
        tta = sys.modules["time_to_accuracy"]
        run = {"time_to_target": 1.0, "compute_s_per_step": 0.02, "comm_s_per_step": 0.01,
               "curve": []}
        probe = {"probe": {"inter": {"alpha_s": 0.0, "beta_s_per_byte": 1e-9}}}
        res = tta.summarise({"target": 0.9, "seeds": [0], "steps": 10},
                            {"1gbit": {"runs": {"allreduce": {0: run}}, "probe": probe}}, {}, [])
        t = 4 * 1_126_410 * 1e-9
        assert res["results"]["1gbit"]["rho"] == pytest.approx(t / 0.02)
        assert res["rows"][0]["data"]["rho_source"] == "predicted"
        assert f"rho {t / 0.02:.3g} (predicted)" in res["rows"][0]["figures"]
        # the language model (examples/char_lm.py at lm.WORKLOAD's sizes)
        sys.path.insert(0, str(REPO / "examples"))
        import char_lm
        model = char_lm.ByteLM(128, 2, 4, 64)
        assert mods["lm"].N_PARAMS == sum(p.numel() for p in model.parameters())
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:     # the experiments' own modules only
            if str(REPO / "results") in str(getattr(sys.modules[name], "__file__", "") or "") \
                    or name == "char_lm":
                del sys.modules[name]
