"""One planner question, one answer (issue 48): ``python -m lsgd_hpc.plan --params N --nodes M
--ranks-per-node K --inter-gbps B`` works as typed, every default it takes printed as an
"assumed:" line; with --mtbf-hours one recommendation of method, compressor, worker shape,
failure policy and checkpoint interval, with the predicted goodput and a train command that the
trainer's own parser accepts. In-process (lsgd_hpc.planning.plan.main), no MPI."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from lsgd_hpc.planning import advice
from lsgd_hpc.planning.plan import _parser, main
from mpi_util import REPO

ISSUE = ["--params", "1000000000", "--nodes", "64", "--ranks-per-node", "8", "--inter-gbps", "10"]
SMALL = ["--params", "1e9", "--nodes", "4", "--ranks-per-node", "8", "--inter-gbps", "10"]


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def plan_json(args, capsys):
    return json.loads(run(args + ["--json"], capsys))


def recommended(out):
    """The lines that say "recommended" (any case): exactly one, and the command under it."""
    said = [ln for ln in out.splitlines() if "recommended" in ln.lower()]
    assert len(said) == 1, said
    lines = out.splitlines()
    return said[0], lines[lines.index(said[0]) + 1].strip()


def train_config(command, monkeypatch):
    """The trainer's own config of the command's train options (as
    test_recommend.test_command_line_of_each_compressor_is_one_the_trainer_accepts parses a
    compressor's line); --device cuda is checked against this machine's GPUs, so torch is told
    it has one."""
    import torch
    from lsgd_hpc.cli.config import parse_config
    words = shlex.split(command)
    assert words[0] == "mpirun"
    i = words.index("lsgd_hpc.train")
    assert words[i - 2:i] == ["python", "-m"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return parse_config(words[i + 1:], env={}), words[:i - 2]


def test_the_issues_command_answers_with_every_default_stated(capsys):
    out = run(ISSUE, capsys)
    assumed = [ln for ln in out.splitlines() if ln.startswith("assumed: ")]
    for ln in assumed:
        assert re.search(r"\(pass --[a-z-]+.* to set\)$", ln), ln
    joined = "\n".join(assumed)
    for flag in ("--gpu", "--intra-gbps", "--interconnect", "--step-ms", "--tokens-per-step",
                 "--tflops"):
        assert flag in joined, flag
    assert "3600 Gbit/s" in joined and "8,192 tokens" in joined and "989" in joined
    line, command = recommended(out)
    assert line.startswith("recommended: ") and "512 workers of 1 rank (64 nodes x 8)" in line
    assert command.startswith("mpirun -np 512 --map-by ppr:8:node python -m lsgd_hpc.train "
                              "--algorithm ") and command.endswith("--device cuda")
    # the figures behind the lines: 6 N T FLOP at 40 % of the H100's 989 TFLOP/s, NVLink 4
    doc = plan_json(ISSUE, capsys)
    i = doc["inputs"]
    assert i["step_s"] == pytest.approx(6 * 1e9 * 8192 / (0.4 * 989e12))
    assert i["intra"]["gbps"] == pytest.approx(3600) and "intra assumed" in i["link_source"]
    assert i["assumptions"] == assumed
    assert doc["run"]["command"] == command and "failures" not in doc


def test_the_defaults_follow_the_gpu_interconnect_and_tokens(capsys):
    base = plan_json(SMALL, capsys)["inputs"]
    a100 = plan_json(SMALL + ["--gpu", "a100"], capsys)["inputs"]
    assert a100["intra"]["gbps"] == pytest.approx(2400)
    assert a100["step_s"] == pytest.approx(base["step_s"] * 989 / 312)
    half = plan_json(SMALL + ["--tokens-per-step", "4096"], capsys)["inputs"]
    assert half["step_s"] == pytest.approx(base["step_s"] / 2)
    assert plan_json(SMALL + ["--tflops", "100"], capsys)["inputs"]["step_s"] == \
        pytest.approx(6e9 * 8192 / 100e12)
    pcie = plan_json(SMALL + ["--interconnect", "pcie4"], capsys)["inputs"]
    assert pcie["intra"]["gbps"] == pytest.approx(256) and pcie["step_s"] == base["step_s"]
    # what is given is not assumed; a CPU cluster gets no --device cuda
    out = run(SMALL + ["--gpu", "cpu", "--intra-gbps", "100", "--step-ms", "500"], capsys)
    assert not any(ln.startswith("assumed:") and ("--intra-gbps" in ln or "--step-ms" in ln)
                   for ln in out.splitlines())
    assert "--device" not in recommended(out)[1]


def test_mtbf_hours_gives_one_recommendation_the_trainer_accepts(capsys, monkeypatch):
    out = run(ISSUE + ["--mtbf-hours", "50000"], capsys)
    line, command = recommended(out)
    assert re.search(r"--on-failure (abort|shrink|heal)", line)
    assert "a checkpoint every" in line and "--checkpoint-every" in line
    assert re.search(r"predicted goodput \d+\.\d\d%", line)
    assert sum(ln.startswith("assumed: ") for ln in out.splitlines()) >= 5
    doc = plan_json(ISSUE + ["--mtbf-hours", "50000"], capsys)
    r, f = doc["run"], doc["failures"]
    assert r["command"] == command
    # the policy and goodput are the failure plan's, the interval in steps of the method's step
    assert r["policy"] == f["recommended"]
    assert r["goodput"] == next(x["goodput"] for x in f["rows"] if x["policy"] == r["policy"])
    interval = f["daly_s"] if r["on_failure"] == "abort" else f["shrink_heal_interval_s"]
    assert r["checkpoint_every"] == round(interval / r["step_s"])
    assert f["checkpoint"]["seconds"] == pytest.approx(8e9 / 1e9)  # 1e9 x 8 B at 1 GB/s
    cfg, launcher = train_config(command, monkeypatch)
    assert cfg.on_failure == r["on_failure"] and cfg.checkpoint_every == r["checkpoint_every"]
    assert cfg.device == "cuda" and cfg.algorithm == doc["recommendation"]["recommended"][
        "args"].split()[1]
    assert ("--with-ft" in launcher) == (r["on_failure"] != "abort")
    assert launcher[launcher.index("-np") + 1] == "512"


def test_heal_with_spares_command_is_one_the_trainer_accepts(capsys, monkeypatch):
    args = SMALL + ["--mtbf-hours", "100", "--spares", "1", "--replacement-seconds", "3000",
                    "--checkpoint-seconds", "30"]
    r = plan_json(args, capsys)["run"]
    assert r["policy"] == "heal+spares" and r["spare_ranks"] == 8
    cfg, launcher = train_config(r["command"], monkeypatch)
    assert cfg.on_failure == "heal" and cfg.spares == 8
    assert launcher[launcher.index("-np") + 1] == "40"         # 4 nodes + 1 spare, 8 a node
    assert " ".join(launcher).startswith("mpirun --with-ft ulfm --prtemca "
                                         "state_base_recoverable 1")


def test_a_policy_the_trainer_refuses_with_the_method_is_not_recommended(monkeypatch):
    """Asynchronous LSGD: the trainer refuses heal with it; the answer takes the next
    eligible method (or the next policy), never the refused pair."""
    from lsgd_hpc.cli.config import ConfigError, parse_config
    lsgd = {"method": "lsgd-async", "options": {"tau_local": 8, "tau_global": 16},
            "comm_dtype": "fp32", "topk": 1.0, "step_s": 0.1, "comm_share": 0.02,
            "args": "--algorithm lsgd-async --tau-local 8 --tau-global 16"}
    with pytest.raises(ConfigError, match="--on-failure"):         # the rule mirrored is real
        parse_config(lsgd["args"].split() + ["--on-failure", "heal"], env={})
    diloco = {"method": "diloco", "options": {"H": 16}, "comm_dtype": "int8", "topk": 1.0,
              "step_s": 0.11, "comm_share": 0.03, "eligible": True,
              "args": "--algorithm diloco --local-steps 16 --comm-dtype int8 --error-feedback"}
    failures = {"rows": [{"policy": "abort", "goodput": 0.9}, {"policy": "heal", "goodput": 0.99}],
                "recommended": "heal", "daly_s": 600.0, "shrink_heal_interval_s": 3600.0,
                "inputs": {"spares": 0}, "checkpoint": {"seconds": 10.0}}
    rec = {"recommended": lsgd, "runners_up": [diloco], "rho": 40.0}
    r = advice.run_recommendation(rec, failures, 4, 8, "cpu", [])
    assert (r["method"], r["on_failure"]) == ("diloco", "heal") and "refused" in r["note"]
    r = advice.run_recommendation(dict(rec, runners_up=[]), failures, 4, 8, "cpu", [])
    assert (r["method"], r["on_failure"]) == ("lsgd-async", "abort")
    assert r["checkpoint_every"] == 6000                             # Daly's 600 s / 0.1 s
    cfg, _ = train_config(r["command"], monkeypatch)
    assert cfg.on_failure == "abort" and cfg.algorithm == "lsgd-async"


def test_help_description_is_whole_and_help_prints(capsys):
    p = _parser()
    assert p.description.endswith(".") and "bytes per step of every method" in p.description
    text = p.format_help()
    assert "--gpu" in text and "--mtbf-hours" in text and "--spares" in text


@pytest.mark.parametrize("extra, needle", [
    (["--spares", "2"], "--spares: needs --mtbf-hours"),
    (["--mtbf-hours", "100", "--measure"], "--mtbf-hours: not with --measure"),
    (["--mtbf-hours", "100", "--survivable", "2"], "--survivable"),
    (["--tokens-per-step", "0"], "--tokens-per-step"),
    (["--gpu", "tpu"], "--gpu"),
])
def test_bad_input_one_line_exit_2(extra, needle, capsys):
    assert main(SMALL + extra) == 2
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err.err
    assert err.out == ""


def test_docs_show_the_planners_own_answer(capsys):
    """docs/planning.md's one-question example: its "recommended:" line and command are what
    the planner prints for the command shown above them."""
    text = (REPO / "docs" / "planning.md").read_text()
    block = text.split("## One question, one answer", 1)[1].split("\n## ", 1)[0]
    cmd = re.search(r"python -m lsgd_hpc\.plan (.*--mtbf-hours \d+)", block).group(1)
    out = run(cmd.split(), capsys)
    line, command = recommended(out)
    assert line in block and command in block
