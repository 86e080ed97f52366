"""Install requirements that fit a cluster: setup.cfg declares a supported torch range, and the
verified pair is pinned only in constraints.txt, which the bootstrap (make venv) applies."""

import configparser
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mpi_util import REPO

PINNED = ("torch", "torchvision")


def install_requires():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    return {r.name: r for r in (Requirement(ln.strip()) for ln in lines if ln.strip())}


def constraints():
    reqs = [Requirement(ln.split("#")[0].strip())
            for ln in (REPO / "constraints.txt").read_text().splitlines()
            if ln.split("#")[0].strip()]
    return {r.name: r for r in reqs}


def test_setup_cfg_declares_ranges_and_constraints_pin_the_verified_pair():
    reqs, pins = install_requires(), constraints()
    for name in PINNED:
        spec = reqs[name].specifier
        assert not any(s.operator in ("==", "===") for s in spec), f"{name} pinned in setup.cfg"
        # a range: open below the verified version, closed before the next major
        assert any(s.operator == ">=" for s in spec) and any(s.operator == "<" for s in spec)
        pin = [s for s in pins[name].specifier]
        assert len(pin) == 1 and pin[0].operator == "==", f"{name} not pinned exactly"
        assert spec.contains(pin[0].version), f"pinned {name} {pin[0].version} outside {spec}"
    import torch
    import torchvision
    # the pair this venv runs is the pinned one (the bootstrap applied the constraints)
    assert torch.__version__.split("+")[0] == [*pins["torch"].specifier][0].version
    assert torchvision.__version__.split("+")[0] == [*pins["torchvision"].specifier][0].version


def test_bootstrap_and_makefile_use_the_constraints():
    boot = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert '-c "$here/constraints.txt"' in boot and '"${constraints[@]}" -e' in boot
    # the venv is rebuilt when the pin changes
    assert "constraints.txt" in next(ln for ln in (REPO / "Makefile").read_text().splitlines()
                                     if ln.startswith("$(READY):"))


def _site_with_other_torch(tmp_path: Path) -> Path:
    """A site folder that looks like a cluster's: every package of this venv, except that the
    installed torch/torchvision are another (older) pair within the supported range."""
    here = Path(site.getsitepackages()[0])
    fake = tmp_path / "site"
    fake.mkdir()
    for entry in here.iterdir():
        name = entry.name.lower()
        if name.startswith(("torch", "lsgd_hpc", "__editable__")):
            continue
        (fake / entry.name).symlink_to(entry)
    for name, version in (("torch", "2.5.0"), ("torchvision", "0.20.0")):
        info = fake / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
    return fake


def _project_copy(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "lsgd_hpc").mkdir(parents=True)
    for f in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(REPO / f, proj / f)
    for f in ("__init__.py", "_version.py"):       # (setup.cfg reads the version there)
        shutil.copy(REPO / "lsgd_hpc" / f, proj / "lsgd_hpc" / f)
    return proj


@pytest.mark.parametrize("with_constraints", [False, True])
def test_pip_keeps_a_site_torch_unless_the_bootstrap_pins_it(tmp_path, with_constraints):
    """pip's own resolver, offline (--no-index, --dry-run): with the site's torch 2.5.0
    installed, `pip install .` installs nothing but lsgd_hpc; with constraints.txt it must
    replace torch (and, offline, cannot)."""
    fake = _site_with_other_torch(tmp_path)
    proj = _project_copy(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    report = tmp_path / "report.json"
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--no-index",
           "--no-build-isolation", "--report", str(report), str(proj)]
    if with_constraints:
        cmd[5:5] = ["-c", str(REPO / "constraints.txt")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PYTHONPATH"] = str(fake)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if with_constraints:
        assert proc.returncode != 0
        assert "torch" in proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        installs = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
        assert installs == ["lsgd_hpc"]
