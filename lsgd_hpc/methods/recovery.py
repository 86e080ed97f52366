"""How each method restores its invariants after ranks died (``on_failure="shrink"``).

The communication layer has shrunk the world and rebuilt the node groups
(lsgd_hpc/comm/faults.py); every survivor then runs, for every method built on the
communicator (in the order they were built), :func:`prepare` (local: where this rank's step
was cut off) and :func:`restore` (collective over the new world):

1. **Where was each survivor?** One allgather of (completed steps, whether that step's
   communication completed, stop flag, the rule's report). A survivor cut off in the
   gradient exchange of step s had completed s - 1 (nothing of s is applied); one cut off in
   the rule's communication after its optimizer step has taken s steps, incompletely.
   Survivors may be a few steps apart: a collective can complete on some survivors and fail on
   others (ULFM reports failures non-uniformly), and those go on to their next collective.
2. **The agreed step** K is the most advanced survivor's step count; the *source* is the
   lowest rank among those at K whose communication completed (else the lowest at K).
   Every survivor ends the recovery with ``method.steps == K``: the call that was cut off
   returns, and a survivor that was behind skips the local steps it did not take (its
   minibatches are lost; schedules stay in step on every rank).
3. **The rule's state.** What must be equal on every rank is broadcast from the source and
   checked (a digest allgather): AllreduceSGD the parameters, buffers and optimizer state
   (replicas bit-identical again); EASGD the centre; DiLoCo x_prev, the outer optimizer's
   momentum and its count (a survivor that missed the source's last outer step restarts its
   inner phase from x_prev; Streaming DiLoCo: every fragment's outer optimizer, a missed
   fragment restarts from x_prev_f, and the fragment allreduce the source had in flight is
   redone over the survivors from each one's saved contribution); SlowMo x_old and u;
   local SGD its period state (T, the position in the period, the estimator's state; an
   averaging that was cut off is skipped).
   LeaderSGD keeps no shared state: a pull cut off by the failure is finished on every
   survivor of its group or on none -- the survivors report whether they hold a complete copy
   of the leader (they finished its broadcast, or are that leader); if one does, it is
   re-broadcast from the lowest such rank and the others pull; if none does (the leader died
   before anyone had its copy), nobody pulled. With ``pull_delay`` the broadcasts in flight
   are treated alike (completed from the lowest survivor of the group that holds the whole
   copy -- it received it, led it or pulled it already -- and pulled at their step, or at
   once when the agreed step has passed it; dropped on all when none holds it or a member
   never started it), and the delayed broadcasts' own communicators are rebuilt. A dead
   rank is never elected again: the new world does not hold it. GossipSGD rebuilds its
   topology over the survivors (a ring when the topology cannot be built at the new size),
   with a warning from the lowest survivor. AsyncLeaderSGD: see its handler below.
4. **Control.** A stop already agreed on one survivor is taken on all; a stop agreement in
   flight is dropped (flags raised since are posted again); ``done`` and
   ``checkpoint_due`` follow K. AsyncLeaderSGD, whose ranks take uneven steps, keeps each
   rank's own count, and its rule decides the end and the checkpoints again.

AllreduceSGD and a failure during the gradient averaging of step s: if any survivor finished
step s, every survivor takes that survivor's parameters and optimizer state (the step
counts); otherwise the step is dropped on every survivor (its minibatch lost, the count
stays s - 1, the next call is step s again). Its averaging over the survivors is not redone:
a survivor's own gradient is gone by then (the in-place allreduce overwrote it).
"""

from __future__ import annotations

import hashlib
import io
import math
import sys
from typing import Dict, List, Optional

import torch

from lsgd_hpc.comm.faults import injection_point, is_process_failure  # noqa: F401

__all__ = ["attach", "prepare", "restore", "rejoin", "guarded", "refusal"]

