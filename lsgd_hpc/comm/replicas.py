"""Lost workers survived on the torch backend: workers as torchft replica groups.

``lsgd_hpc.init(backend="torch", on_failure="shrink")`` (the trainer's ``--backend torch
--on-failure shrink``, or ``heal``) runs every worker as one torchft replica group, started
by a launcher of its own (one ``torchrun`` per replica group, or one plain process), with
torchft's conventions:

==========================  =================================================================
``REPLICA_GROUP_ID``        this worker's number, 0 .. NUM_REPLICA_GROUPS - 1 (its rank as
                            numbered at the start: its metrics file, its data shard)
``NUM_REPLICA_GROUPS``      how many workers the job starts with (training starts once all
                            of them are in the first quorum)
``TORCHFT_LIGHTHOUSE``      the lighthouse, ``http://HOST:PORT`` (``python -m
                            lsgd_hpc.lighthouse``, or torchft's own ``torchft_lighthouse``)
==========================  =================================================================

torchft is the engine: its lighthouse forms the quorum of live workers (heartbeats), its
``Manager`` asks for a quorum and reconfigures the process group between workers
(:class:`torchft.process_group.ProcessGroupGloo`) without a restart. The package's own
recovery protocol runs over it, the same as under ULFM (lsgd_hpc/comm/faults.py): a
collective that fails (a peer's connection closed, or the failure timeout) raises
:class:`~lsgd_hpc.comm.failures.ProcessFailure`; every survivor then

1. notes where its methods were cut off (``recovery_prepare``) and drops its node groups
   (whose peers then fail too and join the recovery);
2. asks torchft for a new quorum (``Manager.start_quorum(shrink_only=True)``: a worker that
   is lost stays lost; the lighthouse leaves out a worker once its heartbeats have stopped
   for half the failure timeout), and the world communicator adopts the reconfigured group (its
   rank and size are the quorum's; every survivor's initial rank is gathered);
3. rebuilds the node groups (new process groups, rendezvous through the lowest member's
   torchft store), restores every method (one broadcast of the shared state from the most
   advanced survivor; an interrupted step is completed or dropped alike on every survivor)
   and checks it by digest;
4. votes (an allreduce of every survivor's outcome over the new quorum); a failure during
   2-3 makes the survivors start again from 2.

The timeouts come from one figure, ``failure_timeout`` (:class:`FailureTimeouts`): the
collective timeout between workers is that figure, the lighthouse's heartbeat timeout half of it,
the start-up and quorum timeout several times it, so that a lost worker is always noticed by
a collective or the lighthouse before anything waiting on it gives up.

``on_failure="heal"``: the same, and a lost worker that its launcher starts again (torchrun's
``--max-restarts``, the job's script) joins the running job at a step boundary and takes its
state from the survivors (:class:`ReplicaHealer`).

Workers of several ranks (``worker_ranks``) are that many replica groups of one process,
grouped as under ULFM (shrink only: with heal they are refused, lsgd_hpc/comm/stack.py). Not
here yet: a replica group of several ranks under one torchrun, refused with one line.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch

from lsgd_hpc.comm.base import CommStats
from lsgd_hpc.comm.failures import ProcessFailure, UnrecoverableFailure
from lsgd_hpc.comm.faults import MAX_ATTEMPTS, FaultTolerance
from lsgd_hpc.comm.torchdist import TorchCommunicator
from lsgd_hpc.envvars import HEAL_TIMEOUT
from lsgd_hpc.ranklists import format_ranks

__all__ = ["FailureTimeouts", "ReplicaCommunicator", "ReplicaFaultTolerance", "replica_env",
           "replica_problem", "join_replicas", "DEFAULT_FAILURE_TIMEOUT", "REPLICA_ENV"]

#: seconds without a heartbeat (or a collective's answer) before a worker counts as lost
DEFAULT_FAILURE_TIMEOUT = 10.0
#: torchft's variables: this worker's number, how many the job starts with, the lighthouse
REPLICA_ENV = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE")


@dataclass(frozen=True)
class FailureTimeouts:
    """The timeout hierarchy torchft needs, from one figure: ``detect``, the seconds after
    which a silent worker counts as lost. A collective between workers gives up after
    ``detect``; the lighthouse drops a worker whose heartbeats stopped ``detect / 2`` ago
    (heartbeats come from a thread of their own, ten or more per timeout: a worker busy in a
    long step still sends them; a dead or stopped one does not, and the quorum without it
    forms in half the time a collective would wait for it); a
    collective inside a worker (torchrun's group) waits twice that, so that a lost worker is
    seen between workers first; the quorum and the start-up wait ``quorum`` (six times, at
    least a minute), so that they outlast every failure they wait on."""

    detect: float = DEFAULT_FAILURE_TIMEOUT

    def __post_init__(self):
        if not self.detect > 0:
            raise ValueError(f"failure_timeout must be > 0 seconds, got {self.detect!r}")

    @property
    def cross(self) -> float:
        return self.detect

    @property
    def intra(self) -> float:
        return 2 * self.detect

    @property
    def setup(self) -> float:
        """How long the members of a new group (a quorum's, a node's) wait for each other to
        connect: they arrive together, so a member lost meanwhile is given up on soon. Each
        collective then sets its own timeout (``cross``, or ``quorum`` for agreements)."""
        return self.intra

    @property
    def quorum(self) -> float:
        return max(60.0, 6 * self.detect)

    @property
    def heartbeat_timeout(self) -> float:
        """The lighthouse's: a worker silent this long is left out of the next quorum."""
        return self.detect / 2

    @property
    def heartbeat(self) -> float:
        """How often a worker's manager tells the lighthouse it lives."""
        return min(1.0, max(0.02, self.detect / 20))

    @property
    def heal_poll(self) -> float:
        """Under heal, while a worker is missing: how often the survivors ask torchft's
        lighthouse for a quorum that a restarted worker may have joined (a round trip to the
        lighthouse; between polls, one tiny allreduce per step decides whether one is due)."""
        return min(5.0, max(0.5, self.detect / 2))

    def describe(self) -> str:
        return (f"failure timeout {self.detect:g} s: between workers {self.cross:g} s, inside a "
                f"worker {self.intra:g} s, quorum and start-up {self.quorum:g} s, heartbeat "
                f"every {self.heartbeat:g} s, silent for {self.heartbeat_timeout:g} s: lost")


def replica_env(env: Optional[dict] = None):
    """``(replica_group_id, num_replica_groups, lighthouse)`` from the environment (ValueError
    naming what is missing or wrong)."""
    env = os.environ if env is None else env
    missing = [n for n in REPLICA_ENV if not env.get(n, "").strip()]
    if missing:
        raise ValueError(f"--backend torch with --on-failure shrink or heal runs every worker "
                         f"as a torchft replica group: set {', '.join(missing)} (one torchrun per "
                         "replica group; see docs/cluster.md, Fault tolerance on the torch "
                         "backend)")
    try:
        rid, n = int(env["REPLICA_GROUP_ID"]), int(env["NUM_REPLICA_GROUPS"])
    except ValueError:
        raise ValueError("REPLICA_GROUP_ID and NUM_REPLICA_GROUPS must be integers, got "
                         f"{env['REPLICA_GROUP_ID']!r} and {env['NUM_REPLICA_GROUPS']!r}")
    if n < 1 or not 0 <= rid < n:
        raise ValueError(f"REPLICA_GROUP_ID must be in 0..NUM_REPLICA_GROUPS-1, got {rid} of {n}")
    return rid, n, env["TORCHFT_LIGHTHOUSE"].strip()


def replica_problem(on_failure: str) -> Optional[str]:
    """Why ``on_failure`` cannot run on the torch backend here (one line), or None."""
    # torchft's Rust side logs every quorum at INFO on stderr (read when torchft loads); its
    # warnings and errors stay
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft.manager  # noqa: F401
    except ImportError:
        return (f"on_failure={on_failure!r} with backend='torch' needs torchft (pip install "
                "'lsgd_hpc[torchft]', torchft-nightly)")
    return None


# -- the collectives over a torchft process group ---------------------------------------------
class _Work:
    """A torchft Work whose failure is a ProcessFailure (a peer lost, or the group aborted)."""

    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None):
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as exc:                  # noqa: BLE001 - gloo's errors are RuntimeError
            raise _failure(exc) from exc

    def is_completed(self) -> bool:
        try:
            return bool(self.work.is_completed())
        except Exception as exc:                  # noqa: BLE001
            raise _failure(exc) from exc


