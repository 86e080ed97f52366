"""The package's LSGD_HPC_* environment variables: every one is defined in lsgd_hpc/envvars.py
(no other module spells a name out), every name the package mentions is one of them, and
docs/cluster.md's table is the module's. In-process, read from the source."""

import ast
import re
from pathlib import Path

import pytest

from lsgd_hpc import envvars

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "lsgd_hpc"
NAME = re.compile(r"LSGD_HPC_\w+")
NAMES = {v.name for v in envvars.VARIABLES}


def test_every_variable_is_listed_once_with_a_meaning():
    assert len(NAMES) == len(envvars.VARIABLES) == 9
    for v in envvars.VARIABLES:
        assert v.name.startswith("LSGD_HPC_") and v.meaning and v.default
        assert v.use in ("user", "internal", "testing only")
        assert "|" not in v.meaning + v.default
    assert {n for n in envvars.__all__ if isinstance(getattr(envvars, n), envvars.EnvVar)} \
        == {n for n in dir(envvars) if isinstance(getattr(envvars, n), envvars.EnvVar)}


def test_every_name_the_package_mentions_is_in_the_module():
    unknown = []
    for path in sorted(PKG.rglob("*.py")):
        unknown += [f"{path.relative_to(REPO)}: {n}" for n in sorted(set(NAME.findall(
            path.read_text()))) if n not in NAMES]
    assert not unknown, "LSGD_HPC_* names not defined in lsgd_hpc/envvars.py:\n" + \
        "\n".join(unknown)


def test_no_other_module_spells_a_name_out():
    """Outside envvars.py a variable is named by its EnvVar (``RANKS_PER_NODE.name``), so a
    read is found by its import; a name in a docstring or comment is fine."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "envvars.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and NAME.fullmatch(node.value.strip()):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not bad, "LSGD_HPC_* names spelled out (use lsgd_hpc.envvars):\n" + "\n".join(bad)


def test_the_docs_table_is_the_modules():
    text = (REPO / "docs" / "cluster.md").read_text()
    assert envvars.markdown_table() in text, (
        "docs/cluster.md's environment variable table differs from lsgd_hpc/envvars.py; "
        "paste python -c 'from lsgd_hpc.envvars import markdown_table; "
        "print(markdown_table())' there")
    in_docs = set(NAME.findall(text))
    assert NAMES <= in_docs


def test_reads_at_call_time_and_as_before(monkeypatch):
    monkeypatch.delenv("LSGD_HPC_RANKS_PER_NODE", raising=False)
    assert envvars.RANKS_PER_NODE.read() is None
    monkeypatch.setenv("LSGD_HPC_RANKS_PER_NODE", "3")
    assert envvars.RANKS_PER_NODE.read() == 3
    assert envvars.RANKS_PER_NODE.read({"LSGD_HPC_RANKS_PER_NODE": ""}) is None
    with pytest.raises(ValueError):
        envvars.RANKS_PER_NODE.read({"LSGD_HPC_RANKS_PER_NODE": "x"})
    assert envvars.COMM_VALIDATE.read({}) is True
    assert envvars.COMM_VALIDATE.read({"LSGD_HPC_COMM_VALIDATE": "0"}) is False
    assert envvars.COMM_VALIDATE.read({"LSGD_HPC_COMM_VALIDATE": ""}) is True
    settle = envvars.FT_SETTLE_SECONDS
    assert [settle.read(e) for e in ({}, {settle.name: " 2 "}, {settle.name: "-1"},
                                     {settle.name: "x"})] == [0.5, 2.0, 0.0, 0.5]
    heal = envvars.HEAL_TIMEOUT
    assert [heal.read(e) for e in ({}, {heal.name: "20"}, {heal.name: "x"})] == [600.0, 20.0,
                                                                                 600.0]
    assert envvars.HEAL_JOIN_TIMEOUT.read({}) == 120.0
    assert envvars.ULFM.read({"LSGD_HPC_ULFM": " 1 "}) and not envvars.ULFM.read({})
    assert envvars.HEAL_BLOCKING.read({"LSGD_HPC_HEAL_BLOCKING": "1"})
    assert envvars.REPLACEMENT_STARTED.read({}) is None
    assert envvars.REPLACEMENT_STARTED.read({"LSGD_HPC_REPLACEMENT_STARTED": "1.5"}) == 1.5
    assert envvars.TEST_REPLACEMENT_DIES.read({"LSGD_HPC_TEST_REPLACEMENT_DIES": ""}) is None
