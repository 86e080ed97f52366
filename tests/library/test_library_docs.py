"""Every code block of docs/library.md runs, and its table of methods is the registry's.

The convention (an HTML comment on the line before a fenced block; every ```python block must
have one):

- ``<!-- test: setup NAME -->``: a fragment that defines things (a model, data); it runs only
  as part of the blocks that use it.
- ``<!-- test: run np=N [uses=NAME,...] [times=K] [rc=R] [expect=PATH,...] [stdout="TEXT"]
  [mpi="ARGS"] -->``:
  the block, after the setup blocks it uses, is a script run under ``mpirun ARGS -np N`` (K times,
  each must exit R, default 0) in a fresh folder; then every PATH must exist there and the
  last run's output must contain TEXT (the marker is split like a shell line).
  Blocks with ``np=2`` and no ``mpi`` or ``rc`` share one ``mpirun -np 2`` job (a python,
  torch and MPI start-up a rank costs seconds; the suite's time): each runs (K times) as
  ``__main__`` in a fresh namespace, in a fresh folder of its own, one after another between
  barriers, the last run's output captured on its own.
- ``<!-- test: shell -->`` before a ```sh block: its lines run, in order, in the folder of the
  run block before it, after that block; each must exit 0.

The table between ``<!-- methods-table`` and ``<!-- /methods-table -->`` must be exactly
what :func:`methods_table` generates from the methods' specs (``METHODS[...].spec``).
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_util import REPO, mpi_env, run_mpi

DOC = REPO / "docs" / "library.md"
BLOCK = re.compile(r"(?:<!-- test: (?P<spec>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.S)


def blocks():
    """(spec dict, lang, body) of every fenced block, in order."""
    out = []
    for m in BLOCK.finditer(DOC.read_text()):
        spec = m.group("spec")
        fields = {}
        if spec:
            words = shlex.split(spec)
            fields["kind"] = words[0]
            for w in words[1:]:
                k, _, v = w.partition("=")
                fields[k] = v
        out.append((fields, m.group("lang"), m.group("body")))
    return out


def runs():
    setups, result = {}, []
    for spec, lang, body in blocks():
        if spec.get("kind") == "setup":
            setups[spec["name"] if "name" in spec else next(k for k in spec if k != "kind")] = body
    for i, (spec, lang, body) in enumerate(blocks()):
        if spec.get("kind") == "run":
            result.append({"index": i, "spec": spec, "body": body, "shell": []})
        elif spec.get("kind") == "shell":
            result[-1]["shell"].append(body)
    for r in result:
        uses = [u for u in r["spec"].get("uses", "").split(",") if u]
        r["script"] = "\n".join([setups[u] for u in uses] + [r["body"]])
    return result


def methods_table() -> str:
    """The table of docs/library.md, from the specs (lsgd_hpc.methods.registry): every
    option with its default, its values and the digits preset, in the classes' order."""
    from lsgd_hpc.data.specs import DATASETS
    from lsgd_hpc.methods import METHODS

    def values(o):
        if o.kind == "choice":
            return ", ".join(o.choices) if len(o.choices) <= 4 else f"{len(o.choices)} names"
        if o.kind in ("int", "float", "int_or_auto", "int_or_modules"):
            text = o._range() if o.kind == "float" else f">= {o.low:g}"
            return text + {"int_or_auto": " or auto",
                           "int_or_modules": " or a list of modules"}.get(o.kind, "")
        return o.kind

    lines = ["| name | class | option | default | values | digits preset |",
             "|---|---|---|---|---|---|"]
    for name, cls in METHODS.items():
        preset = DATASETS["digits"].preset(name)
        for i, o in enumerate(cls.spec.options):
            head = f"| `{name}` | `{cls.__name__}` |" if i == 0 else "| | |"
            default = f"`{o.default!r}`" + (f" ({o.none})" if o.default is None and o.none
                                              else "")
            shown = f"`{preset[o.name]!r}`" if o.name in preset else ""
            lines.append(f"{head} `{o.name}` | {default} | {values(o)} | {shown} |")
    return "\n".join(lines)


def test_every_python_block_is_marked_and_every_setup_used():
    used = {u for r in runs() for u in r["spec"].get("uses", "").split(",") if u}
    for spec, lang, body in blocks():
        if lang == "python":
            assert spec.get("kind") in ("setup", "run"), \
                f"docs/library.md: a python block without a test marker:\n{body[:200]}"
        if spec.get("kind") == "setup":
            assert set(spec) - {"kind"} <= used, f"setup block {spec} is used by no block"
    assert len(runs()) >= 10


def test_methods_table_matches_the_registry():
    text = DOC.read_text()
    table = text.split("<!-- methods-table")[1].split("-->", 1)[1]
    table = table.split("<!-- /methods-table -->")[0].strip()
    assert table == methods_table(), "regenerate the table:\n" + methods_table()


