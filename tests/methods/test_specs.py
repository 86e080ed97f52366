"""One definition per method: the spec (lsgd_hpc.methods.registry) gives the library's classes
their defaults and checks, and the trainer's command line resolves to exactly those defaults
(with --no-preset) or to them updated by the data set's documented preset."""

import subprocess
import sys

import pytest
import yaml

import lsgd_hpc
from lsgd_hpc.cli.config import ConfigError, parse_config
from lsgd_hpc.data.specs import DATASETS
from lsgd_hpc.methods.registry import SPECS
from lsgd_hpc.methods.spec import Option, OptionError
from mpi_util import REPO

NAMES = tuple(SPECS)


def cli_defaults(name):
    """The class's defaults, less the options only a library user can pass (callables)."""
    cli = {o.name for o in SPECS[name].options if o.cli}
    return {k: v for k, v in lsgd_hpc.METHODS[name].defaults.items() if k in cli}


@pytest.mark.parametrize("name", NAMES)
def test_no_preset_resolves_to_the_library_defaults(name):
    cfg = parse_config(["--algorithm", name, "--no-preset"], env={})
    assert cfg.method_options == cli_defaults(name)
    assert cfg.preset == {}
    for k, v in cfg.method_options.items():       # and the flat fields agree
        assert getattr(cfg, k) == v


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
@pytest.mark.parametrize("name", NAMES)
def test_without_no_preset_the_data_sets_preset_updates_them(name, dataset):
    preset = DATASETS[dataset].preset(name)
    cfg = parse_config(["--algorithm", name, "--dataset", dataset], env={})
    assert cfg.method_options == {**cli_defaults(name), **preset}
    assert cfg.preset == preset
    # an option given on the command line wins over the preset and is not reported as preset
    if preset:
        k = next(iter(preset))
        value = 2 * preset[k]
        if name == "lsgd" or name == "lsgd-async":
            args = ["--tau-local", "2", "--tau-global", "16"]
            want = {"tau_local": 2, "tau_global": 16}
        else:
            args = [SPECS[name].option(k).flag, str(value)]
            want = {k: value}
        cfg = parse_config(["--algorithm", name, "--dataset", dataset, *args], env={})
        for key, v in want.items():
            assert cfg.method_options[key] == v and key not in cfg.preset


def test_the_digits_preset_communicates_within_the_default_budget():
    """The reason for the preset: with it every method communicates several times in the
    default run; at the library's periods LSGD and DiLoCo would not communicate at all."""
    budget = DATASETS["digits"].defaults["max_steps"]
    for name in NAMES:
        o = {**SPECS[name].defaults, **DATASETS["digits"].preset(name)}
        period = next((o[k] for k in ("tau_global", "easgd_tau", "local_steps") if k in o), 1)
        assert budget // period >= 8, (name, period)
    assert budget < SPECS["diloco"].defaults["local_steps"]          # why a preset exists
    assert budget < SPECS["lsgd"].defaults["tau_global"]


