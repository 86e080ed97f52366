"""scripts/cluster.sh's package install, without root or apt: two installs started together.

On a fresh machine two `cluster.sh up` (two pytest workers) once installed SLURM at the same
time; one lost dpkg's lock and every cluster test skipped. The install now holds one lock
file (flock) for its check and install, and whoever waited checks again. Here apt-get is a
stand-in that records when it starts and ends, sleeps, and then "installs" stand-in SLURM
binaries and a libpmix.so that a stand-in ldconfig reports; PATH holds only those and links
to the few real tools the script needs, so the packages are missing whatever this machine
has installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mpi_util import REPO

CLUSTER_SH = REPO / "scripts" / "cluster.sh"
#: real tools the install path of cluster.sh (and the stand-ins) run
TOOLS = ("bash", "sh", "readlink", "dirname", "mkdir", "grep", "flock", "sleep", "date",
         "chmod", "touch", "cat", "ip", "tc", "nsenter", "unshare")
APT_SECONDS = 1.5

FAKE_APT = r"""#!/bin/bash
# stand-in apt-get: record start and end, take a while, then "install" the packages
echo "start $$ $(date +%s.%N) $*" >> "$APT_LOG"
case " $* " in
    *" install "*)
        sleep "$APT_SECONDS"
        for b in slurmctld slurmd munged mungekey sinfo; do
            printf '#!/bin/sh\nexit 0\n' > "$FAKE_BIN/$b"
            chmod +x "$FAKE_BIN/$b"
        done
        touch "$FAKE_BIN/.libpmix" ;;
esac
echo "end $$ $(date +%s.%N)" >> "$APT_LOG"
"""

FAKE_LDCONFIG = r"""#!/bin/bash
# stand-in ldconfig -p: libpmix.so once the stand-in apt-get has "installed" it
echo "3 libs found in cache \`/etc/ld.so.cache'"
echo "	libc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6"
[[ -e $FAKE_BIN/.libpmix ]] && echo "	libpmix.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libpmix.so"
exit 0
"""


@pytest.fixture
def fake_root(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        path = shutil.which(tool)
        if path is None:
            pytest.skip(f"no {tool} on PATH")
        os.symlink(path, bin_dir / tool)
    for name, text in (("apt-get", FAKE_APT), ("ldconfig", FAKE_LDCONFIG)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "APT_LOG": str(tmp_path / "apt.log"),
           "FAKE_BIN": str(bin_dir), "APT_SECONDS": str(APT_SECONDS),
           "LSGD_CLUSTER_INSTALL_LOCK": str(tmp_path / "lock" / "install.lock")}
    return tmp_path, env


def apt_calls(log: Path) -> list:
    """(pid, start, end, args) per stand-in apt-get call."""
    starts, ends = {}, {}
    for line in log.read_text().splitlines() if log.exists() else []:
        kind, pid, stamp, *args = line.split()
        (starts if kind == "start" else ends)[pid] = (float(stamp), args)
    return [(pid, starts[pid][0], ends.get(pid, (float("inf"),))[0], starts[pid][1])
            for pid in sorted(starts, key=lambda p: starts[p][0])]


@pytest.mark.timeout(120)
def test_concurrent_installs_do_not_overlap(fake_root):
    tmp, env = fake_root
    procs = [subprocess.Popen(["bash", str(CLUSTER_SH), "install", "--name", f"i{k}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for k in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    errs = "\n".join(f"[{k}] exit {p.returncode}: {o[1]}" for k, (p, o) in
                     enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), errs
    calls = apt_calls(tmp / "apt.log")
    installs = [c for c in calls if "install" in c[3]]
    # One install only: the second cluster.sh waited for the lock, then found the packages.
    assert len(installs) == 1, (calls, errs)
    for a, b in zip(calls, calls[1:]):
        assert a[2] <= b[1], f"apt-get runs overlap: {calls}\n{errs}"
    pid, t0, t1, args = installs[0]
    assert t1 - t0 >= APT_SECONDS, calls
    # ... and apt-get itself waits for dpkg's lock.
    assert "DPkg::Lock::Timeout=300" in args and args[-4:] == [
        "slurm-wlm", "munge", "libpmix2", "libpmix-dev"], args
    said = [o[1] for o in outs]
    assert sum("installing slurm-wlm" in s for s in said) == 1, errs
    assert sum("installed meanwhile by another cluster.sh" in s for s in said) == 1, errs


@pytest.mark.timeout(60)
def test_install_does_nothing_when_present(fake_root):
    tmp, env = fake_root
    first = subprocess.run(["bash", str(CLUSTER_SH), "install"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(["bash", str(CLUSTER_SH), "install"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert len(apt_calls(tmp / "apt.log")) == 1
    # --no-slurm needs none of them
    (tmp / "apt.log").unlink()
    for b in ("slurmctld", "sinfo"):
        (tmp / "bin" / b).unlink()
    nos = subprocess.run(["bash", str(CLUSTER_SH), "install", "--no-slurm"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert nos.returncode == 0 and not (tmp / "apt.log").exists(), nos.stderr
