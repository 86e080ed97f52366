"""A rule's state, declared once, and the exact collectives that move it between ranks.

Every rule serialises its state in one place, ``state_dict`` / ``load_state_dict``, and
declares in ``shared_state`` which of those keys must be identical on every member of its
group (DiLoCo's x_prev and outer optimizer, EASGD's centre, ...); the other keys are the
rank's own (an LSGD worker's window of losses, the copies of its leaders). :data:`REPLICA`
in ``shared_state`` names the replica itself: parameters, buffers and the optimizer's state
(allreduce SGD, whose replicas are bit-identical). What is *in flight* (a pull, a fragment
allreduce, a delayed broadcast) is completed by ``state_dict`` (a checkpoint) and, when a
rank dies, handed over by the rule's two hooks ``suspend`` and ``resume``
(:class:`~lsgd_hpc.methods.rules.base.Rule`).

Checkpoints, the survivors' recovery after lost ranks, the rejoin of lost ranks at a
full-size resume and the check that a group's replicas agree all work from that declaration
(:func:`shared_of`, :func:`take_shared`, :func:`digest`), so a new rule gets them by
declaring its state.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

__all__ = ["REPLICA", "Recovery", "shared_of", "take_shared", "digest", "broadcast_object",
           "broadcast_copy", "take_parameters", "check_agreed"]

#: the name, in a rule's ``shared_state``, of the replica itself: the model's parameters and
#: floating-point buffers and the optimizer's state
REPLICA = "replica"


@dataclass
class Recovery:
    """What a rule's recovery hooks see, after ranks died (``on_failure="shrink"``).

    ``suspend`` gets it with ``world``, ``groups``, ``node_key`` and ``ctx`` set; ``resume``
    also with every survivor's report (what ``suspend`` returned, by new rank), this rank's
    own (``mine``: updated in place, so a second attempt of the recovery sees what the first
    one did), the agreed step and the source (the lowest survivor at it whose communication
    completed)."""

    #: the new world and node groups, exact (whatever the method's comm_dtype)
    world: Any
    groups: Any
    #: this rank's node (its key, stable across recoveries)
    node_key: str
    #: the recovery's numbering (``initial_of``, ``now_of_initial``, ``first_attempt``)
    ctx: Any
    reports: List[Any] = field(default_factory=list)
    mine: Any = None
    steps: int = 0
    source: int = 0


def shared_of(method) -> Dict[str, Any]:
    """The shared state of ``method``'s rule, as its ``shared_state`` declares it."""
    rule = method.rule
    keys = rule.shared_state
    out: Dict[str, Any] = {}
    if any(k != REPLICA for k in keys):
        out.update(rule.shared_state_dict())
    if REPLICA in keys:
        out[REPLICA] = {"flat": method.flat.flat.detach().clone(),
                        "optimizer": method.optimizer.state_dict()}
    return out


def take_shared(method, shared: Dict[str, Any]) -> None:
    """Load another rank's shared state (from :func:`shared_of`) into ``method``; the rule's
    own state stays."""
    replica = shared.get(REPLICA)
    if replica is not None:
        method.flat.flat.copy_(replica["flat"])
        method.optimizer.load_state_dict(replica["optimizer"])
    rest = {k: v for k, v in shared.items() if k != REPLICA}
    if rest:
        method.rule.take_shared(rest)


def digest(obj) -> str:
    """A digest of nested dicts/lists of tensors and scalars (bits of the tensors)."""
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


def _agreed_view(shared: Dict[str, Any]) -> Dict[str, Any]:
    """What must be bit-identical: an optimizer state's tensors, not its hyper-parameters'
    float representation (the param_groups are set by the user's code alike)."""
    out = dict(shared)
    if REPLICA in out:
        out[REPLICA] = {"flat": out[REPLICA]["flat"],
                        "optimizer": out[REPLICA]["optimizer"]["state"]}
    return out


def check_agreed(method, world, when: str) -> None:
    """Collective: RuntimeError on every rank unless the shared state is identical on all."""
    shared = shared_of(method)
    if not shared:
        return
    digests = world.allgather_object(digest(_agreed_view(shared)))
    if len(set(digests)) > 1:
        raise RuntimeError(f"{type(method).__name__}: the shared state differs {when} "
                           f"({len(set(digests))} versions)")


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


def broadcast_copy(world, source: torch.Tensor, root: int, into: Optional[torch.Tensor]) -> None:
    """``source`` of ``root`` into ``into`` (None: not wanted here) on every member, exact,
    through a buffer of its own on every rank: the members then all run the same agreement
    check (a buffer registered with agree_buffers skips it, and which buffer holds what after
    a failure differs from rank to rank)."""
    buf = source.detach().clone() if world.rank == root else torch.empty_like(source)
    world.broadcast_(buf, root)
    if into is not None and world.rank != root:
        into.copy_(buf)


def take_parameters(world, flat, source: int, joined: bool, n: Optional[int] = None) -> None:
    """Collective: the ranks with ``joined`` take the first ``n`` values (all: parameters and
    buffers) of ``source``'s flat vector."""
    buf = flat.flat.detach().clone() if world.rank == source else torch.empty_like(flat.flat)
    world.broadcast_(buf, source)
    if joined:
        flat.flat[:n].copy_(buf[:n])
