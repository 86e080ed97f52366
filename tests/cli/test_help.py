"""`python -m lsgd_hpc.train --help`, run as a user runs it: every option sits in one of the
six named sections and shows its default (checked against the Config dataclass) and, where
it has a closed set of values, its choices."""

import re
import subprocess
import sys
from dataclasses import fields

import pytest

from lsgd_hpc.cli.config import DATASET_DEFAULTS, Config, option_group
from mpi_util import REPO, mpi_env

SECTIONS = ("method", "LSGD", "baselines", "data and model", "cluster and backend",
            "output and checkpoints")


@pytest.fixture(scope="module")
def help_text():
    proc = subprocess.run([sys.executable, "-m", "lsgd_hpc.train", "--help"], cwd=REPO,
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout


def parse_help(text):
    """{flag: (section, help text joined on one line)} from argparse's layout."""
    out, section, flag = {}, None, None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):                       # a section heading
            section, flag = line[:-1], None
            continue
        m = re.match(r"^  (--[a-z0-9-]+)(.*)$", line)
        if m:
            flag = m.group(1)
            out[flag] = [section, m.group(2)]
        elif flag and line.startswith("    "):
            # argparse wraps after a hyphen ("one-peer-|exponential"): rejoin without a space
            out[flag][1] += ("" if out[flag][1].endswith("-") else " ") + line.strip()
    return {k: (s, re.sub(r"\s+", " ", h).strip()) for k, (s, h) in out.items()}


def flag_of(name):
    return "--" + name.replace("_", "-")


def test_every_option_is_in_a_named_section(help_text):
    shown = parse_help(help_text)
    headings = [ln[:-1] for ln in help_text.splitlines() if re.match(r"^\S.*:$", ln)]
    assert [h for h in headings if h in SECTIONS] == list(SECTIONS)   # all six, in order
    for f in fields(Config):
        assert flag_of(f.name) in shown, f"{flag_of(f.name)} missing from --help"
        section = shown[flag_of(f.name)][0]
        assert section in SECTIONS, f"{flag_of(f.name)} is under {section!r}"
    # anchors: where a reader looks for them
    want = {"--algorithm": "method", "--lr-schedule": "method", "--tau-local": "LSGD",
            "--pull-global": "LSGD", "--topology": "baselines", "--easgd-alpha": "baselines",
            "--local-steps": "baselines", "--dataset": "data and model",
            "--model": "data and model", "--backend": "cluster and backend",
            "--ranks-per-node": "cluster and backend", "--run-dir": "output and checkpoints",
            "--checkpoint-every": "output and checkpoints", "--resume": "output and checkpoints"}
    assert {k: shown[k][0] for k in want} == want


def test_every_option_shows_its_default(help_text):
    shown = parse_help(help_text)
    for f in fields(Config):
        text = shown[flag_of(f.name)][1]
        assert "default: " in text, f"{flag_of(f.name)}: no default in {text!r}"
        after = text.split("default: ", 1)[1]
        if f.default is False:
            assert after.startswith("off"), (f.name, after)
        elif f.default is not None:
            assert after.startswith(str(f.default)), (f.name, after)
        per_set = {d: v[f.name] for d, v in DATASET_DEFAULTS.items() if f.name in v}
        for dataset, value in per_set.items():
            # e.g. "digits 8" for --epochs, "cifar10: step" where it differs from the default
            assert re.search(rf"\b{dataset}:? {re.escape(str(value))}\b", after) or \
                value == f.default, (f.name, dataset, value, after)


def test_closed_sets_of_values_are_listed(help_text):
    from lsgd_hpc.models.zoo import MODELS
    from lsgd_hpc.topology import TOPOLOGIES
    shown = parse_help(help_text)
    assert "{lsgd,lsgd-async,allreduce,easgd,local-sgd,diloco,slowmo,gossip}" in help_text
    assert "{constant,step,cosine}" in help_text
    assert "{mpi,horovod,torch}" in help_text and "{cpu,cuda}" in help_text
    for flag, values in (("--topology", TOPOLOGIES), ("--model", MODELS),
                         ("--dataset", tuple(DATASET_DEFAULTS))):
        assert "one of: " + ", ".join(values) in shown[flag][1], flag


@pytest.mark.parametrize("name,group", [
    ("lsgd_something_new", "LSGD"), ("gossip_staleness", "baselines"),
    ("async_gossip", "baselines"), ("collective_timeout", "cluster and backend"),
    ("straggler_delay", "cluster and backend"), ("checkpoint_keep", "output and checkpoints"),
    ("bn_momentum", "data and model"), ("label_smoothing", "method")])
def test_options_not_in_the_table_land_in_a_section_by_name(name, group):
    assert option_group(name) == group
