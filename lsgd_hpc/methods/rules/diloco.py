"""DiLoCo and Streaming DiLoCo: local SGD whose averaged displacement is the gradient of an
outer optimizer, for the whole model at once or fragment by fragment."""

from __future__ import annotations

import bisect
import copy
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.comm.failures import is_process_failure
from lsgd_hpc.methods.rules.base import Rule, MetricsSink

__all__ = ["DiLoCoRule", "split_tensors", "fragment_tensors"]

Fragments = Union[int, Sequence[nn.Module]]


def split_tensors(sizes: Sequence[int], parts: int) -> List[range]:
    """Tensor indices 0..len(sizes)-1 in ``parts`` contiguous, non-empty groups of whole
    tensors whose total sizes are as near equal as whole tensors allow: the k-th boundary is
    the tensor boundary nearest to k/parts of the total (ties: the earlier one)."""
    count = len(sizes)
    if not 1 <= parts <= count:
        raise ValueError(f"cannot split {count} tensors into {parts} non-empty fragments")
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + int(s))
    bounds = [0]
    for k in range(1, parts):
        target = cum[-1] * k / parts
        lo, hi = bounds[-1] + 1, count - (parts - k)        # leave one tensor per fragment left
        i = min(max(bisect.bisect_left(cum, target), lo), hi)
        if i - 1 >= lo and abs(cum[i - 1] - target) <= abs(cum[i] - target):
            i -= 1
        bounds.append(i)
    bounds.append(count)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def fragment_tensors(model: nn.Module, fragments: Fragments) -> List[List[int]]:
    """The parameter indices (in ``model.parameters()`` order) of each fragment.

    ``fragments``: an int P (the parameters in model order, :func:`split_tensors`), or a list
    of submodules, one per fragment (torchft's ``model_fragments``; group several modules in
    one fragment with ``nn.ModuleList``): every parameter of the model must belong to exactly
    one fragment. ValueError otherwise, naming the parameter.
    """
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    if isinstance(fragments, int):
        if fragments > len(params):
            raise ValueError(f"fragments is {fragments} but the model has {len(params)} "
                             "parameter tensors (a fragment holds whole tensors)")
        return [list(r) for r in split_tensors([p.numel() for p in params], fragments)]
    index = {id(p): i for i, p in enumerate(params)}
    owner: List[Optional[int]] = [None] * len(params)
    for f, module in enumerate(fragments):
        mine = list(module.parameters())
        if not mine:
            raise ValueError(f"fragment {f} ({type(module).__name__}) has no parameters")
        for p in mine:
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"fragment {f} holds a tensor of shape {tuple(p.shape)} that is "
                                 "not a parameter of the model")
            if owner[i] is not None:
                raise ValueError(f"parameter {names[i]} is in fragments {owner[i]} and {f}; "
                                 "every parameter must belong to exactly one fragment")
            owner[i] = f
    missing = [names[i] for i, o in enumerate(owner) if o is None]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"parameter(s) {', '.join(missing[:3])}{more} belong to no fragment; "
                         "every parameter must belong to exactly one fragment")
    return [[i for i, o in enumerate(owner) if o == f] for f in range(len(fragments))]


