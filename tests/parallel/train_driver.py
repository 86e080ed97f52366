"""Run lsgd_hpc.train.main in one MPI job several times, with optional fault injection.

    mpirun -np N python tests/parallel/train_driver.py RUN_DIR_PREFIX ALG[,ALG...] -- [train options]
Each algorithm trains into RUN_DIR_PREFIX-ALG (one interpreter start for all of them), with
the train options that are not another method's (the trainer refuses those: shared lists such
as "--local-steps 4 --tau-local 4" give each algorithm its own);
ALG@TOPOLOGY (gossip@torus) adds --topology TOPOLOGY and trains into RUN_DIR_PREFIX-ALG-TOPOLOGY.
LSGD_FAULT="kind:rank:step" makes that rank, after that step, raise (kind=raise), die by
SIGKILL (kill) or send itself SIGTERM (sigterm, a preemption at a known step).
LSGD_EVAL_SLEEP=SECONDS makes every evaluation of a model sleep that long first (an
artificially slow evaluation, to check that the training time leaves it out).
"""

import os
import signal
import sys
import time

from lsgd_hpc.cli import train
from lsgd_hpc.methods.rules.base import Rule


def inject(kind: str, rank: int, step: int) -> None:
    from lsgd_hpc.comm.launcher import env_rank      # mpirun's, srun's or torchrun's rank
    if env_rank() != rank:
        return
    for cls in Rule.__subclasses__():
        original = cls.after_step

        def after_step(self, s, loss, _orig=original):
            _orig(self, s, loss)
            if s == step:
                print(f"FAULT_AT {time.time():.3f}", file=sys.stderr, flush=True)
                if kind == "raise":
                    raise RuntimeError(f"injected fault at step {s}")
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)

        cls.after_step = after_step


def slow_evaluation(seconds: float) -> None:
    from lsgd_hpc.cli.evaluate import Evaluator
    original = Evaluator.loss_accuracy

    def loss_accuracy(self, batches=None, _orig=original):
        time.sleep(seconds)
        return _orig(self, batches)

    Evaluator.loss_accuracy = loss_accuracy


def own_options(alg: str, args: list) -> list:
    """``args`` without the options of methods other than ``alg`` (and their values)."""
    from lsgd_hpc.methods.registry import SPECS
    mine = {o.flag for o in SPECS[alg].options if o.cli}
    foreign = {}                                # flag -> takes no value
    for spec in SPECS.values():
        for o in spec.options:
            if o.cli and o.flag not in mine:
                foreign[o.flag] = o.kind == "bool"
                if o.kind == "bool":
                    foreign["--no-" + o.flag[2:]] = True
    out, i = [], 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in foreign:
            i += 1 if foreign[flag] or "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def main() -> int:
    prefix, algs = sys.argv[1], sys.argv[2].split(",")
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    fault = os.environ.get("LSGD_FAULT")
    if fault:
        kind, rank, step = fault.split(":")
        inject(kind, int(rank), int(step))
    if os.environ.get("LSGD_EVAL_SLEEP"):
        slow_evaluation(float(os.environ["LSGD_EVAL_SLEEP"]))
    for spec in algs:
        alg, _, topo = spec.partition("@")
        opts = ["--topology", topo] if topo else []
        rc = train.main(["--algorithm", alg, *opts, "--run-dir",
                         f"{prefix}-{spec.replace('@', '-')}", *own_options(alg, extra)])
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
