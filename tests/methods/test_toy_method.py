"""A method written outside the package, by a rule and its state declaration only, gets what
every method of the package has: an exact resume from a checkpoint, the survivors' recovery
from a killed rank under ``mpirun --with-ft ulfm``, and the rejoin of the lost rank at a
full-size resume. This file is also the MPI program the tests run:

    mpirun -np 4 python tests/methods/test_toy_method.py RUN_DIR --steps N [options]
"""

import argparse
import json
import sys

import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.rules.state import digest
from lsgd_hpc.methods.spec import MethodSpec


# -- the toy method: its maths and its state declaration, nothing else ---------------------------
class AnchorRule(Rule):
    """Every 2 steps the anchor a becomes the mean of the workers' parameters and each worker
    moves halfway to it, x <- (x + a) / 2; each worker also keeps a trail, the moving average
    of its own parameters (0.9 per step)."""

    name = "anchor"
    shared_state = ("anchor",)        # identical on every rank
    own_state = ("trail",)            # this rank's

    def __init__(self, groups, flat, log=None):
        super().__init__(groups, flat, log)
        self.anchor = flat.params.detach().clone()
        self.trail = torch.zeros_like(flat.params)

    def after_step(self, step: int, loss: float) -> None:
        x = self.flat.params
        self.trail.mul_(0.9).add_(x, alpha=0.1)
        if step % 2 == 0:
            self.anchor.copy_(x)
            self.world.allreduce_(self.anchor, "mean")
            x.add_(self.anchor).mul_(0.5)


class AnchorSGD(lsgd_hpc.Method):
    spec = MethodSpec(name="anchor", class_name="AnchorSGD", summary="a test's toy method",
                      options=(), cost=None)

    def build(self, options):
        return AnchorRule(self.groups, self.flat, log=self.log)


# -- the MPI program -------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", default="")
    p.add_argument("--shrink", action="store_true")
    args = p.parse_args(argv)
    comm = lsgd_hpc.init(backend="mpi", device="cpu", ranks_per_node=2,
                         on_failure="shrink" if args.shrink else "abort")
    me = comm.initial_rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(10 + me)
    data_x = torch.randn(64, 6, generator=g)
    data_y = (data_x[:, 0] > 0).long() + (data_x[:, 1] > 0).long()
    method = AnchorSGD(model, opt, comm, max_steps=args.steps,
                       checkpoint_every=args.checkpoint_every)
    ckpt = lsgd_hpc.Checkpointer(args.run_dir, comm, model=model, optimizer=opt, method=method)
    out = {"initial_rank": me}
    if args.resume:
        out["restored_step"] = ckpt.restore()
        out["rejoined"] = ckpt.rejoined
        out["anchor_after_restore"] = digest(method.rule.anchor)
    if args.kill:
        from lsgd_hpc.comm.injection import inject_failures
        inject_failures(args.kill, comm)
    while not method.done:
        lo = (method.steps * 8) % 64           # the batch of each step: a resume sees the same
        loss = nn.functional.cross_entropy(model(data_x[lo:lo + 8]), data_y[lo:lo + 8])
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        if method.checkpoint_due:
            ckpt.save()
    out.update(steps=method.steps, size=comm.size, params=digest(method.flat.flat),
               optimizer=digest(opt.state_dict()["state"]), anchor=digest(method.rule.anchor),
               trail=digest(method.rule.trail))
    method.close()
    print("TOYRESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


# -- the tests ---------------------------------------------------------------------------------------
def _run(np_, run_dir, *args, ulfm=False):
    from mpi_util import run_mpi
    proc = run_mpi(np_, [sys.executable, __file__, str(run_dir), *args], timeout=240,
                   mpi_args=["--with-ft", "ulfm"] if ulfm else [])
    rows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("TOYRESULT ")]
    return {r["initial_rank"]: r for r in rows}


@pytest.mark.mpi
def test_the_toy_method_resumes_exactly(tmp_path):
    """8 steps at once, and 4 steps then a resume from their checkpoint to 8: the same bits
    on every rank (parameters, optimizer, shared anchor, own trail)."""
    whole = _run(2, tmp_path / "whole", "--steps", "8")
    _run(2, tmp_path / "split", "--steps", "4", "--checkpoint-every", "4")
    resumed = _run(2, tmp_path / "split", "--steps", "8", "--resume")
    assert sorted(whole) == sorted(resumed) == [0, 1]
    for rank in (0, 1):
        assert resumed[rank]["restored_step"] == 4
        for key in ("steps", "params", "optimizer", "anchor", "trail"):
            assert resumed[rank][key] == whole[rank][key], (rank, key)
    assert whole[0]["trail"] != whole[1]["trail"]            # its own: it differs by rank
    assert whole[0]["anchor"] == whole[1]["anchor"]


@pytest.mark.mpi
def test_the_toy_method_recovers_and_the_lost_rank_rejoins(tmp_path):
    """Rank 1 killed at step 5 under shrink: the 3 survivors finish 8 steps with one anchor;
    the job resumes their last checkpoint at the full 4 ranks, rank 1 rejoins, and all 4
    hold the same anchor from the restore on and finish 12 steps."""
    run_dir = tmp_path / "run"
    survivors = _run(4, run_dir, "--steps", "8", "--checkpoint-every", "4", "--kill", "1:5",
                     "--shrink", ulfm=True)
    assert sorted(survivors) == [0, 2, 3]
    assert {r["steps"] for r in survivors.values()} == {8}
    assert {r["size"] for r in survivors.values()} == {3}
    assert len({r["anchor"] for r in survivors.values()}) == 1
    full = _run(4, run_dir, "--steps", "12", "--resume", "--shrink", ulfm=True)
    assert sorted(full) == [0, 1, 2, 3]
    for r in full.values():
        assert (r["restored_step"], r["rejoined"], r["steps"], r["size"]) == (8, [1], 12, 4)
    assert full[1]["anchor_after_restore"] == survivors[0]["anchor"]
    assert len({r["anchor_after_restore"] for r in full.values()}) == 1
    assert len({r["anchor"] for r in full.values()}) == 1