def _runs(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """(offset, length) spans merged into maximal contiguous [start, stop) runs, in order."""
    out: List[Tuple[int, int]] = []
    for off, n in sorted(spans):
        if out and out[-1][1] == off:
            out[-1] = (out[-1][0], off + n)
        else:
            out.append((off, off + n))
    return out


class _Fragment:
    """One fragment: its runs of the flat buffer, its outer parameters and optimizer."""

    def __init__(self, params: List[Tuple[int, int]], buffers: List[Tuple[int, int]]):
        self.params, self.buffers = params, buffers
        self.n_params = sum(b - a for a, b in params)
        self.size = self.n_params + sum(b - a for a, b in buffers)
        self.outer: List[torch.nn.Parameter] = []
        self.opt: Optional[torch.optim.Optimizer] = None


class _Both:
    """Two requests in flight as one (top-k DiLoCo's records and its dense buffers)."""

    def __init__(self, first, second):
        self.parts = (first, second)

    def test(self) -> bool:
        done = [r.test() for r in self.parts]         # (progress both)
        return all(done)

    def wait(self):
        for r in self.parts:
            r.wait()


class DiLoCoRule(Rule):
    """DiLoCo (Douillard et al. 2023; as in torchft's DiLoCo and OpenDiLoCo) and Streaming
    DiLoCo (Douillard et al. 2025; torchft's DiLoCo with fragments).

    Inner loop: every worker takes ``local_steps`` (H) steps of its own optimizer, whose state
    stays local. Outer step at every step s with s mod H = 0, with x_prev the parameters after
    the last outer step (x_0 at the start):

        delta  = (1/p) sum_i (x_prev - x_i)       one allreduce of the pseudo-gradient
        x      <- x_prev;  outer SGD step on x with gradient delta;  x_prev <- x

    The outer optimizer is torch's SGD with ``outer_lr``, ``outer_momentum`` and
    ``outer_nesterov`` (DiLoCo's 0.7, 0.9, Nesterov; Nesterov with momentum 0 is plain SGD,
    so ``outer_nesterov`` is ignored then). With outer lr 1 and momentum 0 this is
    local SGD with T = H, up to rounding (x_prev - mean(x_prev - x_i) against mean(x_i)).
    The floating-point buffers after the parameters (BatchNorm running statistics) are not
    trained: they are averaged at the outer step, in the same allreduce as delta.
    x_prev and the outer momentum buffer are in ``state_dict``. ``optimizer`` (the inner one)
    is accepted for a uniform constructor and not used.

    Top-k (the world's ``topk`` F < 1: its allreduces send each chunk's top-k records,
    lsgd_hpc.comm.sparse): the pseudo-gradient goes as records and the buffers dense, two
    allreduces in the same round, the buffers' on the communicator under the wire layer
    (exact float32):

        delta  = (1/p) sum_i C(x_prev - x_i (+ e_i))      top-k records (residuals e_i:
                                                          with ``error_feedback``)
        b      = (1/p) sum_i b_i                          dense

    Every rank adds the same records in the same order, so delta, x_prev and the buffers
    have the same bits on every rank, as in dense DiLoCo: x_prev is the reference the
    records are taken against, no other is kept. A model without buffers: one allreduce,
    as before. The bytes of an outer step: S(n) records sent, (p - 1) S(n) received (S:
    :func:`lsgd_hpc.comm.sparse.payload_bytes`), plus 4 m each way for m buffer elements.
    Streaming: the same split of each fragment's message (both non-blocking with tau >= 1).

    Streaming (``fragments`` P, ``fragment_sync_delay`` tau, ``fragment_update_alpha``
    alpha): the parameters are split into P fragments (:func:`fragment_tensors`); with
    k = H / P, fragment f = (s/k - 1) mod P syncs at every step s with s mod k = 0
    (round-robin, fragment 0 first), each with an outer optimizer of its own, so its
    momentum moves only at its syncs. At step s - tau:

        delta_f = x_prev_f - x_f                  its allreduce starts, not waited for

    and at step s, with local_f the fragment's parameters now:

        wait for mean_i delta_f;  x_f <- x_prev_f;  outer step on x_f with it;  x_prev_f <- x_f
        x_f <- lerp(x_f, local_f, alpha) = x_f + alpha (local_f - x_f)

    The allreduce is non-blocking on a communicator of its own (tau >= 1; with tau = 0 it is
    waited for at once, so the blocking one is used). A floating-point buffer belongs to the
    fragment of the first parameter of the module that holds it (the last fragment when that
    module has no parameters of its own): its value at step s - tau is averaged with that
    fragment's delta (one message) and mixed like the parameters at s,
    b <- lerp(mean_i b, local b, alpha). ``outer_steps`` counts fragment syncs;
    ``/train/outer_grad_norm`` is ||delta_f|| of the last synced fragment. P = 1, tau = 0,
    alpha = 0 is DiLoCo above, through the same code. ``state_dict`` completes an allreduce
    in flight and keeps its result for the sync that uses it: the mean does not depend on
    when it is waited for, so a resumed run continues bit for bit.
    """

    name = "diloco"
    extra_columns = {"train": {"outer_grad_norm": "f8"}}
    #: every worker's x_prev and outer optimizer(s) are the same (a streaming allreduce in
    #: flight is completed by state_dict, and redone by the survivors of a failure)
    shared_state = ("prev", "outer", "outer_steps", "outer_grad_norm")

    def __init__(self, groups: NodeGroups, flat: FlatParams, local_steps: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 log: Optional[MetricsSink] = None, fragments: Fragments = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0):
        super().__init__(groups, flat, log)
        self.H = local_steps
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.outer_nesterov = bool(outer_nesterov)
        n = flat.n_params
        #: top-k on the world: the pseudo-gradient as records, the buffers dense (beside)
        self.sparse = float(getattr(self.world, "topk", 1.0)) < 1
        # x_prev as a parameter of the outer optimizer; its .grad receives delta
        self.prev = torch.nn.Parameter(flat.params.detach().clone(), requires_grad=False)
        self.prev.grad = torch.zeros_like(self.prev)
        self.n_params = n
        #: x_prev is taken again before the first step: the trainer broadcasts x_0 after
        #: building the method (a resumed run loads it from the checkpoint instead)
        self._anchor_pending = True
        self.outer_steps = 0
        self.last_grad_norm = math.nan
        self.streaming = not isinstance(fragments, int) or fragments > 1 \
            or fragment_sync_delay > 0 or fragment_update_alpha > 0
        if not self.streaming:
            self.outer_opt = self._outer_optimizer([self.prev])
            # [delta | buffers]: one allreduce per outer step
            self.scratch = torch.empty_like(flat.flat)
            self.world.agree_buffers(self.scratch, *self._split(self.scratch, n))
            return
        self.delay, self.alpha = int(fragment_sync_delay), float(fragment_update_alpha)
        self.fragments = self._build_fragments(fragment_tensors(flat.model, fragments))
        self.P = len(self.fragments)
        self.period = self.H // self.P
        biggest = max(fr.size for fr in self.fragments)
        self.scratch = torch.empty(biggest, dtype=flat.flat.dtype, device=flat.flat.device)
        self.local = torch.empty_like(self.scratch) if self.alpha > 0 else None
        # each fragment's message is a prefix of scratch (one fragment in flight at a time)
        self.world.agree_buffers(*{fr.size: self.scratch[:fr.size]
                                   for fr in self.fragments}.values())
        self.world.agree_buffers(*{(fr.n_params, fr.size, i): t for fr in self.fragments
                                   for i, t in enumerate(self._split(self.scratch[:fr.size],
                                                                     fr.n_params))}.values())
        #: the fragment allreduces' own communicator: in flight across steps, they never
        #: interleave with blocking collectives (tau = 0 needs none)
        self.stream_comm = self.world.dup() if self.delay > 0 else None
        #: [fragment, sync step, request or None (completed)] of the allreduce in flight
        self._inflight: Optional[list] = None
        #: a copy of this rank's contribution to the allreduce in flight, which the
        #: survivors of a failure redo (on_failure="shrink")
        self.contribution = torch.empty_like(self.scratch)
        #: a rank failure that progress() met in a gradient hook (raised in the next step)
        self.progress_failure: Optional[BaseException] = None

    def _split(self, buf: torch.Tensor, n: int) -> Tuple[torch.Tensor, ...]:
        """The parts of a message ``buf`` = [delta (n) | buffers] that go apart: top-k with
        buffers, (records, dense); else none (one allreduce of ``buf``)."""
        if not self.sparse or n == buf.numel():
            return ()
        return buf[:n], buf[n:]

    def _mean(self, buf: torch.Tensor, n: int) -> None:
        """buf <- the mean over the ranks of [delta (n) | buffers]: one allreduce; top-k
        with buffers, delta's records and the buffers dense (the communicator under the wire
        layer: exact float32)."""
        parts = self._split(buf, n)
        if not parts:
            self.world.allreduce_(buf, "mean")
            return
        self.world.allreduce_(parts[0], "mean")
        getattr(self.world, "inner", self.world).allreduce_(parts[1], "mean")

    def _imean(self, comm, buf: torch.Tensor, n: int):
        """:meth:`_mean` non-blocking on ``comm`` (one request; two in flight with top-k and
        buffers, posted in the same order on every rank)."""
        parts = self._split(buf, n)
        if not parts:
            return comm.iallreduce_(buf, "mean", agreed=True)
        return _Both(comm.iallreduce_(parts[0], "mean", agreed=True),
                     getattr(comm, "inner", comm).iallreduce_(parts[1], "mean", agreed=True))

    def _outer_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum,
                               nesterov=self.outer_nesterov and self.outer_momentum > 0)

    def _build_fragments(self, groups_of_tensors: List[List[int]]) -> List[_Fragment]:
        model, slices = self.flat.model, self.flat.slices
        n_tensors = len(list(model.parameters()))
        frag_of = {}
        for f, idx in enumerate(groups_of_tensors):
            for i in idx:
                frag_of[i] = f
        index = {id(p): i for i, p in enumerate(model.parameters())}
        buffer_spans: List[List[Tuple[int, int]]] = [[] for _ in groups_of_tensors]
        for name, off, n in slices[n_tensors:]:
            holder = model.get_submodule(name.rpartition(".")[0])
            own = list(holder.parameters(recurse=False))
            f = frag_of[index[id(own[0])]] if own else len(groups_of_tensors) - 1
            buffer_spans[f].append((off, n))
        out = []
        for f, idx in enumerate(groups_of_tensors):
            fr = _Fragment(_runs([slices[i][1:] for i in idx]), _runs(buffer_spans[f]))
            for a, b in fr.params:            # views of x_prev and of its gradient
                p = torch.nn.Parameter(self.prev.data[a:b], requires_grad=False)
                p.grad = self.prev.grad[a:b]
                fr.outer.append(p)
            fr.opt = self._outer_optimizer(fr.outer)
            out.append(fr)
        return out

    def before_step(self, step: int) -> None:
        if self._anchor_pending:
            self.prev.data.copy_(self.flat.params)
            self._anchor_pending = False

    def after_step(self, step: int, loss: float) -> None:
        if self.streaming:
            self._stream_step(step)
            return
        if step % self.H:
            return
        self._anchor_pending = False
        n, x, buf = self.n_params, self.flat.flat, self.scratch
        torch.sub(self.prev.data, x[:n], out=buf[:n])          # x_prev - x_i
        buf[n:].copy_(x[n:])                                   # BatchNorm statistics
        self._mean(buf, n)
        self.prev.grad.copy_(buf[:n])                          # delta
        self.outer_opt.step()                                  # x_prev <- outer step
        x[:n].copy_(self.prev.data)
        x[n:].copy_(buf[n:])
        self.outer_steps += 1
        self.last_grad_norm = float(buf[:n].double().norm())

    # -- Streaming DiLoCo ------------------------------------------------------------------
    @property
    def overlaps(self) -> bool:
        return self.streaming and self.stream_comm is not None

    def progress(self) -> None:
        try:
            if self._inflight is not None and self._inflight[2] is not None:
                self._inflight[2].test()
        except Exception as exc:                  # noqa: BLE001
            # (from a gradient hook, outside the method's step: raised again inside the
            # next step, where the recovery runs)
            if not is_process_failure(exc):
                raise
            self.progress_failure = exc

    def fragment_at(self, sync_step: int) -> int:
        """The fragment that syncs at ``sync_step`` (a multiple of H / P)."""
        return (sync_step // self.period - 1) % self.P

    def _stream_step(self, step: int) -> None:
        self._anchor_pending = False
        if self.progress_failure is not None:
            exc, self.progress_failure = self.progress_failure, None
            raise exc
        if self._inflight is not None and self._inflight[2] is not None:
            self._inflight[2].test()                     # let MPI progress it
        if (step + self.delay) % self.period == 0:
            self._start(self.fragment_at(step + self.delay), step + self.delay)
        if step % self.period == 0:
            self._sync(self.fragment_at(step), step)

    def contribute(self, f: int, buf: torch.Tensor) -> None:
        """This rank's message of fragment ``f`` into ``buf``: x_prev_f - x_f, then the
        fragment's buffers (BatchNorm statistics)."""
        fr, x = self.fragments[f], self.flat.flat
        o = 0
        for a, b in fr.params:
            torch.sub(self.prev.data[a:b], x[a:b], out=buf[o:o + b - a])   # x_prev_f - x_f
            o += b - a
        for a, b in fr.buffers:
            buf[o:o + b - a].copy_(x[a:b])
            o += b - a

    def _start(self, f: int, sync_step: int) -> None:
        fr = self.fragments[f]
        buf = self.scratch[:fr.size]
        self.contribute(f, buf)
        self.contribution[:buf.numel()].copy_(buf)
        if self.stream_comm is None:
            self._inflight = [f, sync_step, None]        # (in flight while it runs)
            self._mean(buf, fr.n_params)
        else:
            self._inflight = [f, sync_step, self._imean(self.stream_comm, buf, fr.n_params)]

    def _sync(self, f: int, step: int) -> None:
        got, due, request = self._inflight
        assert (got, due) == (f, step), f"fragment {got} due at {due} in flight at {step}"
        if request is not None:
            request.wait()
        self._inflight = None
        fr, x = self.fragments[f], self.flat.flat
        buf = self.scratch[:fr.size]
        if self.alpha > 0:                                  # local_f, before it is replaced
            o = 0
            for a, b in fr.params + fr.buffers:
                self.local[o:o + b - a].copy_(x[a:b])
                o += b - a
        o = 0
        for (a, b), p in zip(fr.params, fr.outer):
            p.grad.copy_(buf[o:o + b - a])                  # mean_i delta_f
            o += b - a
        fr.opt.step()                                       # x_prev_f <- outer step
        o = 0
        for a, b in fr.params:
            x[a:b].copy_(self.prev.data[a:b])
            o += b - a
        for a, b in fr.buffers:
            x[a:b].copy_(buf[o:o + b - a])                  # the buffers' mean
            o += b - a
        if self.alpha > 0:                                  # lerp(x_f, local_f, alpha)
            o = 0
            for a, b in fr.params + fr.buffers:
                x[a:b].lerp_(self.local[o:o + b - a], self.alpha)
                o += b - a
        self.outer_steps += 1
        self.last_grad_norm = float(buf[:fr.n_params].double().norm())

    def drain(self) -> None:
        """Complete the allreduce in flight (its result waits for its sync step)."""
        if self.streaming and self._inflight is not None and self._inflight[2] is not None:
            self._inflight[2].wait()
            self._inflight[2] = None

    def train_columns(self):
        return {"outer_grad_norm": self.last_grad_norm}

    def state_dict(self) -> dict:
        # a copy: the optimizer's own state_dict holds its live momentum buffer
        state = {"prev": self.prev.data.clone(), "outer_steps": self.outer_steps,
                 "outer_grad_norm": self.last_grad_norm}
        if not self.streaming:
            state["outer"] = copy.deepcopy(self.outer_opt.state_dict())
            return state
        self.drain()
        state["outer"] = [copy.deepcopy(fr.opt.state_dict()) for fr in self.fragments]
        if self._inflight is not None:
            f, due, _ = self._inflight
            state["inflight"] = {"fragment": f, "sync_step": due,
                                 "mean": self.scratch[:self.fragments[f].size].clone()}
        return state

    def load_state_dict(self, state: dict) -> None:
        outer = state["outer"]
        if self.streaming != isinstance(outer, list) or (
                self.streaming and len(outer) != self.P):
            raise ValueError("DiLoCo state of another fragment layout: "
                             f"{len(outer) if isinstance(outer, list) else 1} fragment(s) saved, "
                             f"{self.P if self.streaming else 1} here")
        self.prev.data.copy_(state["prev"])
        if self.streaming:
            for fr, s in zip(self.fragments, outer):
                fr.opt.load_state_dict(copy.deepcopy(s))
            self._inflight = None
            if "inflight" in state:
                got = state["inflight"]
                f = int(got["fragment"])
                self.scratch[:self.fragments[f].size].copy_(got["mean"])
                self._inflight = [f, int(got["sync_step"]), None]
        else:
            self.outer_opt.load_state_dict(copy.deepcopy(outer))
        self.outer_steps = int(state.get("outer_steps", 0))
        self.last_grad_norm = float(state.get("outer_grad_norm", math.nan))
        self._anchor_pending = False

    # -- ranks lost: a survivor behind the outer steps, the streaming allreduce in flight ---------
    def take_shared(self, shared: dict) -> None:
        """A survivor that missed outer steps of the source restarts the inner phase of
        what they synced from x_prev (all of it; Streaming: the fragments they synced, outer
        step k syncing fragment (k - 1) mod P)."""
        missed = range(self.outer_steps + 1, int(shared["outer_steps"]) + 1)
        super().take_shared(shared)
        x = self.flat.flat
        if missed and not self.streaming:
            x[:self.n_params].copy_(self.prev.data)
        elif missed:
            for f in sorted({(k - 1) % self.P for k in missed}):
                for a, b in self.fragments[f].params:
                    x[a:b].copy_(self.prev.data[a:b])

    def suspend(self, complete: bool, recovery):
        if not self.streaming:
            return None
        self.progress_failure = None            # (the failure this recovery is about)
        flight, self._inflight = self._inflight, None     # its request died with the world
        return {"inflight": None if flight is None else (int(flight[0]), int(flight[1]))}

    def resume(self, recovery) -> None:
        """Streaming: the fragment allreduce the source had in flight is done again over
        the survivors (each from its saved contribution; one that had not started it yet
        contributes now), and lands at its sync step -- at once when the survivors have
        passed it. None in flight on the source: none anywhere."""
        if not self.streaming:
            return
        if self.stream_comm is not None:           # the allreduces' own communicator, rebuilt
            self.stream_comm = self.world.dup()
        key = recovery.reports[recovery.source]["inflight"]
        if key is None:
            return
        f, due = key
        buf = self.scratch[:self.fragments[f].size]
        if recovery.mine["inflight"] == tuple(key):
            buf.copy_(self.contribution[:buf.numel()])
        else:
            self.contribute(f, buf)
        self._mean(buf, self.fragments[f].n_params)   # (registered parts, on every rank)
        self._inflight = [f, due, None]
        if due <= recovery.steps:
            self._sync(f, due)

    def rejoin(self, world, joined: bool, source: int) -> str:
        if joined:            # its inner phase starts at x_prev (buffers: the survivor's)
            self.flat.flat[:self.n_params].copy_(self.prev.data)
        return "x_prev (the last outer step's parameters) and a fresh inner optimizer state"