def test_every_public_name_is_exported():
    """What the guide calls as lsgd_hpc.NAME is importable from the package."""
    import lsgd_hpc
    from lsgd_hpc import methods, runtime, session
    for mod in (session, methods, runtime):
        missing = [n for n in mod.__all__ if not hasattr(lsgd_hpc, n)]
        assert missing == [], f"{mod.__name__}: not exported from lsgd_hpc: {missing}"
    used = set(re.findall(r"lsgd_hpc\.(\w+)\(", DOC.read_text()))
    assert used and all(hasattr(lsgd_hpc, n) for n in used), used


def test_the_contract_block_is_the_first():
    first = blocks()[0][2]
    assert "lsgd_hpc.init(backend=\"mpi\", ranks_per_node=None)" in first
    assert "method.step(loss)" in first


def shared(run) -> bool:
    """A block that can run in the shared job: np=2, exit 0, no launcher options."""
    spec = run["spec"]
    return spec.get("np", "2") == "2" and spec.get("rc", "0") == "0" and not spec.get("mpi")


#: Runs the shared blocks in one job: each (``times`` times) as __main__ in a fresh
#: namespace and its own folder, the last run's stdout captured; a result file per block and
#: rank, written before an error aborts the job (as the library's abort ends a block's own).
SHARED_DRIVER = """
import contextlib, gc, io, json, os, sys, traceback
from mpi4py import MPI
blocks = json.load(open(sys.argv[1]))
rank = MPI.COMM_WORLD.Get_rank()
for b in blocks:
    os.chdir(b["folder"])
    error = None
    for _ in range(b["times"]):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(b["script"], os.path.join(b["folder"], "block.py"), "exec"),
                     {"__name__": "__main__"})
        except BaseException:
            error = traceback.format_exc()
            break
        gc.collect()
        MPI.COMM_WORLD.Barrier()
    with open(os.path.join(b["folder"], f"result{rank}.json"), "w") as f:
        json.dump({"stdout": out.getvalue(), "error": error}, f)
    print(out.getvalue(), end="", flush=True)
    if error:
        print(error, file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
"""


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    """The shared blocks' job: ({block index: its folder}, the finished job)."""
    base = tmp_path_factory.mktemp("docblocks")
    todo = []
    for run in filter(shared, runs()):
        folder = base / f"block{run['index']}"
        folder.mkdir()
        (folder / "block.py").write_text(run["script"])
        todo.append({"index": run["index"], "folder": str(folder), "script": run["script"],
                     "times": int(run["spec"].get("times", "1"))})
    (base / "blocks.json").write_text(json.dumps(todo))
    (base / "driver.py").write_text(SHARED_DRIVER)
    job = run_mpi(2, [sys.executable, str(base / "driver.py"), str(base / "blocks.json")],
                  timeout=60 + 30 * sum(b["times"] for b in todo), cwd=base, check=False)
    return {b["index"]: Path(b["folder"]) for b in todo}, job


def check_after(run, folder, stdout):
    """What a block's marker asks of its run: the output, the files, its shell lines."""
    spec = run["spec"]
    assert spec.get("stdout", "") in stdout, f"{spec['stdout']!r} not printed:\n{stdout}"
    for path in [p for p in spec.get("expect", "").split(",") if p]:
        assert (folder / path).exists(), f"{path} was not written"
    for body in run["shell"]:
        for line in body.strip().splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            res = subprocess.run(line, shell=True, cwd=folder, env=mpi_env(),
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, f"{line}: exit {res.returncode}\n{res.stderr}"


@pytest.mark.mpi
@pytest.mark.parametrize("run", [r for r in runs() if shared(r)],
                         ids=lambda r: f"block{r['index']}")
def test_shared_block_runs(run, shared_job):
    folders, job = shared_job
    folder = folders[run["index"]]
    stdout = ""
    for rank in range(2):
        result = folder / f"result{rank}.json"
        assert result.exists(), (f"the shared job (exit {job.returncode}) did not finish this "
                                 f"block on rank {rank}\n{job.stdout[-3000:]}\n"
                                 f"{job.stderr[-4000:]}")
        got = json.loads(result.read_text())
        assert got["error"] is None, f"rank {rank}:\n{got['error']}"
        stdout += got["stdout"]
    check_after(run, folder, stdout)


@pytest.mark.mpi
@pytest.mark.parametrize("run", [r for r in runs() if not shared(r)],
                         ids=lambda r: f"block{r['index']}")
def test_block_runs(run, tmp_path):
    spec = run["spec"]
    script = tmp_path / "block.py"
    script.write_text(run["script"])
    np_ = int(spec.get("np", "2"))
    rc = int(spec.get("rc", "0"))
    for _ in range(int(spec.get("times", "1"))):
        res = run_mpi(np_, [sys.executable, str(script)], timeout=180, cwd=tmp_path,
                      check=False, mpi_args=shlex.split(spec.get("mpi", "")))
        assert res.returncode == rc, (f"exit {res.returncode}, expected {rc}\n{res.stdout}"
                                      f"\n{res.stderr[-4000:]}")
    check_after(run, tmp_path, res.stdout)
