"""The docs cover the code a user runs: every option of ``python -m lsgd_hpc.train --help`` is
documented in docs/*.md, every repository path README.md and docs/*.md name exists, README's
figures agree with the files they come from, and the trainer's refusals name its options (not
the library's argument spelling). In-process and fast (make test-fast runs them)."""

import re
import subprocess

import pytest

from mpi_util import REPO

DOCS = sorted((REPO / "docs").glob("*.md"))


def docs_text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def mentions(text: str, flag: str) -> bool:
    """``flag`` appears in ``text`` as itself, not as the start of a longer option."""
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


# -- every option of --help in docs/ ----------------------------------------------------------

def trainer_flags():
    """The first spelling of each option of the trainer's parser (``--nesterov`` stands for
    ``--no-nesterov`` too), built in-process as ``--help`` builds it."""
    from lsgd_hpc.cli.config import _parser
    return [a.option_strings[0] for a in _parser()._actions
            if a.option_strings and a.option_strings[0] not in ("-h", "--help")]


def test_the_parser_has_the_options_the_help_lists():
    """The in-process parser is the one --help prints (a guard on the test below)."""
    flags = trainer_flags()
    assert len(flags) > 60 and len(set(flags)) == len(flags)
    for flag in ("--algorithm", "--on-failure", "--flush-seconds", "--lr-schedule", "--tracker"):
        assert flag in flags


def test_every_trainer_option_is_documented_in_docs():
    text = docs_text()
    missing = [f for f in trainer_flags() if not mentions(text, f)]
    assert missing == [], f"options of python -m lsgd_hpc.train --help not in docs/*.md: {missing}"


def test_the_option_check_would_see_a_missing_option():
    text = docs_text()
    assert mentions(text, "--lr") and not mentions("use --lr-schedule", "--lr")
    assert not mentions(text, "--no-such-option-anywhere")


# -- every repository path that the docs name exists -----------------------------------------

TOP_DIRS = sorted(p.name for p in REPO.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and not p.name.endswith("-info"))
#: a path that starts in a folder at the top of the repository: results/README.md,
#: lsgd_hpc/runtime/metrics.py, benchmarks/_common.rho_fields (a module's name), slurm/
PATH = re.compile(r"(?<![\w/.~$<{-])((?:" + "|".join(map(re.escape, TOP_DIRS))
                  + r")/[\w./-]*[\w/])")
#: arguments that name where a command writes or reads, outside the repository
WHERE = re.compile(r"(--out|--run-dir|--data-dir|--root|--logdir)[ =]$")


def ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def missing_paths(md):
    """(line number, path) of each repository path the file names that does not exist. Not
    counted: an argument of --out, --run-dir, --data-dir, --root (where a command writes);
    run directories (runs/); an output folder that git ignores, named as a folder (with its
    trailing slash: `make bench` -> results/benchmarks/); a file in it is counted, since it
    is not in the repository. ``folder/module.name`` is a name in folder/module.py."""
    out = []
    for i, line in enumerate(md.read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".")
            if WHERE.search(line[:m.start()]) or path.startswith("runs/"):
                continue
            if (REPO / path).exists():
                continue
            if path.endswith("/") and ignored(path):
                continue
            module = re.sub(r"\.\w+$", ".py", path)
            if module != path and (REPO / module).is_file():
                continue
            out.append((i, path))
    return out


