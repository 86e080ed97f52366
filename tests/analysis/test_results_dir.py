"""The committed results/: every CSV table parses and has rows, and every figure that
results/README.md names is there and is a PNG (make bench's results/benchmarks/ is per machine
and not committed, so it is left out)."""

import csv
import re
from pathlib import Path

from mpi_util import REPO

RESULTS = REPO / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
ANY_LINK = re.compile(r"!?\[[^\]]*\]\([^)\s]+\)")
URL = re.compile(r"[a-z]+://\S+")
PNG_NAME = re.compile(r"[\w./-]+\.png\b")


def csv_problems(root: Path) -> list[str]:
    """What is wrong with the CSV files under root (root/benchmarks left out)."""
    problems = []
    for path in sorted(root.rglob("*.csv")):
        if (root / "benchmarks") in path.parents:
            continue
        name = path.relative_to(root)
        try:
            with open(path, newline="") as fh:
                rows = list(csv.reader(fh))
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            problems.append(f"{name}: {exc}")
            continue
        if len(rows) < 2:
            problems.append(f"{name}: needs a header and at least one row, has {len(rows)} lines")
            continue
        header = rows[0]
        if not all(h.strip() for h in header) or len(set(header)) != len(header):
            problems.append(f"{name}: empty or repeated column names {header}")
        problems += [f"{name}:{i}: {len(row)} cells, header has {len(header)}"
                     for i, row in enumerate(rows[1:], 2) if len(row) != len(header)]
    return problems


def named_figures(text: str) -> list[str]:
    """Figures named in a README: markdown image and link targets ending .png, and any path
    or name ending .png in the text outside links (alt texts and web addresses left out)."""
    names = IMAGE_LINK.findall(text) + [t for t in LINK.findall(text) if t.endswith(".png")]
    names += PNG_NAME.findall(URL.sub(" ", ANY_LINK.sub(" ", text)))
    return sorted({n for n in names if not re.match(r"^[a-z]+://", n)})


def figure_problems(root: Path) -> list[str]:
    """Figures root/README.md names that are missing or not PNG. A path is relative to root; a
    bare file name may be anywhere under root. Other local links must exist too."""
    text = (root / "README.md").read_text()
    problems = []
    for name in named_figures(text):
        path = root / name
        if not path.exists() and "/" not in name:
            found = sorted(root.rglob(name))
            path = found[0] if found else path
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.read_bytes()[:8] != PNG_MAGIC:
            problems.append(f"{name}: not a PNG")
    for target in LINK.findall(text):
        if not (re.match(r"^[a-z]+://", target) or target.startswith("#")) and \
                not (root / target.split("#")[0]).exists():
            problems.append(f"{target}: linked but missing")
    return sorted(set(problems))


def test_readme_exists():
    # written by make results and committed with what it describes
    assert (RESULTS / "README.md").is_file() and (RESULTS / "README.md").read_text().strip()


def test_every_csv_parses_with_header_and_rows():
    assert csv_problems(RESULTS) == []


def test_every_named_figure_exists_and_is_png():
    assert figure_problems(RESULTS) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a made-up results folder: the checks above are not vacuous."""
    (tmp_path / "m").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "m" / "ok.csv").write_text("a,b\n1,2\n")
    (tmp_path / "m" / "header_only.csv").write_text("a,b\n")
    (tmp_path / "m" / "ragged.csv").write_text("a,b\n1,2\n3\n")
    (tmp_path / "benchmarks" / "ignored.csv").write_text("")
    assert csv_problems(tmp_path) == [
        "m/header_only.csv: needs a header and at least one row, has 1 lines",
        "m/ragged.csv:3: 1 cells, header has 2"]
    (tmp_path / "m" / "acc.png").write_bytes(PNG_MAGIC + b"...")
    (tmp_path / "m" / "fake.png").write_bytes(b"GIF89a..")
    (tmp_path / "README.md").write_text(
        "![m: acc.png](m/acc.png) ![m: fake.png](m/fake.png)\nsee m/gone.png and acc.png; "
        "[table](m/ok.csv) [lost](m/lost.csv) ![web](https://example.org/a.png) "
        "https://example.org/c.png")
    assert named_figures((tmp_path / "README.md").read_text()) == [
        "acc.png", "m/acc.png", "m/fake.png", "m/gone.png"]
    assert figure_problems(tmp_path) == ["m/fake.png: not a PNG", "m/gone.png: missing",
                                         "m/lost.csv: linked but missing"]