def test_specs_import_without_torch():
    code = ("import sys; import lsgd_hpc.methods.registry, lsgd_hpc.methods.spec, "
            "lsgd_hpc.data.specs; print('torch' in sys.modules, 'mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_one_check_one_message_for_the_library_and_the_cli():
    with pytest.raises(OptionError) as lib:
        SPECS["lsgd"].resolve({"tau_local": 4, "tau_global": 6})
    assert str(lib.value) == "tau_global must be a multiple of tau_local (6 vs 4)"
    with pytest.raises(ConfigError) as cli:
        parse_config(["--tau-local", "4", "--tau-global", "6"], env={})
    assert str(cli.value) == "--tau-global: must be a multiple of tau_local (6 vs 4)"
    # a value of another method's kind: diloco's H is an integer, local SGD's may be auto
    assert SPECS["local-sgd"].resolve({"local_steps": "auto"})["local_steps"] == "auto"
    with pytest.raises(ConfigError, match="--local-steps: must be an integer >= 1, got 'auto'"):
        parse_config(["--algorithm", "diloco", "--local-steps", "auto"], env={})
    with pytest.raises(ValueError, match="LeaderSGD: unknown option"):
        SPECS["lsgd"].resolve({"tau": 3}, where="LeaderSGD")


class Module:
    """Stands for a torch.nn.Module (the spec tells one by its parameters())."""

    def parameters(self):
        return iter(())


@pytest.mark.parametrize("kind,good,bad", [
    ("int", [1, 7, 3.0], [0, True, 2.5, "3"]),
    ("float", [0.5, 1, 0.0], [-0.1, 1.5, float("nan"), "x", True]),
    ("bool", [True, False], [1, "yes"]),
    ("choice", ["a", "b"], ["c", None]),
    ("int_or_auto", [1, "auto"], ["Auto", 0]),
    ("int_or_node", [1, 4, "node"], ["Node", "auto", 0, True, 2.5]),
    ("int_or_modules", [1, 4, [Module()]], [0, "2", [], [Module(), "m"], True]),
])
def test_option_checks(kind, good, bad):
    o = Option("x", None if kind == "choice" else 1, kind, "help", low=0 if kind == "float"
               else 1, high=1 if kind == "float" else None, choices=("a", "b"))
    for v in good:
        assert o.check(v) == v
    for v in bad:
        with pytest.raises(OptionError) as e:
            o.check(v)
        assert e.value.option == "x"


def test_world_checks():
    with pytest.raises(OptionError, match="easgd_alpha.*unstable"):
        SPECS["easgd"].resolve({"easgd_alpha": 0.5}, world_size=4)
    SPECS["easgd"].resolve({}, world_size=64)                  # 0.9 / p: always stable
    with pytest.raises(OptionError, match="topology"):
        SPECS["gossip"].resolve({"topology": "hypercube"}, world_size=6)


def test_a_real_run_records_and_prints_its_preset(tmp_path, forked_cli):
    """The trainer prints which values came from the preset and records them, and
    --no-preset runs the library's defaults (both in config.yaml)."""
    for extra, want_preset in (([], {"local_steps": 8}), (["--no-preset"], {})):
        run = tmp_path / ("preset" if want_preset else "nopreset")
        out = forked_cli.run(["--algorithm", "diloco", "--max-steps", "4", "--run-dir",
                              str(run), *extra])
        assert out.returncode == 0, out.stderr
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["preset"] == want_preset
        assert cfg["method_options"]["local_steps"] == (8 if want_preset else 500)
        assert ("digits preset for diloco: local_steps=8" in out.stdout) == bool(want_preset)


def test_every_preset_names_real_methods_and_their_options():
    for ds in DATASETS.values():
        for method, options in ds.presets.items():
            assert method in SPECS, (ds.name, method)
            SPECS[method].resolve(options)          # known options, valid values


STREAMING_REFUSED = [
    ({"local_steps": 6, "fragments": 4}, "fragments",
     "must divide local_steps (4 fragments, local_steps 6)"),
    ({"local_steps": 8, "fragments": 2, "fragment_sync_delay": 4}, "fragment_sync_delay",
     "must be < local_steps / fragments = 4"),
    ({"local_steps": 8, "fragments": [Module()] * 3}, "fragments",
     "must divide local_steps (3 fragments, local_steps 8)"),
    ({"fragment_update_alpha": -0.1}, "fragment_update_alpha", "must be in [0, 1]"),
    ({"fragment_sync_delay": -1}, "fragment_sync_delay", "must be an integer >= 0"),
]


@pytest.mark.parametrize("given,option,why", STREAMING_REFUSED)
def test_streaming_diloco_options_refused(given, option, why):
    with pytest.raises(OptionError) as e:
        SPECS["diloco"].resolve(given)
    assert e.value.option == option and why in e.value.reason
    # P = 1, tau = 0, alpha = 0 is DiLoCo: the defaults
    d = SPECS["diloco"].defaults
    assert (d["fragments"], d["fragment_sync_delay"], d["fragment_update_alpha"]) == (1, 0, 0.0)


def test_streaming_and_pull_delay_flags_parse_and_refuse():
    cfg = parse_config(["--algorithm", "diloco", "--fragments", "2", "--fragment-sync-delay",
                        "1", "--fragment-update-alpha", "0.5"], env={})
    assert {k: cfg.method_options[k] for k in ("local_steps", "fragments",
                                                "fragment_sync_delay", "fragment_update_alpha")} \
        == {"local_steps": 8, "fragments": 2, "fragment_sync_delay": 1,
            "fragment_update_alpha": 0.5}                        # H = 8 from the digits preset
    with pytest.raises(ConfigError, match=r"^--fragments: must divide local_steps \(3 fragm"):
        parse_config(["--algorithm", "diloco", "--fragments", "3"], env={})
    with pytest.raises(ConfigError, match=r"^--fragment-sync-delay: must be < local_steps / "
                                          r"fragments = 4"):
        parse_config(["--algorithm", "diloco", "--fragments", "2", "--fragment-sync-delay",
                      "4"], env={})
    with pytest.raises(ConfigError, match="--fragments: must be an integer >= 1"):
        parse_config(["--algorithm", "diloco", "--fragments", "two"], env={})
    assert parse_config(["--pull-delay", "3"], env={}).pull_delay == 3
    with pytest.raises(ConfigError, match=r"^--pull-delay: must be < tau_local \(one pull per "
                                          r"level in flight\), got 4 vs 4"):
        parse_config(["--pull-delay", "4"], env={})              # tau_local 4: digits preset
    assert "pull_delay" not in SPECS["lsgd-async"].defaults      # synchronous LSGD only