def _failure(exc: BaseException) -> ProcessFailure:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ProcessFailure(f"collective between workers failed ({text[:200]})")


class ReplicaCalls:
    """:class:`lsgd_hpc.comm.torchdist.C10dCalls` over a torchft process group (torch's
    functions need groups that torch.distributed knows; these call the group itself).

    The groups are created with a long timeout (their set-up waits for every member); each
    collective then sets its own: a training collective waits at most ``timeouts.cross``
    (the failure timeout), the collectives of set-up and agreement (``all_gather_object``,
    ``patient_all_reduce``), where members arrive far apart (one builds a group the others
    are not in, one writes a checkpoint), up to ``timeouts.quorum``."""

    def __init__(self, pg, size: int, timeouts: "FailureTimeouts"):
        self.pg, self.size = pg, size
        self.short = timedelta(seconds=timeouts.cross)
        self.patience = timedelta(seconds=timeouts.quorum)

    def _opts(self, opts, patient: bool = False):
        opts.timeout = self.patience if patient else self.short
        return opts

    def _run(self, start, async_op: bool):
        try:
            work = _Work(start())
        except Exception as exc:                  # noqa: BLE001 - an aborted group raises here
            raise _failure(exc) from exc
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op, async_op: bool = False):
        from torch.distributed.distributed_c10d import AllreduceOptions
        opts = self._opts(AllreduceOptions())
        opts.reduceOp = op
        return self._run(lambda: self.pg.allreduce([tensor], opts), async_op)

    def patient_all_reduce(self, tensor, op) -> None:
        """An allreduce that waits up to ``patience`` (agreements, the exit barrier)."""
        from torch.distributed.distributed_c10d import AllreduceOptions
        opts = self._opts(AllreduceOptions(), True)
        opts.reduceOp = op
        self._run(lambda: self.pg.allreduce([tensor], opts), False)

    def broadcast(self, tensor, root: int, async_op: bool = False):
        from torch.distributed.distributed_c10d import BroadcastOptions
        opts = self._opts(BroadcastOptions())
        opts.rootRank = root
        return self._run(lambda: self.pg.broadcast([tensor], opts), async_op)

    def all_gather(self, outs: list, send, async_op: bool = False, patient: bool = False):
        from torch.distributed.distributed_c10d import AllgatherOptions
        opts = self._opts(AllgatherOptions(), patient)
        return self._run(lambda: self.pg.allgather([outs], [send], opts), async_op)

    def all_gather_single(self, out, send, async_op: bool = False):
        rows = list(out.view(self.size, -1).unbind(0))
        return self.all_gather(rows, send.reshape(-1), async_op)

    def all_to_all_single(self, out, send, async_op: bool = False):
        from torch.distributed.distributed_c10d import AllToAllOptions
        opts = self._opts(AllToAllOptions())
        return self._run(lambda: self.pg.alltoall_base(out, send, [], [], opts), async_op)

    def all_gather_object(self, out: list, obj) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.size, dtype=torch.int64)
        self.all_gather(list(sizes.unbind(0)), torch.tensor(data.numel(), dtype=torch.int64),
                        patient=True)
        width = int(sizes.max())
        send = torch.zeros(width, dtype=torch.uint8)
        send[:data.numel()] = data
        rows = torch.empty(self.size, width, dtype=torch.uint8)
        self.all_gather(list(rows.unbind(0)), send, patient=True)
        for i in range(self.size):
            out[i] = pickle.loads(rows[i, :int(sizes[i])].numpy().tobytes())

    def exchange(self, send, receives, destinations) -> None:
        works = [self._run(lambda b=buf, j=j: self.pg.recv([b], j, 0), True)
                 for buf, j in receives]
        works += [self._run(lambda j=j: self.pg.send([send], j, 0), True) for j in destinations]
        for work in works:
            work.wait()