def refusal(name: str, options: dict, worker_ranks=1):
    """Why a method built with these options cannot recover from lost ranks, or None: the
    state that is not restored yet after a shrink is refused up front, on every rank."""
    if worker_ranks == 1:
        return None
    return ("on_failure='shrink' does not support worker_ranks != 1 (a worker that lost one "
            "of its ranks would have to be rebuilt from the survivors of its node) yet; leave "
            "it out, or use on_failure='abort' and resume from a checkpoint")


def attach(method) -> None:
    """At construction, when the communicator recovers from failures: register the method
    (its prepare/restore run at every recovery)."""
    ft = getattr(method.comm, "_ft", None)
    if ft is None:
        return
    rule = method.rule
    if getattr(rule, "streaming", False):     # Streaming DiLoCo: what the survivors redo
        rule.contribution = torch.empty_like(rule.scratch)
    ft.register(method)


def guarded(method, call, *args):
    """``call(*args)``; after a rank failure, recover (every method restores) and return
    None: the call that was cut off ends there, with the method's state agreed."""
    try:
        return call(*args)
    except Exception as exc:                      # noqa: BLE001
        ft = method.comm._ft
        if ft is None or ft.recovering or not is_process_failure(exc):
            raise
        method.comm.recover(exc)
        return None


# -- the two phases ----------------------------------------------------------------------------
def prepare(method, ctx) -> None:
    """Local, once per recovery, before anything is shrunk: what this rank has completed."""
    phase = method._phase
    complete = phase != "after"
    if phase == "sync":                 # the user's synchronize(): drop the step that follows
        method._drop_next = True
    method._phase = None
    method._ft_report = {"steps": int(method.steps), "complete": bool(complete),
                         "stopping": bool(method.stopping)}
    method._synced = False
    if method._agreement is not None:
        method._agreement.pending = None             # its request died with the old world
    buckets = getattr(method.rule, "buckets", None)
    if buckets is not None:
        buckets.failure = None
        buckets._reset()
    handler = _HANDLERS.get(method.rule.name)
    report = handler.prepare(method, ctx, complete) if handler is not None else None
    method._ft_report["rule"] = report


def restore(method, ctx) -> None:
    """Collective over the new world (may run again if a rank dies during it)."""
    world = method.comm.world                          # exact, whatever comm_dtype
    _refresh_groups(method)
    reports = world.allgather_object(method._ft_report)
    K = max(r["steps"] for r in reports)
    at_k = [i for i, r in enumerate(reports) if r["steps"] == K]
    done_k = [i for i in at_k if reports[i]["complete"]]
    source = min(done_k or at_k)
    handler = _HANDLERS.get(method.rule.name)
    if handler is not None:
        handler.restore(method, ctx, reports, source)
    shared = handler.shared(method) if handler is not None else {}
    if shared:
        digests = world.allgather_object(_digest(shared))
        if len(set(digests)) > 1:
            raise RuntimeError(f"{type(method).__name__}: the survivors' shared state still "
                               f"differs after the recovery ({len(set(digests))} versions)")
    ctx.step = K
    method.stopping = method.stopping or any(r["stopping"] for r in reports)
    method._ft_report["stopping"] = method.stopping
    if method.rule.owns_schedule:
        # AsyncLeaderSGD: each rank keeps its own step count, and the rule decides the end
        # and the checkpoints again from fresh probes (its handler reset them)
        method._ft_report["complete"] = True
        method.checkpoint_due = False
        return
    method.steps = K
    from lsgd_hpc.comm.monitor import MONITOR
    MONITOR.step = K
    method._ft_report.update(steps=K, complete=True)   # a second attempt starts from here
    method.done = method.max_steps is not None and K >= method.max_steps
    method.checkpoint_due = bool(method.checkpoint_every and K % method.checkpoint_every == 0)


