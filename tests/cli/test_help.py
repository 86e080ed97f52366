"""`python -m lsgd_hpc.train --help`, run as a user runs it: every option sits in one of the
six named sections and shows its default (checked against the options' definitions: the
trainer's, and each method's spec), the data sets' defaults and presets, and, where it has
a closed set of values, its choices."""

import re
import subprocess
import sys
import pytest

from lsgd_hpc.cli.config import cli_options, option_group
from lsgd_hpc.data.specs import DATASETS
from lsgd_hpc.methods.registry import SPECS
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
    for name in cli_options():
        assert flag_of(name) in shown, f"{flag_of(name)} missing from --help"
        section = shown[flag_of(name)][0]
        assert section in SECTIONS, f"{flag_of(name)} is under {section!r}"
    assert set(shown) - {"--help", "--config", "--no-outer-nesterov"} == \
        {flag_of(n) for n in cli_options()}
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
    method_options = {o.name for spec in SPECS.values() for o in spec.options}
    for name, o in cli_options().items():
        text = shown[flag_of(name)][1]
        assert "default: " in text, f"{flag_of(name)}: no default in {text!r}"
        after = text.split("default: ", 1)[1]
        if name in method_options:
            continue                      # test_method_defaults_and_presets_are_shown
        if o.default is False:
            assert after.startswith("off"), (name, after)
        elif o.default is not None:
            assert after.startswith(str(o.default)), (name, after)
        for ds in DATASETS.values():
            if name in ds.defaults and ds.defaults[name] != o.default:
                # e.g. "digits 32" for --batch-size, "cifar10: step" for --lr-schedule
                assert re.search(rf"\b{ds.name}:? {re.escape(str(ds.defaults[name]))}\b",
                                 after), (name, ds.name, after)


def test_method_defaults_and_presets_are_shown(help_text):
    """A method option's help names every method's default for it (the library's) and each
    data set's preset value."""
    shown = parse_help(help_text)
    for spec in SPECS.values():
        for o in spec.options:
            if not o.cli:
                continue
            after = shown[flag_of(o.name)][1].split("default: ", 1)[1]
            assert o.default_text() in after, (spec.name, o.name, after)
            for ds in DATASETS.values():
                if o.name in ds.presets.get(spec.name, {}):
                    value = str(ds.presets[spec.name][o.name])
                    assert f"{ds.name} preset: " in after and value in \
                        after.split(f"{ds.name} preset: ", 1)[1], (spec.name, o.name, after)
    tau = shown["--tau-local"][1]
    assert "default: 64 (digits preset: 4" in tau, tau
    steps = shown["--local-steps"][1]
    assert "local-sgd 8; diloco 500; slowmo 1" in steps, steps


def test_closed_sets_of_values_are_listed(help_text):
    from lsgd_hpc.models.zoo import MODELS
    from lsgd_hpc.topology import TOPOLOGIES
    shown = parse_help(help_text)
    assert "{lsgd,lsgd-async,allreduce,easgd,local-sgd,diloco,slowmo,gossip}" in help_text
    assert "{constant,step,cosine}" in help_text
    assert "{mpi,horovod,torch}" in help_text and "{cpu,cuda}" in help_text
    for flag, values in (("--topology", TOPOLOGIES), ("--model", MODELS),
                         ("--dataset", tuple(DATASETS))):
        assert "one of: " + ", ".join(values) in shown[flag][1], flag


def test_option_groups_come_from_the_definitions():
    assert option_group("tau_local") == "LSGD" and option_group("outer_lr") == "baselines"
    assert option_group("comm_dtype") == "cluster and backend"
    assert option_group("checkpoint_every") == "output and checkpoints"
    with pytest.raises(KeyError):
        option_group("no_such_option")
