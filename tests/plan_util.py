"""The planner's command line answered in this process (the tests' helper)."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace


def plan_main(args) -> SimpleNamespace:
    """What ``python -m lsgd_hpc.plan ARGS`` answers (exit status, stdout, stderr), from its
    main() in this process: a subprocess would spend a second or more importing torch (the
    entry point itself is run as a process by tests/planning/test_plan.py)."""
    from lsgd_hpc.planning.plan import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:            # argparse's refusals
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
