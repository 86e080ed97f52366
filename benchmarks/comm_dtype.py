"""Accuracy and bytes of each --comm-dtype on a short digits run (the table in
docs/algorithms.md, "Quantized communication").

    python benchmarks/comm_dtype.py --out runs/comm_dtype [--np 4] [--steps 88]

4 ranks as 2 nodes, seed 0, each method at the period of the docs' bf16 table; one mpirun job
per (dtype, group of methods) through benchmarks/_train_many.py. Prints a markdown table of
the mean final test accuracy of the workers and the bytes sent by all ranks, and writes it
with the numbers to OUT/comm_dtype.json. Not part of run_all.py (accuracy, not speed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import h5py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lsgd_hpc.testing import run_mpi  # noqa: E402

#: method label -> (algorithm, its options)
METHODS = {
    "lsgd": ("lsgd", []),
    "easgd": ("easgd", []),
    "local-sgd (T 8)": ("local-sgd", ["--local-steps", "8"]),
    "diloco (H 8)": ("diloco", ["--local-steps", "8"]),
    "slowmo (T 4, every 8)": ("slowmo", ["--local-steps", "4", "--slowmo-every", "8"]),
}
DTYPES = {"fp32": [], "bf16": ["--comm-dtype", "bf16"], "int8": ["--comm-dtype", "int8"],
          "int8+EF": ["--comm-dtype", "int8", "--error-feedback"],
          "fp8": ["--comm-dtype", "fp8"], "fp8+EF": ["--comm-dtype", "fp8", "--error-feedback"]}


def final(run_dir: Path, np_: int):
    acc, sent = [], 0
    for r in range(np_):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            acc.append(float(f["eval"]["test_accuracy"][-1]))
            sent += int(f["train"]["comm_bytes_sent"][-1])
    return sum(acc) / len(acc), sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--steps", type=int, default=88)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    a = p.parse_args()
    dtypes = a.dtypes.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    common = ["--dataset", "digits", "--ranks-per-node", "2", "--max-steps", str(a.steps),
              "--eval-every", str(a.steps), "--seed", "0", "--consensus-every", "0"]
    results = {}
    for dtype in dtypes:
        argvs = []
        for label, (alg, opts) in METHODS.items():
            run = a.out / f"{dtype}-{alg}"
            argvs.append(["--algorithm", alg, "--run-dir", str(run), *common, *opts,
                          *DTYPES[dtype]])
        spec = a.out / f"{dtype}.json"
        spec.write_text(json.dumps(argvs))
        run_mpi(a.np, [sys.executable, str(HERE / "_train_many.py"), str(spec)], timeout=1800)
        for label, (alg, _) in METHODS.items():
            results.setdefault(label, {})[dtype] = final(a.out / f"{dtype}-{alg}", a.np)
    head = ["method"] + [f"{d} accuracy" for d in dtypes] + [f"{d} bytes" for d in dtypes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, by in results.items():
        lines.append("| " + " | ".join([label] + [f"{100 * by[d][0]:.2f} %" for d in dtypes]
                                       + [f"{by[d][1] / 1e6:.2f} MB" for d in dtypes]) + " |")
    table = "\n".join(lines)
    print(table)
    (a.out / "comm_dtype.json").write_text(json.dumps({"results": results, "table": table},
                                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