def rejoin(method, info) -> str:
    """Collective, at a full-size resume of a survivors' checkpoint (Checkpointer.restore,
    every object already loaded; ``info`` a runtime.checkpoint.Rejoin): the ranks that were
    lost take the parameters of the method's kind, and the shared state is checked equal on
    every rank. Returns what the rejoining ranks took, for the log line."""
    world = method.comm.world
    joined = set(info.joined)
    source = min(r for r in range(world.size) if r not in joined)
    handler = _HANDLERS.get(method.rule.name, _Handler())
    if world.rank in joined and method.wire is not None:
        method.wire.load_state_dict({})       # error feedback: no residual of its own yet
    how = handler.rejoin(method, world.rank in joined, source)
    shared = handler.shared(method)
    if shared:
        digests = world.allgather_object(_digest(shared))
        if len(set(digests)) > 1:
            raise RuntimeError(f"{type(method).__name__}: the shared state differs after the "
                               f"lost ranks rejoined ({len(set(digests))} versions)")
    return how


def _take_from(method, source: int, joined: bool, n: Optional[int] = None) -> None:
    """The rejoining ranks take the first ``n`` values (all: parameters and buffers) of
    ``source``'s flat vector."""
    flat = method.flat.flat
    buf = flat.detach().clone() if method.comm.world.rank == source else torch.empty_like(flat)
    method.comm.world.broadcast_(buf, source)
    if joined:
        flat[:n].copy_(buf[:n])


def _to_the_leader(method, joined: bool, source: int):
    """Leader methods at a rejoin: elect the survivor with the best score (the window mean
    of its last losses; a rejoining rank has none) and give the rejoining ranks its
    parameters. Returns (its rank, the election); the lowest survivor when no score is
    finite."""
    rule = method.rule
    if joined:
        rule.losses.clear()
    el = method.comm.world.elect(rule.score())
    leader = el.world_rank if math.isfinite(el.score) else source
    _take_from(method, leader, joined)
    return leader, el


def _refresh_groups(method) -> None:
    """A method that sends in low precision holds wrappers of the node communicators: point
    them at the rebuilt ones (in place, so the rule's reference stays valid)."""
    groups, base = method.groups, method.comm.groups
    if groups is base:
        return
    wrap = getattr(groups.node, "inner", None) is not None

    def like(template, inner):
        if inner is None:
            return None
        if not wrap:
            return inner
        w = object.__new__(type(template))        # (a wrapper may forward __getattr__)
        w.__dict__.update({k: (dict(v) if isinstance(v, dict) else v)
                           for k, v in vars(template).items()})
        w.inner = inner
        return w
    groups.node = like(groups.node, base.node)
    groups.roots = like(groups.node, base.roots)
    groups.node_of = base.node_of


# -- helpers -------------------------------------------------------------------------------------
def broadcast_object(world, obj, root: int):
    """``obj`` from ``root`` to every member (torch.save over two broadcasts), exact."""
    if world.rank == root:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    world.broadcast_(n, root)
    if world.rank != root:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    world.broadcast_(data, root)
    if world.rank == root:
        return obj
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)


def _digest(obj) -> str:
    h = hashlib.blake2b(digest_size=16)

    def feed(v):
        if isinstance(v, torch.Tensor):
            h.update(str(v.dtype).encode())
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                     if v.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                feed(x)
        elif isinstance(v, float) and math.isnan(v):
            h.update(b"nan")
        else:
            h.update(repr(v).encode())
    feed(obj)
    return h.hexdigest()


def _broadcast_copy(world, source: torch.Tensor, root: int, into) -> None:
    """``source`` of ``root`` into ``into`` (None: not wanted here) on every member, exact,
    through a buffer of its own on every rank: the members then all run the same agreement
    check (a buffer registered with agree_buffers skips it, and which buffer holds what after
    a failure differs from rank to rank)."""
    buf = source.detach().clone() if world.rank == root else torch.empty_like(source)
    world.broadcast_(buf, root)
    if into is not None and world.rank != root:
        into.copy_(buf)


