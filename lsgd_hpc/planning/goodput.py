"""Expected goodput of a training job under node failures, per fault-tolerance policy: pure
functions, no MPI, no torch (``python -m lsgd_hpc.plan --mtbf-hours H`` prints them;
docs/planning.md, "Failures and goodput", states the model).

Goodput = useful training time / wall time, where useful time is what the job would take at
full size with no failure and no checkpoint. Failures: every node fails independently, as a
Poisson process of rate 1/theta (theta = the per-node MTBF, ``node_mtbf_s``); a job of N
nodes then fails at rate N/theta (job MTBF M = theta/N) as long as lost nodes are replaced.

* **abort + requeue** (checkpoint/restart; Daly 2006, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", FGCS 22): compute tau seconds, write a checkpoint
  (delta), repeat; a failure loses the work since the last checkpoint, then the job waits
  ``down_s`` (detection, queue: no node held, so no failure can hit it) and restarts for R
  seconds on its nodes (exposed to failures). Expected wall time of tau seconds of work:
  (M + D) e^{R/M} (e^{(tau + delta)/M} - 1) (exact for exponential failures; with D = 0 it is
  Daly's equation), so goodput = tau / [(M + D) e^{R/M} (e^{(tau+delta)/M} - 1)]; to first
  order 1 - delta/tau - (tau/2 + R + D)/M. Intervals: Young's sqrt(2 delta M) and Daly's
  sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18 M)] - delta (M when delta >= 2M).
* **shrink**: the survivors go on without the lost node; nothing is replaced until the job is
  requeued. A failure pauses every survivor for ``shrink_pause_s``; the job runs at capacity
  c(a) with a of its units alive (linear: a/U). Units are data-parallel replicas of
  ``replica_nodes`` nodes (1: pure data parallelism; a node lost takes its replica with it).
  Expected work in a window of W seconds: int_0^W E[c(A_t)] - shrink_pause_s E[(A_t/theta_u)
  c(A_t - 1)] dt, A_t ~ Binomial(U, e^{-t/theta_u}); linear capacity gives the closed form
  theta_u (1 - e^{-W/theta_u}) - P (U-1)/2 (1 - e^{-2W/theta_u}). Either to the end of the job
  (one window), or requeued at full size every H seconds (a checkpoint, the queue and the
  restart each time, no work lost; H chosen to maximise goodput).
* **heal**: as shrink, then a replacement is spawned and joins at a step boundary; each
  failure costs ``shrink_pause_s`` + ``heal_pause_s`` (the join: every rank waits) of the whole
  job, plus ``replacement_s`` x (1 - c(U-1)) (the replica runs short until its replacement
  is ready). With ``spares`` started spare nodes, a failure that finds a spare skips the
  start-up; the pool is refilled only when the job is requeued (every ``requeue_s``; never
  without it): expected cold replacements per window = E[(K - spares)+], K ~ Poisson(f N W /
  theta).

Not every failure can be survived by losing or replacing one node (a software bug, a network
switch): ``survivable`` f is the share that can; shrink and heal see node failures at rate
f/theta, and the others (job MTBF M/(1-f)) end the job as under abort. Shrink and heal
therefore keep a checkpoint schedule, Daly's interval for M/(1-f) (or the one given), and
their work is multiplied by kappa = abort_goodput(that interval, delta, M/(1-f), R, D): the
product of the two loss factors, exact to first order. With f = 1, kappa = 1 (or tau/(tau +
delta) at a given interval). Failures during a restart (abort: counted), a pause or a
start-up (shrink, heal: not counted) are second order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["LLAMA3", "llama3_node_mtbf_hours", "FailureModel", "job_mtbf_s", "young_interval",
           "daly_interval", "abort_goodput", "poisson_excess", "shrink_work",
           "shrink_goodput", "shrink_requeue", "heal_losses", "heal_goodput", "policies",
           "POLICY_ORDER", "with_mtbf"]

HOUR = 3600.0

#: The Llama 3 report (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3.4): 54 days
#: of pre-training on 16,384 H100 GPUs (8 per server) had 466 job interruptions, 419 of them
#: unexpected (about 78 % of those attributed to hardware).
LLAMA3 = {"gpus": 16384, "gpus_per_node": 8, "days": 54, "interruptions": 466,
          "unexpected": 419, "hardware_share": 0.78}


def llama3_node_mtbf_hours() -> float:
    """Per-node MTBF of the Llama 3 report: every unexpected interruption a failure of one of
    the 2048 nodes; job MTBF = 54 x 24 h / 419 = 3.09 h, node MTBF = 2048 x 3.09 h = 6,335 h."""
    nodes = LLAMA3["gpus"] // LLAMA3["gpus_per_node"]
    return nodes * LLAMA3["days"] * 24.0 / LLAMA3["unexpected"]


@dataclass(frozen=True)
class FailureModel:
    """A job and its failure costs, seconds throughout. ``capacity[k]``: the job's work rate
    with k units (replicas) lost, relative to full size (None: linear, 1 - k/U; the benchmark
    passes what it measures). ``checkpoint_interval_s``: the interval shrink and heal keep
    (None: Daly's, the one abort uses)."""

    nodes: int
    node_mtbf_s: float
    checkpoint_s: float
    restart_s: float
    down_s: float = 0.0            # abort: detection + queue wait before the restart
    shrink_pause_s: float = 0.0
    heal_pause_s: float = 0.0
    replacement_s: float = 0.0
    job_s: float = 24 * HOUR       # useful training time at full size
    replica_nodes: int = 1
    spares: int = 0
    requeue_s: float = math.inf    # heal with spares: planned requeue (refills the pool)
    checkpoint_interval_s: Optional[float] = None
    capacity: Optional[Sequence[float]] = None
    floor: int = 0                 # shrink: units that never fail (the benchmark's draw: 1)
    survivable: float = 1.0        # share of failures shrink and heal survive (the rest abort)

    @property
    def units(self) -> int:
        return max(1, self.nodes // self.replica_nodes)

    @property
    def unit_mtbf_s(self) -> float:
        """MTBF of one unit (replica) for the failures shrink and heal survive."""
        if self.survivable <= 0:
            return math.inf
        return self.node_mtbf_s / self.replica_nodes / self.survivable

    @property
    def job_mtbf_s(self) -> float:
        return job_mtbf_s(self.nodes, self.node_mtbf_s)

    @property
    def fatal_mtbf_s(self) -> float:
        """Job MTBF of the failures that end the job whatever the policy."""
        return math.inf if self.survivable >= 1 else self.job_mtbf_s / (1 - self.survivable)

    def cap(self, lost: int) -> float:
        """Capacity with ``lost`` units gone."""
        if self.capacity is None:
            return max(0.0, 1.0 - lost / self.units)
        return float(self.capacity[min(lost, len(self.capacity) - 1)])

    def interval_s(self) -> float:
        """The checkpoint interval shrink and heal keep: given, or Daly's for the failures
        they do not survive (inf when they survive all)."""
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return daly_interval(self.checkpoint_s, self.fatal_mtbf_s)

    def kappa(self) -> float:
        """What shrink and heal keep of their time after their checkpoints and the failures
        they do not survive (checkpoint/restart at ``interval_s``)."""
        return abort_goodput(self.interval_s(), self.checkpoint_s, self.fatal_mtbf_s,
                             self.restart_s, self.down_s)


def job_mtbf_s(nodes: int, node_mtbf_s: float) -> float:
    return node_mtbf_s / nodes


def young_interval(delta: float, mtbf: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly (2006), eq. 37: sqrt(2 delta M) [1 + (delta/2M)^(1/2)/3 + (delta/2M)/9] - delta for
    delta < 2M, else M. Infinite without failures; Young's when delta is 0."""
    if math.isinf(mtbf):
        return math.inf
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def abort_goodput(tau: float, delta: float, mtbf: float, restart_s: float,
                  down_s: float = 0.0) -> float:
    """tau / [(M + D) e^{R/M} (e^{(tau+delta)/M} - 1)]: checkpoint/restart, Daly's expected
    wall time with an unexposed wait D before each restart."""
    if tau <= 0:
        return 0.0
    if math.isinf(mtbf):
        return 1.0 if math.isinf(tau) else tau / (tau + delta)
    if math.isinf(tau):
        return 0.0
    x, r = (tau + delta) / mtbf, restart_s / mtbf
    if x + r > 700:
        return 0.0
    return tau / ((mtbf + down_s) * math.exp(r) * math.expm1(x))


def poisson_excess(mu: float, s: int) -> float:
    """E[(K - s)+] for K ~ Poisson(mu): mu - s + sum_{k<s} (s - k) P(K = k)."""
    if s <= 0:
        return mu
    if mu <= 0:
        return 0.0
    log_p, acc = -mu, 0.0
    for k in range(s):
        acc += (s - k) * math.exp(log_p)
        log_p += math.log(mu) - math.log(k + 1)
    return max(0.0, mu - s + acc)


# -- shrink ----------------------------------------------------------------------------------
def _binomial_pmf(n: int, p: float) -> List[float]:
    if p <= 0.0:
        return [1.0] + [0.0] * n
    if p >= 1.0:
        return [0.0] * n + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma(n + 1)
    return [math.exp(lg - math.lgamma(a + 1) - math.lgamma(n - a + 1) + a * lp + (n - a) * lq)
            for a in range(n + 1)]


def _shrink_rates(m: FailureModel, t: float):
    """(E[c(A_t)], E[failure rate x capacity after]) at time t, A_t alive units (at least
    ``floor``: those never fail)."""
    u, th = m.units, m.unit_mtbf_s
    pmf = _binomial_pmf(u, math.exp(-t / th))
    work = lost = 0.0
    for a, pa in enumerate(pmf):
        if pa == 0.0:
            continue
        alive = max(a, m.floor)
        work += pa * m.cap(u - alive)
        if alive > m.floor:
            lost += pa * (alive / th) * m.cap(u - alive + 1)
    return work, lost


def shrink_work(m: FailureModel, window_s: float, steps: int = 128) -> float:
    """Expected useful work (full-size seconds, before checkpoints) in the first ``window_s``
    wall seconds under shrink: the closed form for linear capacity and no floor, else
    Simpson's rule over the binomial law of the alive units."""
    if window_s <= 0:
        return 0.0
    th, u, pause = m.unit_mtbf_s, m.units, m.shrink_pause_s
    if math.isinf(th):
        return window_s
    if m.capacity is None and m.floor == 0:
        return (th * -math.expm1(-window_s / th)
                - pause * (u - 1) / 2.0 * -math.expm1(-2.0 * window_s / th))
    h = window_s / steps
    total = 0.0
    for i in range(steps + 1):
        w, lost = _shrink_rates(m, i * h)
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * (w - pause * lost)
    return total * h / 3.0


def _solve_wall(work: Callable[[float], float], target: float, hi: float) -> float:
    """Smallest W <= hi with work(W) >= target (work increasing), by bisection; inf when
    work(hi) < target."""
    if work(hi) < target:
        return math.inf
    lo = 0.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if work(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def shrink_goodput(m: FailureModel, window_s: Optional[float] = None) -> float:
    """Shrink to the end of the job (no requeue): job_s / W with kappa x work(W) = job_s; 0
    when the shrinking job can never finish. With ``window_s``: the expected goodput over a
    run of that many wall seconds (kappa x work / window) instead."""
    k = m.kappa()
    if window_s is not None:
        return k * shrink_work(m, window_s) / window_s if window_s > 0 else 0.0
    if math.isinf(m.unit_mtbf_s):
        return k
    hi = m.job_s / k
    while k * shrink_work(m, hi) < m.job_s and hi < 1e4 * m.job_s / k:
        hi *= 2
    wall = _solve_wall(lambda w: k * shrink_work(m, w), m.job_s, hi)
    return 0.0 if math.isinf(wall) else m.job_s / wall


def shrink_requeue(m: FailureModel) -> Dict[str, float]:
    """Shrink, requeued at full size every H wall seconds (checkpoint + down + restart each
    time, nothing lost): goodput kappa work(H) / (H + delta + D + R), H maximised by a
    golden-section search on log H. ``{"goodput", "window_s"}``; window inf when one window to
    the end of the job is better."""
    k, cost = m.kappa(), m.checkpoint_s + m.down_s + m.restart_s
    one = shrink_goodput(m)
    if math.isinf(m.unit_mtbf_s):
        return {"goodput": one, "window_s": math.inf}

    def g(log_h: float) -> float:
        h = math.exp(log_h)
        return k * shrink_work(m, h) / (h + cost)

    lo, hi = math.log(max(cost, 1.0)), math.log(max(m.job_s / max(one, 1e-9), 10.0 * cost, 2.0))
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    ga, gb = g(a), g(b)
    for _ in range(80):
        if ga > gb:
            hi, b, gb = b, a, ga
            a = hi - phi * (hi - lo)
            ga = g(a)
        else:
            lo, a, ga = a, b, gb
            b = lo + phi * (hi - lo)
            gb = g(b)
    best_h = math.exp((lo + hi) / 2)
    best = g(math.log(best_h))
    if best <= one:
        return {"goodput": one, "window_s": math.inf}
    return {"goodput": best, "window_s": best_h}


# -- heal ------------------------------------------------------------------------------------
def heal_losses(m: FailureModel) -> Dict[str, float]:
    """Full-size seconds lost per failure: ``warm`` (a spare takes over: the pauses) and
    ``cold`` (a spawned replacement: the pauses and the start-up at reduced capacity)."""
    warm = m.shrink_pause_s + m.heal_pause_s
    return {"warm": warm, "cold": warm + m.replacement_s * (1.0 - m.cap(1))}


def heal_goodput(m: FailureModel, spares: Optional[int] = None) -> float:
    """Heal: kappa (W - loss(W)) over the wall W, with loss(W) = mu L_warm + E[(K - s)+]
    (L_cold - L_warm), K ~ Poisson(mu), mu = N W / theta. Without spares (or without
    requeue) one window to the end of the job; with spares and ``requeue_s``, windows of that
    length each paying delta + D + R."""
    s = m.spares if spares is None else spares
    k, lam = m.kappa(), m.survivable * m.nodes / m.node_mtbf_s
    loss = heal_losses(m)

    def work(w: float) -> float:
        mu = lam * w
        return w - mu * loss["warm"] - poisson_excess(mu, s) * (loss["cold"] - loss["warm"])

    if s == 0:
        return max(0.0, k * (1.0 - lam * loss["cold"]))
    if not math.isinf(m.requeue_s):
        h = m.requeue_s
        cost = m.checkpoint_s + m.down_s + m.restart_s
        return max(0.0, k * work(h) / (h + cost))
    hi = m.job_s / k
    while k * work(hi) < m.job_s and hi < 1e4 * m.job_s / k:
        hi *= 2
    wall = _solve_wall(lambda w: k * work(w), m.job_s, hi)
    return 0.0 if math.isinf(wall) else m.job_s / wall


# -- every policy ----------------------------------------------------------------------------
POLICY_ORDER = ("abort", "shrink", "shrink+requeue", "heal", "heal+spares")


def policies(m: FailureModel, margin: float = 0.001) -> Dict:
    """Every policy's expected goodput, the checkpoint intervals and the recommendation:
    the policy of highest goodput, where a policy later in POLICY_ORDER (more machinery:
    ULFM, requeues, replacements, spare nodes) must beat an earlier one by more than
    ``margin`` (heal+spares only when ``m.spares``)."""
    mtbf, delta = m.job_mtbf_s, m.checkpoint_s
    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    rows = [{"policy": "abort",
             "goodput": abort_goodput(daly, delta, mtbf, m.restart_s, m.down_s),
             "detail": "checkpoint every Daly interval; requeue at full size"},
            {"policy": "shrink", "goodput": shrink_goodput(m),
             "detail": "survivors go on to the end of the job"}]
    sr = shrink_requeue(m)
    rows.append({"policy": "shrink+requeue", "goodput": sr["goodput"], "window_s":
                 sr["window_s"], "detail": "requeued at full size every window" if
                 not math.isinf(sr["window_s"]) else "no requeue pays: as shrink"})
    rows.append({"policy": "heal", "goodput": heal_goodput(m, spares=0),
                 "detail": "replacements spawned, join after start-up"})
    if m.spares:
        rows.append({"policy": "heal+spares", "goodput": heal_goodput(m),
                     "per_node_hour": heal_goodput(m) * m.nodes / (m.nodes + m.spares),
                     "detail": f"{m.spares} spare node(s), refilled "
                               + ("at each requeue" if not math.isinf(m.requeue_s)
                                  else "never")})
    best = rows[0]
    for r in rows[1:]:                 # more machinery must pay for itself
        if r["goodput"] > best["goodput"] + margin:
            best = r
    return {"job_mtbf_s": mtbf, "young_s": young, "daly_s": daly,
            "goodput_young": abort_goodput(young, delta, mtbf, m.restart_s, m.down_s),
            "kappa": m.kappa(), "failures": m.job_s / mtbf if mtbf > 0 else math.inf,
            "rows": rows, "recommended": best["policy"],
            "losses": heal_losses(m)}


def with_mtbf(m: FailureModel, node_mtbf_s: float) -> FailureModel:
    """The same job at another per-node MTBF."""
    return replace(m, node_mtbf_s=node_mtbf_s)
