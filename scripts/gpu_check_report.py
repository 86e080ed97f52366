"""scripts/gpu_check.sh's JSON helper: one record per sub-run, the report, the machine's facts.

    python scripts/gpu_check_report.py record --name N --status S --exit C --seconds T
                                              --run-dir D --log L -- CMD...
    python scripts/gpu_check_report.py report --records FILE --out FILE ...
    python scripts/gpu_check_report.py facts
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

#: keys of every sub-run's record, in the report
RECORD_KEYS = ("name", "status", "exit", "seconds", "step_time_s", "final_accuracy",
               "command", "log_tail", "result")
#: keys of the report
REPORT_KEYS = ("status", "machine", "trainer", "settings", "runs", "summary")


def run_metrics(run_dir: str) -> dict:
    """Step time (slowest rank, seconds per step after the first 5) and final test accuracy
    (mean over ranks; EASGD's centre where present) from the run's HDF5 files."""
    out = {"step_time_s": None, "final_accuracy": None}
    files = sorted(glob.glob(os.path.join(run_dir or "", "metrics", "rank*.h5")))
    if not files:
        return out
    try:
        import h5py
        times, accs = [], []
        for f in files:
            with h5py.File(f, "r", locking=False) as h:
                t = h["train"]
                col = "training_time" if "training_time" in t else "wall_time"
                step, clock = t["step"][:], t[col][:]
                if len(step) >= 2:
                    a = min(5, len(step) - 2)
                    times.append(float(clock[-1] - clock[a]) / float(step[-1] - step[a]))
                e = h["eval"]
                key = "center_test_accuracy" if "center_test_accuracy" in e else "test_accuracy"
                if len(e[key]):
                    accs.append(float(e[key][-1]))
        out["step_time_s"] = max(times) if times else None
        out["final_accuracy"] = sum(accs) / len(accs) if accs else None
    except Exception as exc:            # damaged or partial files: say so, keep the record
        out["metrics_error"] = f"{type(exc).__name__}: {exc}"
    return out


def cmd_record(a) -> int:
    rec = {"name": a.name, "status": a.status, "exit": int(a.exit) if a.exit else None,
           "seconds": float(a.seconds), "step_time_s": None, "final_accuracy": None,
           "command": a.command, "log_tail": "", "result": None}
    if a.log and os.path.exists(a.log):
        with open(a.log, errors="replace") as fh:
            rec["log_tail"] = "".join(fh.readlines()[-15:])[-3000:]
    rec.update(run_metrics(a.run_dir))
    js = a.run_dir + ".json" if a.run_dir else ""
    if js and os.path.exists(js):       # a benchmark's own JSON (collectives)
        with open(js) as fh:
            res = json.load(fh)
        rec["result"] = {k: res.get(k) for k in ("device", "np", "efficiency",
                                                  "lowest_unchecked", "rows")}
    if a.name == "facts" and rec["log_tail"]:
        try:
            rec["result"] = json.loads(rec["log_tail"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    print(json.dumps(rec, default=str))
    return 0


def cmd_report(a) -> int:
    runs = []
    with open(a.records) as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                runs.append({k: rec.get(k) for k in RECORD_KEYS})
    counts = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    facts = next((r["result"] for r in runs if r["name"] == "facts"), None)
    report = {
        "status": "dry-run" if a.dry_run == "1" else "done",
        "machine": facts,
        "trainer": {"methods": a.methods.split(), "backends": a.backends.split(),
                    "precisions": a.precisions.split()},
        "settings": {"steps": a.steps, "timeout_s": a.timeout, "budget_s": a.budget,
                     "seconds": a.seconds},
        "runs": runs,
        "summary": {"counts": counts,
                    "step_time_s": {r["name"]: r["step_time_s"] for r in runs
                                    if r["step_time_s"] is not None}},
    }
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, default=lambda x: None if isinstance(x, float)
                  and not math.isfinite(x) else str(x))
    os.replace(tmp, a.out)
    return 0


def cmd_facts(_a) -> int:
    """The GPU, torch's CUDA and NCCL, the MPI library and whether it says it is CUDA-aware."""
    facts = {}
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["cuda_available"] = torch.cuda.is_available()
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cuda"] = torch.version.cuda
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) \
            if torch.cuda.is_available() else None
        facts["bf16_supported"] = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except Exception as exc:
        facts["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from mpi4py import MPI
        facts["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        # 'yes', 'no' or 'unknown', as the doctor asks the loaded libmpi
        from lsgd_hpc.cli.doctor import cuda_aware_mpi
        facts["mpix_query_cuda_support"] = cuda_aware_mpi()
    except Exception as exc:
        facts["mpi_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(facts, default=str))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    for k in ("--name", "--status", "--exit", "--seconds", "--run-dir", "--log"):
        r.add_argument(k, default="")
    r.add_argument("command", nargs="*")
    q = sub.add_parser("report")
    for k in ("--records", "--out", "--dry-run", "--methods", "--backends", "--precisions",
              "--steps", "--timeout", "--budget", "--seconds"):
        q.add_argument(k, default="")
    sub.add_parser("facts")
    a = p.parse_args(argv)
    return {"record": cmd_record, "report": cmd_report, "facts": cmd_facts}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