def _source_state(method, world, source: int, state_of, load) -> None:
    """Broadcast ``state_of()`` from ``source``; every other rank calls ``load(state)``."""
    state = broadcast_object(world, state_of() if world.rank == source else None, source)
    if world.rank != source:
        load(state)


# -- per rule ------------------------------------------------------------------------------------
class _Handler:
    def prepare(self, method, ctx, complete: bool):
        return None

    def restore(self, method, ctx, reports: List[dict], source: int) -> None:
        pass

    def shared(self, method) -> dict:
        """What must be equal on every survivor afterwards (checked by a digest)."""
        return {}

    def rejoin(self, method, joined: bool, source: int) -> str:
        """A full-size resume (module function ``rejoin``): give the rejoining ranks (those
        with ``joined``) their parameters; collective. Default: the lowest survivor's."""
        _take_from(method, source, joined)
        return f"rank {source}'s parameters and a fresh optimizer state"


class _Allreduce(_Handler):
    def restore(self, method, ctx, reports, source):
        world = method.comm.world
        world.broadcast_(method.flat.flat, source)          # parameters and buffers
        _source_state(method, world, source, method.optimizer.state_dict,
                      method.optimizer.load_state_dict)

    def shared(self, method):
        return {"flat": method.flat.flat, "optimizer": method.optimizer.state_dict()["state"]}

    def rejoin(self, method, joined, source):
        self.restore(method, None, [], source)          # the replica, optimizer state too
        return f"the replica of rank {source} (parameters and optimizer state)"


class _EASGD(_Handler):
    def restore(self, method, ctx, reports, source):
        rule = method.rule
        method.comm.world.broadcast_(rule.center, source)

    def shared(self, method):
        return {"center": method.rule.center}

    def rejoin(self, method, joined, source):
        if joined:
            method.flat.flat.copy_(method.rule.center)
        return "the centre and a fresh optimizer state"


class _DiLoCo(_Handler):
    def prepare(self, method, ctx, complete):
        rule = method.rule
        if not rule.streaming:
            return None
        rule.progress_failure = None            # (the failure this recovery is about)
        flight = rule._inflight
        rule._inflight = None                   # its request died with the old world
        return {"outer_steps": rule.outer_steps,
                "inflight": None if flight is None else (int(flight[0]), int(flight[1]))}

    def restore(self, method, ctx, reports, source):
        rule = method.rule

        def state():
            outer = ([fr.opt.state_dict() for fr in rule.fragments] if rule.streaming
                     else rule.outer_opt.state_dict())
            return {"prev": rule.prev.data.clone(), "outer": outer,
                    "outer_steps": rule.outer_steps, "norm": rule.last_grad_norm}

        def load(s):
            behind = rule.outer_steps < int(s["outer_steps"])
            missed = range(rule.outer_steps + 1, int(s["outer_steps"]) + 1)
            rule.prev.data.copy_(s["prev"])
            if rule.streaming:
                for fr, o in zip(rule.fragments, s["outer"]):
                    fr.opt.load_state_dict(o)
            else:
                rule.outer_opt.load_state_dict(s["outer"])
            rule.outer_steps = int(s["outer_steps"])
            rule.last_grad_norm = float(s["norm"])
            rule._anchor_pending = False
            if behind and not rule.streaming:
                # the outer step this rank missed: start its inner phase there
                method.flat.flat[:rule.n_params].copy_(rule.prev.data)
            elif behind:
                # the fragments whose outer steps it missed (outer step k syncs fragment
                # (k - 1) mod P): their parameters start again from x_prev_f
                for f in sorted({(k - 1) % rule.P for k in missed}):
                    for a, b in rule.fragments[f].params:
                        method.flat.flat[a:b].copy_(rule.prev.data[a:b])
        _source_state(method, method.comm.world, source, state, load)
        if rule.streaming:
            self._restore_inflight(method, reports, source)

    @staticmethod
    def _restore_inflight(method, reports, source) -> None:
        """Streaming DiLoCo: the fragment allreduce the source had in flight is done again
        over the survivors (each from its saved contribution; one that had not started it
        yet contributes now), and lands at its sync step -- at once when the survivors have
        passed it. None in flight on the source: none anywhere."""
        rule, world = method.rule, method.comm.world
        if rule.stream_comm is not None:           # the allreduces' own communicator, rebuilt
            rule.stream_comm = rule.world.dup()
        key = reports[source]["rule"]["inflight"]
        if key is None:
            return
        f, due = key
        buf = rule.scratch[:rule.fragments[f].size]
        if method._ft_report["rule"]["inflight"] == tuple(key):
            buf.copy_(rule.contribution[:buf.numel()])
        else:
            rule.contribute(f, buf)
        rule.world.allreduce_(buf, "mean")          # (the registered prefix, on every rank)
        rule._inflight = [f, due, None]
        if due <= max(r["steps"] for r in reports):
            rule._sync(f, due)

    def shared(self, method):
        rule = method.rule
        outer = ([fr.opt.state_dict()["state"] for fr in rule.fragments] if rule.streaming
                 else rule.outer_opt.state_dict()["state"])
        return {"prev": rule.prev.data, "outer": outer, "outer_steps": rule.outer_steps}

    def rejoin(self, method, joined, source):
        rule = method.rule
        if joined:            # its inner phase starts at x_prev (buffers: the survivor's)
            method.flat.flat[:rule.n_params].copy_(rule.prev.data)
        return "x_prev (the last outer step's parameters) and a fresh inner optimizer state"


