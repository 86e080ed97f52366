"""``python -m lsgd_hpc.topology NAME -n N [--gamma G ...] [--json]``: analyse a topology."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .analysis import DEFAULT_GAMMAS, analyse
from .graphs import TOPOLOGIES

__all__ = ["main"]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_PROG = "lsgd_hpc.topology"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: easy to grep in batch logs
        self.exit(2, f"{self.prog}: error: {message}\n")


def _format_table(result: dict) -> str:
    deg = result["degree"]
    lines = [
        f"{'topology':<30}{result['topology']}",
        f"{'n':<30}{result['n']}",
        f"{'layout':<30}{result['layout']}",
        f"{'time-varying (period)':<30}{result['time_varying']} ({result['period']})",
        f"{'degree min/max/mean':<30}{deg['min']} / {deg['max']} / {deg['mean']:.4g}",
        f"{'diameter':<30}{result['diameter']}",
        f"{'symmetric':<30}{result['symmetric']}",
        f"{'doubly stochastic':<30}{result['doubly_stochastic']}",
        f"{'directed':<30}{result['directed']}",
        f"{'|lambda_2|':<30}{result['second_eigenvalue_modulus']:.6g}",
        f"{'sigma_2 = ||W - 11^T/n||':<30}{result['second_singular_value']:.6g}",
        f"{'spectral gap (1 - sigma_2)':<30}{result['spectral_gap']:.6g}",
    ]
    for g, v in result["effective_neighbors"].items():
        lines.append(f"{'effective neighbours @ ' + g:<30}{v:.6g}")
    if result["time_varying"]:
        lines.append("(|lambda_2| of a time-varying topology: per-step rate of the period product)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: python -m lsgd_hpc.topology NAME -n N [--gamma G ...] [--ranks-per-node K] [--json]."""
    parser = _Parser(prog=_PROG, description="Degree, diameter, spectral gap and effective "
                     "number of neighbours of a gossip topology.")
    parser.add_argument("name", metavar="NAME", help="one of: " + ", ".join(TOPOLOGIES))
    parser.add_argument("-n", type=int, required=True, help="number of ranks")
    parser.add_argument("--gamma", type=float, nargs="+", default=list(DEFAULT_GAMMAS),
                        metavar="G", help="gammas of the effective number of neighbours, in [0, 1)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                        help="hierarchical: K consecutive ranks per node (default: one per node)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:          # --help (0) or a usage error (2), already printed
        return int(stop.code or 0)
    try:
        node_of = None
        if args.ranks_per_node is not None:
            if args.ranks_per_node < 1:
                raise ValueError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
            node_of = [r // args.ranks_per_node for r in range(max(args.n, 0))]
        result = analyse(args.name, args.n, args.gamma, node_of)
    except ValueError as err:
        print(f"{_PROG}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