@pytest.mark.parametrize("md", [REPO / "README.md"] + DOCS, ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(md):
    assert missing_paths(md) == [], f"{md.name} names paths not in the repository"


def test_the_path_check_sees_a_missing_file(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("`make bench` writes results/benchmarks/ (per machine): see\n"
                  "results/benchmarks/scale_model.png and lsgd_hpc/runtime/metrics.py,\n"
                  "benchmarks/_common.rho_fields, docs/nothing.md; --out results/cmp, "
                  "runs/a/metrics/.\n")
    assert missing_paths(md) == [(2, "results/benchmarks/scale_model.png"),
                                 (3, "docs/nothing.md")]


# -- README: the front door ------------------------------------------------------------------

def readme() -> str:
    return (REPO / "README.md").read_text()


def test_readme_says_what_the_package_is_and_shows_the_main_job_on_its_first_screen():
    first = "\n".join(readme().splitlines()[:40])
    assert "Leader SGD" in first and "MPI" in first
    assert "python -m lsgd_hpc.train" in first


def test_readme_first_multi_rank_command_uses_the_venv_and_oversubscribe():
    lines = readme().splitlines()
    first = next(i for i, ln in enumerate(lines) if re.search(r"mpirun .*-np \d", ln))
    near = "\n".join(lines[max(0, first - 8):first + 8])
    assert ".venv" in near and "--oversubscribe" in near, near


def test_readme_has_a_fault_tolerance_section_with_one_command_each():
    text = readme()
    m = re.search(r"^## Fault tolerance.*?(?=^## )", text, re.M | re.S)
    assert m, "no '## Fault tolerance' section"
    sec = m.group(0)
    for needle in ("--on-failure shrink", "--on-failure heal", "--spares", "complete.json",
                   "summary", "--check", "--min-ranks", "--mtbf-hours", "--with-ft ulfm"):
        assert needle in sec, needle
    statuses = re.search(r"Exit statuses of the trainer:(.*?)\n\n", sec, re.S)
    assert statuses, "no exit statuses in the fault-tolerance section"
    for code in ("0", "1", "2", "3", "143"):
        assert re.search(rf"\b{code}\b", statuses.group(1)), code


def test_readme_says_which_method_when_with_the_planner():
    text = readme()
    assert re.search(r"^## Which method when", text, re.M)
    assert "python -m lsgd_hpc.plan" in text


def results_minutes() -> float:
    """The sum of results/README.md's table of experiment minutes."""
    text = (REPO / "results" / "README.md").read_text()
    rows = re.findall(r"^\| \[[^\]]*\]\([^)]*\) \| ([\d.]+) \| \w+ \|$", text, re.M)
    assert len(rows) >= 5
    return sum(float(x) for x in rows)


def test_make_results_takes_one_time_everywhere():
    """README, the Makefile and results/README.md say the same `make results` time: the sum
    of results/README.md's table, in minutes."""
    total = round(results_minutes())
    said = {
        "README.md": re.findall(r"about (\d+) min", readme().split("## ")[0]),
        "Makefile": re.findall(r"about (\d+) min",
                               (REPO / "Makefile").read_text().split("\nresults:")[0]),
        "results/README.md": re.findall(r"make results .*\(about (\d+) min\)",
                                        (REPO / "results" / "README.md").read_text()),
    }
    for where, found in said.items():
        assert found and all(abs(int(x) - total) <= 1 for x in found), (where, found, total)


# -- the trainer's refusals in its own words --------------------------------------------------

def test_library_arguments_become_options():
    from lsgd_hpc.cli.startup import option_spelling
    assert option_spelling("on_failure='heal' needs a fault-tolerant MPI") == \
        "--on-failure heal needs a fault-tolerant MPI"
    assert option_spelling("with backend='torch' and on_failure=\"shrink\", spares=2") == \
        "with --backend torch and --on-failure shrink, --spares 2"
    # not an option of the trainer, or not an argument: as it was
    assert option_spelling("pass x='y' to init; on_failure is") == "pass x='y' to init; on_failure is"


def test_the_trainer_names_the_option_when_the_library_refuses(monkeypatch, capsys):
    """lsgd_hpc.init's refusal (a ValueError in the library's words) reaches the user of
    python -m lsgd_hpc.train as --on-failure heal, exit 2."""
    from lsgd_hpc.cli import train

    def refuse(backend, cfg):
        raise ValueError("on_failure='heal' needs a fault-tolerant MPI, and this Open MPI runs "
                         "without ULFM: start the job with mpirun --with-ft ulfm")
    monkeypatch.setattr(train, "_init", refuse)
    # no SIGTERM/SIGUSR1 handlers of the trainer's left in the test process
    monkeypatch.setattr(train, "StopSignals", lambda: type("NoSignals", (), {"signum": None})())
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"):
        monkeypatch.delenv(var, raising=False)
    code = train.main(["--on-failure", "heal", "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--on-failure heal needs a fault-tolerant MPI" in err and "on_failure=" not in err