class _SlowMo(_Handler):
    def restore(self, method, ctx, reports, source):
        rule = method.rule

        def state():
            return {"old": rule.old.clone(), "u": rule.u.clone(), "norm": rule.last_u_norm}

        def load(s):
            rule.old.copy_(s["old"])
            rule.u.copy_(s["u"])
            rule.last_u_norm = float(s["norm"])
            rule._anchor_pending = False
        _source_state(method, method.comm.world, source, state, load)

    def shared(self, method):
        return {"old": method.rule.old, "u": method.rule.u}

    def rejoin(self, method, joined, source):
        if joined:
            method.flat.params.copy_(method.rule.old)
        return "x_old (the last slow step's parameters) and a fresh optimizer state"


class _LocalSGD(_Handler):
    _KEYS = ("T", "law", "since_avg", "last_estimate")

    def prepare(self, method, ctx, complete):
        rule = method.rule
        if not complete and rule.since_avg >= rule.T:
            rule.since_avg = 0          # the averaging that was cut off is skipped
        return None

    def restore(self, method, ctx, reports, source):
        rule = method.rule

        def state():
            d = rule.last_decision
            return {**{k: getattr(rule, k) for k in self._KEYS},
                    "decision": (d.law, d.rate, d.r2, d.cost_ratio, d.T, d.reason)}

        def load(s):
            from lsgd_hpc.methods.rules.local_steps import Decision
            for k in self._KEYS:
                setattr(rule, k, s[k])
            rule.last_decision = Decision(*s["decision"])
        _source_state(method, method.comm.world, source, state, load)

    def shared(self, method):
        rule = method.rule
        return {k: getattr(rule, k) for k in self._KEYS}


class _Gossip(_Handler):
    def restore(self, method, ctx, reports, source):
        from lsgd_hpc.topology import build_topology
        rule, world = method.rule, method.comm.world
        name = method.options["topology"]
        n = world.size
        try:
            topo = build_topology(name, n, node_of=method.groups.node_of)
            note = f"topology {name} rebuilt over the {n} survivors"
        except ValueError as exc:
            topo = build_topology("ring", n)
            note = f"topology {name} cannot be built over {n} ranks ({exc}); a ring instead"
        rule.topology = topo
        rule._recv = {}
        if world.rank == 0 and ctx.first_attempt:
            print(f"[lsgd_hpc] warning: GossipSGD: {note}, with its weights for {n} ranks",
                  file=sys.stderr, flush=True)


