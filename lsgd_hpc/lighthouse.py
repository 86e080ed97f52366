"""torchft's lighthouse for a job of lsgd_hpc workers, with timeouts that match the workers'.

    python -m lsgd_hpc.lighthouse --port 29510 --failure-timeout 10

starts torchft's own lighthouse server (the quorum service that every worker's manager
reports to) bound to this host's address, prints ``TORCHFT_LIGHTHOUSE=http://HOST:PORT`` (the
value the workers need) and serves until SIGTERM or SIGINT. ``--failure-timeout`` must be the
workers' (``python -m lsgd_hpc.train --failure-timeout``): half of it is the lighthouse's
heartbeat timeout, after which a silent worker is left out of the next quorum. torchft's own
``torchft_lighthouse --min_replicas 1 --heartbeat_timeout_ms T/2`` (in ms) serves as well.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from typing import Optional, Sequence

__all__ = ["main", "start_lighthouse"]


def start_lighthouse(host: str, port: int, failure_timeout: float, min_replicas: int = 1):
    """torchft's LighthouseServer on ``host:port`` (port 0: a free one); returns it (its
    ``address()`` is what TORCHFT_LIGHTHOUSE takes; ``shutdown()`` stops it)."""
    from lsgd_hpc.comm.replicas import FailureTimeouts
    from torchft.coordination import LighthouseServer
    timeouts = FailureTimeouts(failure_timeout)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return LighthouseServer(bind=bind, min_replicas=min_replicas,
                            join_timeout_ms=int(timeouts.quorum * 1000),
                            heartbeat_timeout_ms=int(timeouts.heartbeat_timeout * 1000))


def _own_address() -> str:
    """This host's address as the other nodes reach it (its name resolved), not every one."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lsgd_hpc.lighthouse",
                                description="torchft's lighthouse for lsgd_hpc workers "
                                            "(--backend torch --on-failure shrink)")
    p.add_argument("--host", default=None,
                   help="address to listen on (default: this host's address, not every one; "
                        "0.0.0.0 for every IPv4 address)")
    p.add_argument("--port", type=int, default=29510, help="port (0: a free one)")
    p.add_argument("--failure-timeout", type=float, default=None,
                   help="the workers' --failure-timeout in seconds (default 10)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="fewest workers a quorum may hold (the workers' own --min-ranks ends "
                        "the job; keep 1)")
    args = p.parse_args(argv)
    from lsgd_hpc.comm.replicas import DEFAULT_FAILURE_TIMEOUT
    timeout = args.failure_timeout or DEFAULT_FAILURE_TIMEOUT
    if timeout <= 0 or args.min_replicas < 1:
        print("python -m lsgd_hpc.lighthouse: error: --failure-timeout must be > 0 and "
              "--min-replicas >= 1", file=sys.stderr)
        return 2
    host = args.host or _own_address()
    try:
        server = start_lighthouse(host, args.port, timeout, args.min_replicas)
    except Exception as exc:                     # noqa: BLE001 - a port in use, a bad address
        print(f"python -m lsgd_hpc.lighthouse: error: cannot listen on {host}:{args.port}: "
              f"{exc}", file=sys.stderr)
        return 2
    address = server.address()
    print(f"TORCHFT_LIGHTHOUSE={address}", flush=True)
    print(f"[lsgd_hpc] lighthouse listening on {host} (from {address}); heartbeat timeout "
          f"{timeout / 2:g} s (half the failure timeout); no authentication: reachable by anyone who can reach this host",
          file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
