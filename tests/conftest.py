import os
import sys
from pathlib import Path

import pytest

# Ranks (and this process) share two cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The helpers (mpi_util, cluster_util) live here; the tests mirror the package's folders
# (comm/, methods/, runtime/, cli/, ...), and a few import a helper from a test module of
# another folder by name: every folder is on the path, and test module names are unique.
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.extend(str(d) for d in sorted(_HERE.iterdir())
                if d.is_dir() and any(d.glob("test_*.py")) and d.name != "parallel")

#: Tests that need root, network namespaces, a SLURM cluster or a Horovod build. Where those
#: are missing they skip, naming what is missing; with CI=true such a skip is a failure, so
#: a CI run cannot go green without them.
CI_REQUIRED_MARKERS = ("cluster", "netns", "horovod")


@pytest.hookimpl(tryfirst=True)        # before xdist reads the groups (loadgroup)
def pytest_collection_modifyitems(config, items):
    # Every test about Horovod carries "horovod" in its name or parameters: mark it, so the
    # CI rule below covers the backend tests wherever they live.
    for item in items:
        if "horovod" in item.nodeid.lower() and item.get_closest_marker("horovod") is None:
            item.add_marker(pytest.mark.horovod)
        # Under pytest-xdist (make test: -n 2 --dist loadgroup) the emulated-cluster tests run
        # one after another on one worker: they share the cluster's nodes, and they mostly wait
        # on SLURM's timers, so the other worker runs the CPU-bound tests meanwhile.
        if item.get_closest_marker("cluster") or item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        # A module-scoped fixture (one mpirun job whose runs several tests read) is set up
        # once per worker that runs one of its tests: keep such a module's tests on one
        # worker, or both workers pay for the same job.
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module"
               for defs in info.name2fixturedefs.values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("CI", "").lower() not in ("true", "1"):
        return
    marks = [m for m in CI_REQUIRED_MARKERS if item.get_closest_marker(m) is not None]
    if not marks:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"CI=true: a {'/'.join(marks)} test must run in CI, but it skipped: "
                       f"{reason}")


@pytest.fixture(scope="session")
def cluster_nodes():
    """Emulated nodes (network namespaces with their own host names), SLURM when it could be
    started; see tests/cluster_util.py. Skips, naming what is missing, without root."""
    from cluster_util import session_cluster
    with session_cluster() as cl:
        yield cl


@pytest.fixture(scope="session")
def slurm_cluster(cluster_nodes):
    """The emulated nodes with a real SLURM (munge, slurmctld, one slurmd per node)."""
    if not cluster_nodes.slurm:
        pytest.skip(f"no SLURM on the emulated cluster: {cluster_nodes.why_no_slurm}")
    return cluster_nodes


@pytest.fixture(scope="session")
def forked_cli():
    """`python -m lsgd_hpc.train` runs that fork from one helper that imported the CLI once
    (tests/cli_fork.py): for tables of cases that each end before training."""
    from cli_fork import ForkedCLI
    cli = ForkedCLI()
    yield cli
    cli.close()