class _Leader(_Handler):
    """LeaderSGD: the pull cut off by the failure (see the module docstring)."""

    def prepare(self, method, ctx, complete):
        from lsgd_hpc.methods.rules.lsgd import LOCAL
        rule = method.rule
        flight = getattr(rule, "pull_in_flight", None)
        node = method.comm.groups.node_key
        pending = None
        if flight is not None:
            level, is_leader = flight
            pending = (int(level), int(rule.pulls_done[level]),
                       str(node) if level == LOCAL else "", bool(is_leader))
        rule.pull_in_flight = None
        last = rule.last_global
        self_state = {"last_global": None if last is None else
                      (ctx.initial_of(last.world_rank), last.score)}
        method._ft_leader = self_state
        # pull_delay: the broadcasts in flight, as (level, pulls landed before it, node,
        # pull step, this rank holds the whole copy: the broadcast completed or it is the
        # leader); whether one completed is not asked of the broken communicators
        delayed = []
        if rule.pull_delay:
            rule.progress_failure = None        # (the failure this recovery is about)
        for level, (pull_step, request, is_leader) in sorted(getattr(rule, "delayed",
                                                                     {}).items()):
            delayed.append((int(level), int(rule.pulls_done[level]),
                            str(node) if level == LOCAL else "", int(pull_step),
                            bool(request is None or is_leader)))
        return {"pending": pending, "done": {int(k): int(v) for k, v in rule.pulls_done.items()},
                "node": str(node), "delayed": delayed}

    def restore(self, method, ctx, reports, source):
        from lsgd_hpc.comm.base import Election
        from lsgd_hpc.methods.rules.lsgd import GLOBAL, LOCAL
        rule, world = method.rule, method.comm.world
        mine = method._ft_report["rule"]          # updated in place: a rerun sees what was done
        pulls: Dict[tuple, list] = {}
        for r, rep in enumerate(reports):
            p = rep["rule"]["pending"]
            if p is not None:
                pulls.setdefault(p[:3], []).append(r)
        for key in sorted(pulls):
            level, count, node = key
            holders = []
            for r, rep in enumerate(reports):
                rr = rep["rule"]
                if level == LOCAL and rr["node"] != node:
                    continue
                finished = rr["done"].get(level, 0) == count + 1
                is_its_leader = rr["pending"] is not None and rr["pending"][:3] == key \
                    and rr["pending"][3]
                if finished or is_its_leader:
                    holders.append(r)
            in_it = mine["pending"] is not None and mine["pending"][:3] == key
            if holders:
                _broadcast_copy(world, rule.copies[level], min(holders),
                                rule.copies[level] if in_it else None)
                if in_it:
                    if not mine["pending"][3]:
                        rule.apply_pull(level, rule.pull_local if level == LOCAL
                                        else rule.pull_global)
                    rule.pulls_done[level] = count + 1
                    rule.have_copy[level] = True
            elif in_it:
                rule.have_copy[level] = False              # its copy is half a broadcast
            if in_it:
                mine["pending"] = None                       # done, should the restore rerun
                if holders:
                    mine["done"][level] = count + 1
        if rule.pull_delay:
            self._restore_delayed(method, reports)
        last = method._ft_leader["last_global"]
        rule.last_global = None
        if last is not None:
            now = ctx.now_of_initial(last[0])
            if now is not None:                  # a dead leader is never reported again
                rule.last_global = Election(now, now, last[1])
        groups = rule.groups
        rule.multi_level = 1 < groups.n_nodes < groups.world.size
        if rule.pull_delay:           # the delayed broadcasts' own communicators, rebuilt
            rule.delay_node = {GLOBAL: groups.node.dup()}
            if rule.multi_level:
                rule.delay_node[LOCAL] = groups.node.dup()
            rule.delay_roots = groups.roots.dup() if groups.roots is not None else None

    def _restore_delayed(self, method, reports) -> None:
        """pull_delay: each broadcast in flight is completed on every survivor of its group
        (re-broadcast from the lowest that holds the whole copy: it completed, it is the
        leader, or it already pulled it) or dropped on all (nobody holds it: nobody pulls).
        A completed one lands now when its pull step is behind the agreed step, else at it."""
        from lsgd_hpc.methods.rules.lsgd import LOCAL
        rule, world = method.rule, method.comm.world
        mine = method._ft_report["rule"]
        K = max(r["steps"] for r in reports)
        keys = sorted({d[:4] for rep in reports for d in rep["rule"]["delayed"]})
        for level, count, node, pull_step in keys:
            key = (level, count, node, pull_step)
            holders, started, landed, group = [], 0, False, 0
            for r, rep in enumerate(reports):
                rr = rep["rule"]
                if level == LOCAL and rr["node"] != node:
                    continue
                group += 1
                mine_r = [d for d in rr["delayed"] if d[:4] == key]
                landed_r = rr["done"].get(level, 0) == count + 1
                started += bool(mine_r) or landed_r
                landed = landed or landed_r
                if landed_r or (mine_r and mine_r[0][4]):
                    holders.append(r)
            if started < group and not landed:
                # a member whose election of it failed never started it: nobody pulls
                holders = []
            in_it = any(d[:4] == key for d in mine["delayed"])
            if holders:
                root = min(holders)
                # the root's whole copy: the one in flight, or the one it pulled already
                source = rule.incoming[level] if in_it else rule.copies[level]
                _broadcast_copy(world, source, root, rule.incoming[level] if in_it else None)
            if in_it:
                mine["delayed"] = [d for d in mine["delayed"] if d[:4] != key]
                if not holders:
                    rule.delayed.pop(level, None)          # nobody holds it: nobody pulls
                    continue
                rule.delayed[level] = [pull_step, None, False]
                if pull_step <= K:                          # its step is behind: land now
                    rule._land(level)
                mine["done"][level] = rule.pulls_done[level]

    def rejoin(self, method, joined, source):
        """The rejoining ranks take the global leader's parameters (the survivor with the best
        score: the window mean of its last losses, restored from its checkpoint; theirs is
        +inf), which is also their copy of the global leader."""
        from lsgd_hpc.comm.base import Election
        from lsgd_hpc.methods.rules.lsgd import GLOBAL, LOCAL
        rule = method.rule
        leader, el = _to_the_leader(method, joined, source)
        if joined:
            rule.copies[GLOBAL].copy_(method.flat.flat[:rule.copies[GLOBAL].numel()])
            rule.have_copy[GLOBAL], rule.have_copy[LOCAL] = True, False
            if rule.pull_delay:           # a local leader's copy in the survivor's state is
                rule.delayed.pop(LOCAL, None)     # its node's: not necessarily this rank's
        rule.last_global = Election(leader, leader, el.score)
        return f"the global leader's parameters (rank {leader}) and a fresh optimizer state"