class ReplicaCommunicator(TorchCommunicator):
    """The world of workers (or a group split from it) over a torchft process group: the
    package's torch communicator (its checks, byte counts and elections) with its
    collectives on ``pg``. ``rank``/``size`` are the current quorum's; ``store`` is this
    process's torchft store (``host:port``), where groups split from this one meet."""

    def __init__(self, pg, rank: int, size: int, key: str, timeouts: FailureTimeouts,
                 store: str, stats: Optional[CommStats] = None, epoch: int = 0):
        self.timeouts, self.store, self.epoch = timeouts, store, epoch
        self._setup(pg, ReplicaCalls(pg, size, timeouts), stats, range(size), rank, key)
        self.one_host = None
        self._quorum_group = None

    def adopt_quorum(self, rank: int, size: int, epoch: int) -> None:
        """Rewire this object onto the reconfigured group of a new quorum (in place: every
        method holding it sees the new rank and size); groups split from the old one are
        dropped (the node groups are rebuilt)."""
        self.free()
        self._c10d = ReplicaCalls(self.group, size, self.timeouts)
        self._rank, self._size = int(rank), int(size)
        self.world_ranks = tuple(range(size))
        self.key, self.epoch, self._n_derived = f"world~{epoch}", epoch, 0
        self._graphs.clear()
        self._agreed = {}        # new members (a heal's) have agreed on no buffer yet
        self.one_host = None

    def hold(self, pg) -> None:
        """Go on over ``pg``, a group of this world's members alone (same ranks), while the
        quorum's group (``self.group``, which torchft reconfigured to hold newcomers too)
        waits for :meth:`release`: the survivors of a heal save their checkpoint over it."""
        self._quorum_group = self.group
        self.group, self._c10d = pg, ReplicaCalls(pg, self._size, self.timeouts)

    def release(self, rank: int, size: int, epoch: int) -> None:
        """Back onto the quorum's group after :meth:`hold`, as its member ``rank`` of
        ``size`` (the held group is aborted)."""
        held, self.group = self.group, self._quorum_group
        self._quorum_group = None
        try:
            held.abort(errored=False)
        except Exception:                         # noqa: BLE001 - already broken
            pass
        self.adopt_quorum(rank, size, epoch)

    def split(self, color: int, key: Optional[int] = None):
        key = self._rank if key is None else key
        self._n_derived += 1
        color = -1 if color < 0 else int(color)
        with self._watch("split"):
            table = self.allgather_object((color, int(key), self.store))
        if color < 0:
            return None
        members = sorted((k, r) for r, (c, k, _) in enumerate(table) if c == color)
        ranks = [r for _, r in members]
        name = f"{self.key}/split{self._n_derived}:{color}"
        return self._child(ranks, table[ranks[0]][2], name)

    def dup(self):
        self._n_derived += 1
        with self._watch("dup"):
            stores = self.allgather_object(self.store)
        return self._child(list(range(self._size)), stores[0],
                           f"{self.key}/dup{self._n_derived}")

    def _child(self, ranks: List[int], store: str, name: str) -> "ReplicaCommunicator":
        """A group of these ranks of this one, its process group met through ``store``."""
        pg = None
        if len(ranks) > 1:
            from torchft.process_group import ProcessGroupGloo, reconfigure_with_store
            pg = ProcessGroupGloo(timeout=timedelta(seconds=self.timeouts.setup))
            with self._watch("split rendezvous"):
                try:
                    reconfigure_with_store(pg, f"{store}/lsgd_hpc/{self.epoch}/{name}",
                                           ranks.index(self._rank), len(ranks),
                                           timedelta(seconds=self.timeouts.quorum))
                except Exception as exc:          # noqa: BLE001 - a member lost meanwhile
                    raise _failure(exc) from exc
        child = ReplicaCommunicator(pg, ranks.index(self._rank), len(ranks), name,
                                    self.timeouts, self.store, self.stats, self.epoch)
        child.world_ranks = tuple(self.world_ranks[r] for r in ranks)
        return self._register_child(child)

    def agree_min(self, flag: torch.Tensor) -> torch.Tensor:
        """An allreduce (min) that waits up to the quorum timeout: the recovery's vote."""
        from torch.distributed.distributed_c10d import ReduceOp
        with self._watch("agreement"):
            self._c10d.patient_all_reduce(flag, ReduceOp.MIN)
        return flag

    def barrier(self) -> None:
        if self._size == 1:
            return
        from torch.distributed.distributed_c10d import ReduceOp
        with self._watch("barrier"):
            self._c10d.patient_all_reduce(torch.zeros(1, dtype=torch.int32), ReduceOp.SUM)

    def free(self) -> None:
        """Abort the groups split from this one (their peers' collectives fail at once)."""
        for child in self._children:
            child.free()
            if child.group is not None:
                try:
                    child.group.abort(errored=False)
                except Exception:                 # noqa: BLE001 - already broken
                    pass
        self._children.clear()
        self._graphs.clear()

    def abort(self, code: int = 1) -> None:
        """End this worker now; the others go on without it (they recover)."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# -- the recovery over torchft ----------------------------------------------------------------
class ReplicaFaultTolerance(FaultTolerance):
    """:class:`~lsgd_hpc.comm.faults.FaultTolerance` with torchft as the engine: the quorum
    of live workers from torchft's lighthouse in place of MPI_Comm_shrink, an allreduce over
    the new quorum in place of MPI_Comm_agree (see the module docstring).

    The revoke: a survivor that starts a recovery aborts its groups (the node groups and the
    world's), so that every survivor waiting on it in a collective fails at once and joins
    the recovery (otherwise it would wait out its collective's timeout while the lighthouse
    waits for it). torchft rebuilds the world's group when the quorum changed; when it did
    not (no worker was lost: a collective timed out on a slow worker), the survivors rebuild
    it themselves, meeting at the lowest member's store."""

    def __init__(self, comm, manager, replica_id: int, min_ranks: int, ranks_per_node,
                 policy: str = "shrink", initial_size: Optional[int] = None):
        self.manager, self.replica_id = manager, replica_id
        super().__init__(comm, min_ranks, ranks_per_node, policy)
        #: every worker's torchft store (host:port), by initial rank
        table = comm.world.allgather_object((replica_id, comm.world.store))
        self.stores = dict(table)
        self.initial_ranks = [int(i) for i, _ in table]
        #: NUM_REPLICA_GROUPS: the job's size at the start (a healed world may hold fewer)
        self.initial_size = int(initial_size or comm.world.size)
        self._current_hosts = list(self.initial_hosts)    # by current rank
        self.healer = ReplicaHealer(self) if policy == "heal" else None

    def _prepare_world(self, world) -> None:
        """torchft's groups report a lost peer as an error already."""

    def _alert_others(self) -> None:
        world = self.comm.world
        world.free()
        try:
            world.group.abort(errored=False)
        except Exception:                         # noqa: BLE001 - already aborted
            pass

    def _meet_survivors(self) -> None:
        self._alert_others()

    def _agree(self, ok: int) -> int:
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        try:
            self.comm.world.agree_min(flag)
        except Exception:                         # noqa: BLE001 - a worker lost meanwhile
            return 0
        return int(flag.item())

    def _shrink_world(self, attempt: int, exc: Optional[BaseException]) -> Optional[List[int]]:
        world = self.comm.world
        self._alert_others()
        manager = self.manager
        try:
            before = manager._quorum_id           # (torchft says no other way whether it changed)
            manager.start_quorum(allow_heal=False, shrink_only=True,
                                 timeout=timedelta(seconds=world.timeouts.quorum))
            manager.wait_quorum()
            error = manager.errored()
            if error is not None:
                raise error.original_exception
            rank, size = manager.participating_rank(), manager.num_participants()
            if rank is None:
                raise UnrecoverableFailure("lsgd_hpc: this worker is not in torchft's new "
                                           "quorum; ending it")
            if manager._quorum_id == before:      # the same workers: torchft kept the group
                self._rebuild_world_group(rank, size, attempt)
            world.adopt_quorum(rank, size, self.generation + 1)
            ids = world.allgather_object((self.replica_id, world.store))
        except UnrecoverableFailure:
            raise
        except Exception as e:                    # noqa: BLE001 - a worker lost meanwhile
            if attempt + 1 < MAX_ATTEMPTS:
                return None
            raise UnrecoverableFailure(f"lsgd_hpc: torchft's quorum failed ({e}); cannot "
                                       "recover") from exc
        self.stores.update(ids)
        ids = [i for i, _ in ids]
        if ids != sorted(ids) or len(set(ids)) != len(ids) or \
                not set(ids) <= set(self.initial_ranks):
            raise UnrecoverableFailure(f"lsgd_hpc: torchft's quorum holds workers {ids}, not "
                                       f"a subset of {self.initial_ranks} in order; ending")
        return [int(i) for i in ids]

    def _rebuild_world_group(self, rank: int, size: int, attempt: int) -> None:
        """The world's group again, over the same members (every survivor aborted it and
        torchft saw no change of quorum): they meet at the lowest member's store."""
        from torchft.process_group import reconfigure_with_store
        members = self.initial_ranks
        if size != len(members):
            raise RuntimeError(f"torchft's quorum has {size} workers where {len(members)} "
                               "were, under the same quorum id")
        store = self.stores[members[0]]
        reconfigure_with_store(self.comm.world.group,
                               f"{store}/lsgd_hpc/rebuild/{self.generation}-{attempt}", rank,
                               size, timedelta(seconds=self.comm.world.timeouts.setup))

    def final_barrier(self) -> None:
        super().final_barrier()
        if self.retired:                          # the healed world's does it
            return
        try:
            self.manager.shutdown(wait=False)
        except Exception:                         # noqa: BLE001 - leaving anyway
            pass

    def workers_problem(self, worker_ranks) -> Optional[str]:
        if self.policy != "heal":
            return None
        return (f"worker_ranks={worker_ranks!r} is not supported with on_failure='heal' on the "
                "torch backend yet (a restarted rank of a worker does not rejoin it reliably); "
                "use on_failure='shrink', or worker_ranks=1")

    # -- heal: restarted workers join at a step boundary (ReplicaHealer) -----------------------
    def _spawn_replacements(self, event) -> None:
        """Nothing is spawned on the torch backend: torchrun's --max-restarts (or the job's
        script) starts the lost worker again, and it joins at a quorum (ReplicaHealer)."""
        missing = [r for r in range(self.initial_size) if r not in self.initial_ranks]
        if not event.lost_ranks or not missing:   # (a slow collective: nobody was lost)
            return
        self.healer.lost_at = self.healer.lost_at or time.time()
        if self.comm.world.rank == 0:
            print(f"[lsgd_hpc] heal: waiting for worker(s) {format_ranks(missing)} to be "
                  "restarted (torchrun --max-restarts, or the job's script) and join; going "
                  f"on with {self.comm.world.size} meanwhile", file=sys.stderr, flush=True)

    def history(self, app: dict) -> dict:
        """What the healed world carries over (sent by the survivors' rank 0 in the join)."""
        return {"generation": self.generation + 1, "lost_at": self.healer.lost_at,
                "decided_at": time.time(), "app": dict(app), "spares": [],
                "step": int(getattr(self, "last_step", -1)), "lost": list(self.lost),
                "hosts": list(self.initial_hosts)}

    def take_history(self, history: dict) -> None:
        """A healed world's: the job's numbering (initial ranks, hosts and nodes of all
        NUM_REPLICA_GROUPS workers), who is still missing, the heal it came from."""
        hosts = list(history["hosts"])
        for r, host in zip(self.initial_ranks, self._current_hosts):
            hosts[r] = host                       # a restarted worker may run elsewhere
        self.initial_hosts = hosts
        self.initial_nodes = [f"node {r // self.ranks_per_node}" if self.ranks_per_node
                              else h for r, h in enumerate(hosts)]
        history = dict(history, replaced=sorted(set(self.initial_ranks)
                                                & set(history["lost"])))
        self.lost = sorted(set(history["lost"]) - set(self.initial_ranks))
        super().take_history(history)


class ReplicaHealer:
    """The survivors' side of ``on_failure="heal"`` on the torch backend (what
    FaultTolerance and the session ask of :class:`lsgd_hpc.comm.heal.Healer`: ``pending``,
    ``ready``, ``join``, ``release``, ``lost_at``).

    Nothing is spawned: a lost worker is started again by its launcher (torchrun's
    ``--max-restarts``, or the job's script) and asks torchft's lighthouse for a quorum. While
    a worker is missing, the survivors ask for one too at step boundaries, every
    :attr:`FailureTimeouts.heal_poll` seconds (one tiny allreduce per step decides that a
    poll is due, so that every survivor polls at the same step):

    1. **Poll.** ``Manager.start_quorum`` (not shrink-only): the lighthouse answers at once
       when every survivor asked, with any restarted worker that is waiting. The same quorum
       id: nobody came, the group is untouched.
    2. **Hello.** A new quorum id: torchft has reconfigured the group between workers over the
       new members. Every member gathers (replica id, running?, store, host) over it; a
       restarted worker says it is not running. A survivor missing from it is a failure
       (ProcessFailure: the recovery follows, shrink-only, and leaves the newcomer out).
    3. **Hold.** The survivors meet in a group of their own (the lowest survivor's store) and
       the world goes on over it (:meth:`ReplicaCommunicator.hold`): the trainer saves its
       checkpoint there, while the newcomers wait in the join.
    4. **Join.** Every member back on the quorum's group; the survivors' rank 0 sends the
       history (run folder, generation, the job's hosts, who is still missing); every member
       builds the session over the healed world and resumes the survivors' checkpoint, in
       which a joined worker rejoins (its state from a live peer, as at a full-size resume).

    Workers restarted one at a time each join at the next poll: the healed world may hold
    fewer than NUM_REPLICA_GROUPS workers, numbered as at the start."""

    def __init__(self, ft: "ReplicaFaultTolerance"):
        self.ft = ft
        self.lost_at = 0.0
        self.polled = time.monotonic()
        self._joined: Optional[tuple] = None      # (rank, size) in the quorum's group

    @property
    def pending(self) -> bool:
        """A worker of the job is missing (its restart may join)."""
        return len(self.ft.initial_ranks) < self.ft.initial_size

    def ready(self) -> bool:
        """Collective over the survivors, at a step boundary: True on every survivor once
        restarted workers are in torchft's quorum (then save a checkpoint and call join)."""
        from lsgd_hpc.comm.accounting import uncounted
        ft, world = self.ft, self.ft.comm.world
        due = time.monotonic() - self.polled >= world.timeouts.heal_poll
        with uncounted(world):
            if not world.any_true(due):
                return False
        self.polled = time.monotonic()
        manager = ft.manager
        before = manager._quorum_id               # (torchft says no other way whether it changed)
        try:
            manager.start_quorum(allow_heal=False, shrink_only=False,
                                 timeout=timedelta(seconds=world.timeouts.quorum))
            error = manager.errored()
            if error is not None:
                raise error.original_exception
            rank, size = manager.participating_rank(), manager.num_participants()
        except Exception as exc:                  # noqa: BLE001 - a worker lost meanwhile
            raise _failure(exc) from exc
        if manager._quorum_id == before:
            return False
        if rank is None:
            raise UnrecoverableFailure("lsgd_hpc: this worker is not in torchft's new quorum; "
                                       "ending it")
        table = _hello(ReplicaCalls(world.group, size, world.timeouts), ft.replica_id,
                       True, world.store)
        running = [int(t[0]) for t in table if t[1]]
        new = [int(t[0]) for t in table if not t[1]]
        if running != list(ft.initial_ranks) or not new:
            raise ProcessFailure(f"torchft's quorum changed (workers {running} running, "
                                 f"{new} restarted; {list(ft.initial_ranks)} before)")
        self._joined = (rank, size)
        self._hold(table)
        if world.rank == 0:
            print(f"[lsgd_hpc] heal: worker(s) {format_ranks(new)} restarted and in torchft's "
                  "quorum", file=sys.stderr, flush=True)
        return True

    def _hold(self, table: list) -> None:
        """The survivors' own group, met at the lowest survivor's store (step 3)."""
        from torchft.process_group import ProcessGroupGloo, reconfigure_with_store
        ft, world = self.ft, self.ft.comm.world
        store = next(t[2] for t in table if t[1])
        pg = ProcessGroupGloo(timeout=timedelta(seconds=world.timeouts.setup))
        try:
            reconfigure_with_store(pg, f"{store}/lsgd_hpc/heal/{ft.generation}-"
                                   f"{ft.manager._quorum_id}", world.rank, world.size,
                                   timedelta(seconds=world.timeouts.quorum))
        except Exception as exc:                  # noqa: BLE001 - a survivor lost meanwhile
            raise _failure(exc) from exc
        world.hold(pg)

    def join(self, history: dict):
        """Collective with the restarted workers (step 4): the healed world (this
        ReplicaCommunicator, on the quorum's group), with the history every member took."""
        world = self.ft.comm.world
        rank, size = self._joined
        world.release(rank, size, int(history["generation"]))
        table = world.allgather_object(history if world.rank == 0 else None)
        world.healed_history = next(h for h in table if h is not None)
        self._joined = None
        return world

    def release(self) -> None:
        """At the end of the job: nothing to release (a worker restarted too late finds no
        quorum and ends by itself)."""


def _hello(calls: "ReplicaCalls", rid: int, running: bool, store: str) -> list:
    """Every member of a new quorum's group: (replica id, running?, store, host) in rank
    order (the first collective over it; a restarted worker says it is not running)."""
    out: list = [None] * calls.size
    calls.all_gather_object(out, (int(rid), bool(running), store, socket.gethostname()))
    return out


# -- joining the job ---------------------------------------------------------------------------
def _store_for_group(env: dict):
    """The replica group's TCP store, where its manager and ranks meet: torchrun's
    (MASTER_ADDR/MASTER_PORT), or for a worker of one process started alone, one of its own."""
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"]), None
    from torch.distributed import TCPStore
    store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    return socket.gethostname(), int(store.port), store


def join_replicas(device, ranks_per_node, min_ranks: int, policy: str,
                  failure_timeout: Optional[float] = None):
    """The world of workers for ``backend="torch"`` with ``on_failure="shrink"`` or
    ``"heal"``: join torchft's first quorum of all NUM_REPLICA_GROUPS workers, or under heal
    a running job's quorum (a restarted worker: see :class:`ReplicaHealer`). Returns
    ``(world, manager, replica_id, history)``, history None at the start of a job, else what
    the survivors sent (lsgd_hpc.session builds the session over it: node groups, device,
    :class:`ReplicaFaultTolerance`). ValueError (one line) for what the environment lacks;
    every worker that waits too long for the others ends with the same line."""
    env = os.environ
    problem = replica_problem(policy)
    if problem:
        raise ValueError(problem)
    rid, n, lighthouse = replica_env(env)
    group_size = int(env.get("WORLD_SIZE", "1") or 1)
    if group_size != 1:
        raise ValueError(f"a replica group of {group_size} ranks (torchrun --nproc-per-node "
                         f"{group_size}) is not supported with on_failure={policy!r} on the "
                         "torch backend yet: start one torchrun per rank (--nproc-per-node 1), "
                         "each its own replica group")
    if min_ranks > n:
        raise ValueError(f"min_ranks={min_ranks} is more than the {n} workers of the job")
    timeouts = FailureTimeouts(float(failure_timeout or DEFAULT_FAILURE_TIMEOUT))
    manager, pg = _manager(env, rid, lighthouse, min_ranks, timeouts)
    own_store = json.loads(pg.get_reconfigure_handle())["store"]
    # a worker that its launcher restarted waits for a running job's survivors to poll
    restarted = env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    patience = max(timeouts.quorum, HEAL_TIMEOUT.read()) if policy == "heal" and restarted \
        else timeouts.quorum
    deadline = time.monotonic() + patience
    have = 0
    while time.monotonic() <= deadline:
        joined = _join_quorum(manager, pg, rid, n, timeouts, own_store, policy)
        if isinstance(joined, tuple):
            world, history = joined
            if history is None and rid == 0:
                print(f"[lsgd_hpc] torchft: {n} workers in quorum through lighthouse "
                      f"{lighthouse}; {timeouts.describe()}; listening: this worker's "
                      f"manager on all addresses (torchft binds [::]), its store at "
                      f"{own_store}", file=sys.stderr, flush=True)
            return world, manager, rid, history
        have = max(have, joined)
        time.sleep(min(0.5, timeouts.heartbeat * 2))
    raise ValueError(f"only {have} of NUM_REPLICA_GROUPS={n} workers joined torchft's "
                     f"lighthouse {lighthouse} within {patience:g} s"
                     + (" (and no running job took this restarted worker in)"
                        if policy == "heal" else ""))


def _join_quorum(manager, pg, rid: int, n: int, timeouts: FailureTimeouts, own_store: str,
                 policy: str):
    """One quorum asked for at the start: ``(world, history)`` once joined (history None:
    all n workers start the job; else the running job's, under heal), or how many workers
    the quorum held (ask again)."""
    try:
        manager.start_quorum(allow_heal=False, timeout=timedelta(seconds=timeouts.quorum))
        if manager.errored() is not None:
            return 0
        rank, size = manager.participating_rank(), manager.num_participants()
    except Exception:                             # noqa: BLE001 - the lighthouse's timeout
        return 0
    if rank is None or (size != n and policy != "heal"):
        return size                     # (under shrink nobody runs yet: wait for all n)
    try:
        table = _hello(ReplicaCalls(pg, size, timeouts), rid, False, own_store)
    except Exception:                             # noqa: BLE001 - the quorum changed meanwhile
        return size
    ids = [int(t[0]) for t in table]
    if len(set(ids)) != len(ids):
        raise ValueError(f"torchft's quorum numbers the workers {ids}: is REPLICA_GROUP_ID "
                         "set twice?")
    world = ReplicaCommunicator(pg, rank, size, "world", timeouts, own_store)
    if any(t[1] for t in table):                  # a running job (heal): join it
        try:
            sent = world.allgather_object(None)   # (ReplicaHealer.join's, on the survivors)
        except Exception:                         # noqa: BLE001 - the survivors recovered
            return size
        history = next(h for h in sent if h is not None)
        g = int(history["generation"])
        world.key, world.epoch = f"world~{g}", g
        return world, history
    if size != n:
        return size
    if ids != list(range(n)):
        raise ValueError(f"torchft's first quorum numbers the workers {ids}, not 0..{n - 1}")
    return world, None


def _manager(env: dict, rid: int, lighthouse: str, min_ranks: int, timeouts: FailureTimeouts):
    """This worker's torchft Manager and the process group between workers it reconfigures."""
    import logging
    logging.getLogger("torchft").setLevel(logging.WARNING)
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    host, port, store = _store_for_group(env)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=timeouts.setup))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_ranks,
                      use_async_quorum=False, init_sync=False,
                      timeout=timedelta(seconds=timeouts.cross),
                      quorum_timeout=timedelta(seconds=timeouts.quorum),
                      connect_timeout=timedelta(seconds=timeouts.quorum),
                      rank=0, world_size=1, store_addr=host, store_port=port,
                      lighthouse_addr=lighthouse, replica_id=f"{rid:06d}",
                      hostname=socket.gethostname(),
                      heartbeat_interval=timedelta(seconds=timeouts.heartbeat))
    manager._lsgd_store = store                  # (a store of our own lives with the manager)
    return manager, pg
