"""Which parts of a rank's checkpoint state its group shares, and how the state is split into
the rank's own part and the shared parts (and joined again).

A training method declares what is identical on the ranks of a group (each rule's
``shared_state``, lsgd_hpc/methods/rules/state.py): ``REPLICA`` for the model's parameters and
buffers with the optimizer's state (allreduce SGD: every rank of the job), the rule's own
shared keys (DiLoCo's x_prev and outer optimizer, EASGD's centre, SlowMo's x_old and u, local
SGD's period state: every rank of the job), and, when workers span ranks
(lsgd_hpc/comm/workers.py), the replica of each worker (model and optimizer: the worker's
ranks). :func:`shared_parts` reads those declarations from the objects a
:class:`~lsgd_hpc.runtime.checkpoint.Checkpointer` names; a checkpoint then writes each
group's part once (:func:`split_state`) and every rank's own state apart.

The runtime layer sits below the methods (the methods import it), so the declarations are
read by attribute here: a *method* is a named object with ``rule``, ``model`` and
``optimizer`` (``lsgd_hpc.Method``); a rule that wraps another between workers
(``WorkerRule``) holds it as ``rule`` and the workers as the method's ``workers``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["REPLICA", "WORLD", "shared_parts", "split_state", "join_state", "host_copy",
           "part_key"]

#: ``lsgd_hpc.methods.rules.state.REPLICA``: in a rule's ``shared_state``, the replica itself
REPLICA = "replica"
#: the group of every rank of the job
WORLD = "world"

Part = Tuple[str, Tuple[str, ...]]


def _is_method(obj) -> bool:
    return all(hasattr(obj, a) for a in ("rule", "model", "optimizer", "state_dict"))


def shared_parts(objects: Dict[str, object]) -> List[Part]:
    """``(group, path)`` of every part of this rank's state that its group holds alike;
    ``path`` leads from the checkpoint's ``objects`` to the part (an object's name, then keys
    of its ``state_dict``). ``group`` is ``"world"`` (every rank) or ``"workerI"`` (the ranks of
    worker I). The same on every rank of a group: it depends on the declarations and the
    layout only."""
    parts: List[Part] = []
    for name, obj in objects.items():
        if not _is_method(obj):
            continue
        workers = getattr(obj, "workers", None)
        inner, prefix = ((obj.rule.rule, ("rule", "rule")) if workers is not None
                         else (obj.rule, ("rule",)))
        declared = tuple(getattr(inner, "shared_state", ()))
        replica = [n for n, o in objects.items() if o is obj.model or o is obj.optimizer]
        if REPLICA in declared:
            parts += [(WORLD, (n,)) for n in replica]
        elif workers is not None and workers.size > 1:
            parts += [(f"worker{workers.index}", (n,)) for n in replica]
        parts += [(WORLD, (name, *prefix, k)) for k in declared if k != REPLICA]
    seen, out = set(), []
    for p in parts:
        if p[1] not in seen:
            seen.add(p[1])
            out.append(p)
    return out


def part_key(path: Sequence) -> str:
    """A part's name in its shared file (``method/rule/prev``)."""
    return "/".join(str(k) for k in path)


def split_state(state: dict, parts: Sequence[Part], groups: Sequence[str]):
    """Take the parts of ``groups`` out of ``state`` (in place): returns ``(state, shared)``,
    ``shared[group][part_key]`` the parts taken; ``state["shared_parts"]`` lists them as
    ``[group, path]`` so that :func:`join_state` puts them back. A part the state does not
    hold (a key this rule's ``state_dict`` leaves out) stays where it is."""
    wanted = set(groups)
    shared: Dict[str, dict] = {}
    refs = []
    for group, path in sorted(parts, key=lambda p: -len(p[1])):     # the deepest first
        if group not in wanted:
            continue
        parent = state["objects"]
        for k in path[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
            if parent is None:
                break
        if not isinstance(parent, dict) or path[-1] not in parent:
            continue
        shared.setdefault(group, {})[part_key(path)] = parent.pop(path[-1])
        refs.append([group, list(path)])
    state["shared_parts"] = refs
    return state, shared


def join_state(state: dict, shared: Dict[str, dict]) -> dict:
    """Put the shared parts (``shared[group]``: a group's shared file) back into a rank's own
    state (from :func:`split_state`), in place; returns it."""
    refs = state.pop("shared_parts", None) or []
    for group, path in sorted(refs, key=lambda r: len(r[1])):        # the shallowest first
        parent = state["objects"]
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = shared[group][part_key(path)]
    return state


def host_copy(obj, pool: Optional[dict] = None, path: tuple = ()):
    """A copy of nested dicts/lists of tensors and values that shares nothing with the live
    objects: every tensor copied to host memory (compact: a view copies its elements only),
    dicts keep their type and a state_dict's ``_metadata``. ``pool``: the host buffers of the
    previous copy by their place in the state, written again when shape and dtype still fit
    (fresh pages cost more than the copy); the caller must no longer need that copy. A GPU
    tensor's buffer is pinned."""
    if isinstance(obj, torch.Tensor):
        return _tensor_copy(obj, pool, path)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = host_copy(v, pool, path + (k,))
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = copy.deepcopy(meta)
        return out
    if isinstance(obj, list):
        return [host_copy(v, pool, path + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(host_copy(v, pool, path + (i,)) for i, v in enumerate(obj))
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return copy.deepcopy(obj)


def _tensor_copy(t: torch.Tensor, pool: Optional[dict], path: tuple) -> torch.Tensor:
    t = t.detach()
    if pool is None or t.layout != torch.strided or not t.is_contiguous():
        return t.to("cpu", copy=True)
    buf = pool.get(path)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = pool[path] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return buf.copy_(t)
