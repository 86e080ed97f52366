"""results/experiments/network.py without the cluster: every method it runs has a prediction
(DiLoCo, SlowMo and LSGD under both leader scores included), the prediction is the cost
model's, and the findings name LSGD's ratio to the best baseline and what the held-out score
changed."""

import importlib.util
import math

import pytest

from mpi_util import REPO


def _experiment():
    spec = importlib.util.spec_from_file_location(
        "network_experiment", REPO / "results" / "experiments" / "network.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(t_step, comm, steps):
    return {"time_per_step": t_step, "compute_s_per_step": t_step - comm,
            "comm_s_per_step": comm, "step_to_target": steps,
            "time_to_target": steps * t_step if steps else math.inf,
            "time_to_target_mean_over_ranks": math.inf, "final_accuracy": 0.95,
            "bytes_sent_per_step": 1e6, "model": "mean over ranks"}


def _results(net, labels):
    """Two rates, two seeds, every label: step time = 20 ms local + a communication that grows
    with the slower link."""
    out = {}
    for rate, gbps, comm in (("1gbit", 1.0, 0.03), ("10gbit", 10.0, 0.006)):
        link = {"alpha_s": 50e-6, "beta_s_per_byte": 8 / (gbps * 1e9)}
        seeds = {}
        for i, label in enumerate(labels):
            c = comm * (1 + 0.1 * i)
            steps = 40 if label == net.LSGD_HELDOUT[0] else 20 + 5 * i
            seeds[label] = {"0": _run(0.02 + c, c, steps), "1": _run(0.021 + c, c, steps)}
        out[rate] = {"seeds": seeds, "probe": {"probe": {"intra": {"alpha_s": 5e-6,
                                                                   "beta_s_per_byte": 1e-10},
                                                         "inter": link}}}
    return out


def test_every_method_is_predicted_by_its_cost_model():
    net = _experiment()
    tta, cm = net.tta, net.scale_model.cm
    labels = [m[0] for m in net.METHODS] + [tta.DDP_LABEL]
    assert {"diloco H=8", "slowmo T=8", net.LSGD_TRAIN[0], net.LSGD_HELDOUT[0]} <= set(labels)
    assert net.LSGD_HELDOUT[2][-2:] == ["--leader-score", "heldout"]
    assert len(set(labels)) == len(labels) == 10
    results = _results(net, labels)
    mem = 5e9
    pred = net.predict(results, mem)
    assert set(pred) == {"1gbit", "10gbit"}
    for rate, p in pred.items():
        assert p["fitted_on"] == [r for r in pred if r != rate]       # leave one rate out
        assert set(p["step_s"]) == set(labels)
        assert all(math.isfinite(v) and v > p["t_local_s"] for v in p["step_s"].values())
        # the model of each method, with the fitted parameters and the probed links
        fit = p["fit"]
        inter = cm.Link(p["inter"]["alpha_s"] * fit["latency_scale"], p["inter"]["beta_s"])
        intra = cm.Link(p["intra"]["alpha_s"] * fit["latency_scale"], p["intra"]["beta_s"])
        c = cm.Cluster(tta.NODES, tta.RANKS_PER_NODE, intra, inter, mem_Bps=mem,
                       call_overhead_s=fit["call_overhead_s"], checks=True)
        from lsgd_hpc.planning.plan import model_facts
        facts = model_facts(tta.MODEL, "digits")
        w = cm.Workload(facts.n_params, facts.n_buffers, p["t_local_s"])
        coll = cm.Collectives(fit["allreduce"])
        want = {"diloco H=8": cm.diloco(w, c, 8, coll),
                "slowmo T=8": cm.slowmo(w, c, 8, 16, coll),
                "local-sgd T=8": cm.local_sgd(w, c, 8, coll),
                net.LSGD_TRAIN[0]: cm.lsgd(w, c, 4, 8),
                net.LSGD_HELDOUT[0]: cm.lsgd(w, c, 4, 8)}
        for label, cost in want.items():
            assert math.isclose(p["step_s"][label], p["t_local_s"] + cost.comm_s,
                                rel_tol=1e-9), (rate, label)
        # DiLoCo: one allreduce of the flat vector every H; SlowMo: local SGD's plus passes
        assert p["step_s"]["slowmo T=8"] > p["step_s"]["local-sgd T=8"]
        assert math.isclose(cm.diloco(w, c, 8, coll).bytes_per_step, w.flat_bytes / 8)
        assert p["step_s"][net.LSGD_HELDOUT[0]] == p["step_s"][net.LSGD_TRAIN[0]]
    # the fit takes each modelled method once: not held-out LSGD, async LSGD nor DDP
    fitted = net._settings(results)["1gbit"]["runs"]
    assert set(fitted) == {m[0] for m in tta.METHODS}
    rows = net.table_rows(results, pred)
    assert {r["method"]: r["fitted"] for r in rows if r["rate"] == "1gbit"}[
        net.LSGD_HELDOUT[0]] is False
    found = net.findings(rows, list(tta.RATES), 0.93, 2, pred)
    text = "\n".join(found)
    for rate in ("1 Gbit/s", "10 Gbit/s"):
        ratio = [f for f in found if f.startswith(rate) and "the best baseline's" in f]
        assert len(ratio) == 1 and all(m[0] in ratio[0] for m in net.METHODS[:3]), ratio
        assert "ratio" in ratio[0]
    assert text.count("the held-out leader score against the train score") == 2
    # rho a row: one fp32 allreduce of n parameters between the 2 nodes from the probed link,
    # 2 alpha + 2 (1/2) 4 n beta, over the row's step time less its communication
    n = 1_000_000
    net.add_rho(rows, pred, n)
    ar = next(r for r in rows if (r["rate"], r["method"]) == ("1gbit", "allreduce"))
    link = pred["1gbit"]["inter"]
    t = 2 * link["alpha_s"] + 4 * n * link["beta_s"]
    assert ar["rho_allreduce_s"] == pytest.approx(t)
    assert ar["rho"] == pytest.approx(t / (ar["step_time_s"] - ar["comm_s_per_step"]))
    assert ar["rho_source"] == "predicted"
    assert net.rho_findings(rows, n)[0].startswith("rho at 1gbit: ")


def test_slowmo_equal_to_local_sgd_is_a_finding():
    """Within 60 steps SlowMo (u from 0, alpha 1, one slow step) trains as local SGD: said
    where the curves agree in every seed, not where one differs."""
    net = _experiment()
    curve = [{"step": 5 * k, "accuracy": 0.5 + 0.04 * k, "time": 0.1 * k} for k in range(1, 9)]
    other = [dict(c, accuracy=c["accuracy"] + (0.01 if c["step"] == 20 else 0)) for c in curve]
    results = {"1gbit": {"curves": {net.LOCAL_SGD_LABEL: {"0": curve, "1": curve},
                                    net.SLOWMO_LABEL: {"0": list(curve), "1": list(curve)}}},
               "10gbit": {"curves": {net.LOCAL_SGD_LABEL: {"0": curve, "1": curve},
                                     net.SLOWMO_LABEL: {"0": list(curve), "1": other}}}}
    found = net.slowmo_as_local_sgd(results, ["1gbit", "10gbit"])
    assert len(found) == 1 and found[0].startswith("1 Gbit/s"), found