class _AsyncLeader(_Handler):
    """AsyncLeaderSGD: nothing is shared but the rounds. Every request in flight died with
    the old communicators: probes are dropped (fresh ones decide again, from the survivors'
    sums: their steps done against their budgets), and the newest round of each level's
    group -- its broadcast cut off, or its probe completed on some members only -- is
    completed on every survivor of the group or on none, like LeaderSGD's pull (re-broadcast
    from the lowest survivor holding the leader's snapshot: the leader itself, or a member
    that pulled it and has nothing newer in flight). A level's communicator is
    rebuilt over the survivors; a node level with one rank left, or with one node left,
    ends. An action decided on some ranks only (a checkpoint, the end) is decided again."""

    def prepare(self, method, ctx, complete):
        rule = method.rule
        levels = {}
        for lv in rule.levels:
            flight = None
            if lv.bcast is not None:
                flight = (lv.rounds + 1, bool(lv.leader.rank == lv.comm.rank))
            levels[int(lv.scope)] = {"rounds": int(lv.rounds), "flight": flight}
            lv.probe = lv.bcast = None              # their requests died with the old world
        rule.action, rule.draining = None, False
        return {"node": str(method.comm.groups.node_key), "levels": levels,
                "checkpoints_done": int(rule.checkpoints_done)}

    def restore(self, method, ctx, reports, source):
        from lsgd_hpc.methods.rules.lsgd import GLOBAL, LOCAL
        rule, world, groups = method.rule, method.comm.world, method.comm.groups
        mine = method._ft_report["rule"]
        by_scope = {lv.scope: lv for lv in rule.levels}
        # each level's groups: the world, and each node's ranks that have a node level
        groups_of = sorted({(scope, rep["rule"]["node"] if scope == LOCAL else "")
                            for rep in reports for scope in rep["rule"]["levels"]})
        for scope, node in groups_of:
            members = [(r, rep["rule"]["levels"][scope]) for r, rep in enumerate(reports)
                       if scope in rep["rule"]["levels"]
                       and (scope == GLOBAL or rep["rule"]["node"] == node)]
            # a round's probe completes only once every member has finished the round before
            # it, so members are at most one round apart: T is the newest round any reached
            T = max(lvr["rounds"] + (lvr["flight"] is not None) for _, lvr in members)
            behind = [r for r, lvr in members if lvr["rounds"] < T]
            if not behind:
                continue
            holders = [r for r, lvr in members
                       if (lvr["rounds"] == T and lvr["flight"] is None)
                       or lvr["flight"] == (T, True)]
            mylv = mine["levels"].get(scope)
            me_in = world.rank in behind and (scope == GLOBAL or mine["node"] == node)
            lv = by_scope.get(scope)
            if holders:
                _broadcast_copy(world, lv.buf if lv is not None else rule.world_level.buf,
                                min(holders), lv.buf if me_in else None)
            if me_in:
                leads = mylv["flight"] == (T, True)
                mylv["flight"] = None                    # done, should the restore rerun
                if holders:
                    if not leads and lv.pull > 0:
                        x = lv.flat.flat
                        x.sub_(x - lv.buf, alpha=lv.pull)     # x <- x - c (x - x_L)
                    lv.rounds = mylv["rounds"] = T
        rule.checkpoints_done = max(r["rule"]["checkpoints_done"] for r in reports)
        rule.last_global = None
        # the levels over the rebuilt groups (each a communicator of its own, as at the start)
        multi_level = 1 < groups.n_nodes < groups.world.size
        node_level = by_scope.get(LOCAL)
        rule.levels = []
        if node_level is not None and multi_level and groups.node.size > 1:
            node_level.comm = groups.node.dup()
            rule.levels.append(node_level)
        rule.world_level.comm = groups.world.dup()
        rule.levels.append(rule.world_level)
        for lv in rule.levels:
            lv.idle = True                     # the next step posts a fresh probe

    def rejoin(self, method, joined, source):
        """As LeaderSGD's: the global leader's parameters (best window score)."""
        from lsgd_hpc.comm.base import Election
        leader, el = _to_the_leader(method, joined, source)
        method.rule.last_global = Election(leader, leader, el.score)
        return f"the global leader's parameters (rank {leader}) and a fresh optimizer state"


_HANDLERS = {"allreduce": _Allreduce(), "easgd": _EASGD(), "diloco": _DiLoCo(),
             "slowmo": _SlowMo(), "local-sgd": _LocalSGD(), "gossip": _Gossip(),
             "lsgd": _Leader(), "lsgd-async": _AsyncLeader()}
