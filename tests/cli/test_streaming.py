"""Streaming DiLoCo (--fragments, --fragment-sync-delay, --fragment-update-alpha) and LSGD's
--pull-delay in real runs under mpirun: they train, and their bytes land on the steps the
rules say (a fragment's allreduce when it starts; a delayed broadcast at its election)."""

import sys

import h5py
import numpy as np
import pytest

from mpi_util import run_mpi

# digits_cnn's parameters in model order (see test_train.py) and BatchNorm statistics:
# features.0.weight 144 | features.1 (BN) 16 + 16 | features.4.weight 4608 | features.5 (BN)
# 32 + 32 | classifier.1 1280 + 10. Two fragments of near-equal size, whole tensors: the
# boundary nearest 6138 / 2 is after features.4.weight (4784 parameters); each BatchNorm's
# running mean and variance travel with the fragment of its weight.
FRAGMENT_BYTES = (4 * (4784 + 2 * 16), 4 * (1354 + 2 * 32))
PARAM_BYTES = 4 * 6138
ELECTION_BYTES = 16


def read(run_dir, n):
    out = []
    for r in range(n):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            out.append({g: {c: f[g][c][()] for c in f[g]} for g in f})
    return out


def per_step(train, column):
    return np.diff(np.concatenate([[0], train[column]])), train["step"]


def learned(ranks):
    for m in ranks:
        loss = m["train"]["loss"]
        assert loss[-20:].mean() < 0.5 * loss[:10].mean(), (loss[:10], loss[-20:])
    assert np.mean([m["eval"]["test_accuracy"][-1] for m in ranks]) >= 0.85


@pytest.mark.mpi
def test_streaming_diloco_run_trains_and_sends_one_fragment_at_a_time(tmp_path):
    """H = 8, P = 2, tau = 1, alpha = 0.5 on digits, 2 ranks: fragment f's allreduce starts at
    every step t with t + 1 a multiple of 4 (f = ((t + 1) / 4 - 1) mod 2), and nothing else
    is sent; /train/outer_grad_norm is set from the first sync (step 4) on."""
    run = tmp_path / "stream"
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                       "--algorithm", "diloco", "--local-steps", "8", "--fragments", "2",
                       "--fragment-sync-delay", "1", "--fragment-update-alpha", "0.5",
                       "--seed", "4", "--consensus-every", "0"], timeout=300)
    assert "done: 120 steps" in proc.stdout
    ranks = read(run, 2)
    learned(ranks)
    for m in ranks:
        t = m["train"]
        for column in ("comm_bytes_sent", "comm_bytes_recv"):
            got, steps = per_step(t, column)
            want = np.where((steps + 1) % 4 == 0,
                            np.choose(((steps + 1) // 4 - 1) % 2, FRAGMENT_BYTES), 0)
            assert np.array_equal(got, want), (column, got[:12], want[:12])
        norm = t["outer_grad_norm"]
        assert np.all(np.isnan(norm[t["step"] < 4])) and np.all(np.isfinite(norm[t["step"] >= 4]))


@pytest.mark.mpi
def test_lsgd_pull_delay_run_on_two_nodes_trains(tmp_path):
    """--pull-delay 2 on 4 ranks as 2 nodes (tau_L 4, tau_G 8 from the digits preset): it
    trains, the elections agree, and every broadcast's bytes are those of the blocking pull
    (the delayed global broadcast crosses node boundaries once per node too). Each rank
    counts what it receives at the election's step (it posts its receive then) and what it
    sends when it posts the send: a node root forwards the global leader's copy once it
    has it, at the election's step or one of the d steps after."""
    run = tmp_path / "delay"
    proc = run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                       "--algorithm", "lsgd", "--pull-delay", "2", "--ranks-per-node", "2",
                       "--seed", "4", "--consensus-every", "0"], timeout=300)
    assert "done: 120 steps" in proc.stdout
    ranks = read(run, 4)
    learned(ranks)
    node_of = [0, 0, 1, 1]
    leaders = {}
    for r, m in enumerate(ranks):
        L = m["leader"]
        for step, scope, lead in zip(L["step"], L["scope"], L["leader_rank"]):
            key = (int(step), "global" if scope == 0 else node_of[r])
            assert leaders.setdefault(key, int(lead)) == int(lead)
    recv = np.array([per_step(m["train"], "comm_bytes_recv")[0] for m in ranks])
    sent = np.array([per_step(m["train"], "comm_bytes_sent")[0] for m in ranks])
    steps = ranks[0]["train"]["step"]
    assert np.array_equal(steps, np.arange(1, 121))
    window = {}                  # election step -> bytes sent by all ranks in [s, s + 2]
    for i, step in enumerate(steps):
        s = int(step) - int(step) % 4
        if int(step) % 4 <= 2 and s > 0:
            window[s] = window.get(s, 0) + int(sent[:, i].sum())
        else:
            assert sent[:, i].sum() == 0, int(step)
    for i, step in enumerate(steps):
        want_recv, want_sent = np.zeros(4, dtype=np.int64), 0
        if step % 4 == 0:
            for r in range(4):
                want_recv[r] += ELECTION_BYTES + (
                    PARAM_BYTES if r != leaders[(int(step), node_of[r])] else 0)
            want_sent += 4 * ELECTION_BYTES + 2 * PARAM_BYTES
        if step % 8 == 0:
            g = leaders[(int(step), "global")]
            want_recv += [ELECTION_BYTES + (PARAM_BYTES if r != g else 0) for r in range(4)]
            want_sent += 4 * ELECTION_BYTES + 3 * PARAM_BYTES
        assert np.array_equal(recv[:, i], want_recv), (int(step), recv[:, i], want_recv)
        if step % 4 == 0:
            assert window[int(step)] == want_sent, (int(step), window[int(step)], want_sent)
