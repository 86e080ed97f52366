"""The documentation travels with the repository: README and docs/ link only to files in it,
and nothing in the repository points at files outside it."""

import re
import subprocess

import pytest

from mpi_util import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files():
    files = [REPO / "README.md", REPO / "slurm" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md")) if (REPO / "docs").is_dir() else []
    return files


def test_readme_starts_with_the_two_set_up_commands():
    text = (REPO / "README.md").read_text()
    block = text.split("```")[1]
    assert [ln.split("#")[0].strip() for ln in block.strip().splitlines()] == \
        ["make demo", "make test"]


@pytest.mark.parametrize("doc", ["docs/library.md", "docs/algorithms.md", "docs/metrics.md",
                                 "docs/cluster.md", "slurm/README.md"])
def test_readme_links_each_document(doc):
    assert doc in LINK.findall((REPO / "README.md").read_text())


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve_inside_the_repository(md):
    for target in LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#")[0]).resolve()
        assert REPO.resolve() in path.parents or path == REPO.resolve(), \
            f"{md.name}: {target} points outside the repository"
        assert path.exists(), f"{md.name}: {target} does not exist"


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    outside = re.compile(r"\.\./shared|/work/shared|ENVIRONMENT\.md|CONTRACT\.md|"
                         r"ALGORITHMS\.md|STYLE\.md")
    hits = []
    for name in tracked:
        if name == "tests/test_docs.py":
            continue
        try:
            text = (REPO / name).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{name}:{i}" for i, ln in enumerate(text.splitlines(), 1) if outside.search(ln)]
    assert hits == []
