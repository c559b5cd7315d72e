"""The averaging plan as a linear program: who aggregates which share of the vector.

Model (docs/planning.md derives it). A round moves two kinds of traffic: every sender ships
each aggregator its part (reduce-scatter), and every aggregator ships its averaged part to
every peer that needs the result (all-gather). The round streams each part's result while its
contributions still arrive, so the two overlap, and a link is busy for its bytes of both. With
the vector normalised to size 1 and peer ``i`` aggregating the fraction ``g_i``, the round
lasts ``T`` with

    upload    s_i (1 - g_i) + (R - r_i) g_i          <= u_i T
    download  (S - s_i) g_i + r_i (1 - g_i)          <= d_i T
    pair i->j s_i g_j + r_j g_i                       <= c_ij T
    sum_i g_i = 1,   g_i = 0 for peers that cannot be dialled

where ``s_i``/``r_i`` say whether peer ``i`` sends a gradient / needs the result, ``S``/``R``
count them, ``u``/``d``/``c`` are upload, download and pairwise rates in vectors per second.
Minimising ``T`` is linear in ``(g, T)`` and solved with HiGHS. Each kind of traffic alone
gives a lower bound too (``reduce_s``, ``gather_s``), which ``T`` always covers. Every function
here is pure and deterministic: the same inputs give the same plan on every machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from dedloc.errors import ConfigError

TIE_BREAK = 1e-4
MIN_RATE = 1e3
"""Bytes/s floor for any rate, so a peer measured at ~0 makes the plan slow, not infeasible."""


@dataclass(frozen=True)
class PlanPeer:
    """One member as the planner sees it."""

    peer_id: str
    upload: float
    """Bytes/s this peer can send."""
    download: float
    """Bytes/s this peer can receive."""
    sends: bool = True
    """Contributes a gradient (weight > 0)."""
    receives: bool = True
    """Needs the averaged result (every trainer does; an aggregator-only helper does not)."""
    can_aggregate: bool = True
    """Accepts inbound streams (not client mode)."""
    samples_per_second: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Shares for a fixed member list, with the model's predicted round time."""

    peer_ids: tuple[str, ...]
    shares: tuple[float, ...]
    predicted_s: float
    """Predicted round time for the planned vector size: the busiest link's bytes over its rate."""
    reduce_s: float
    """The reduce-scatter traffic alone (a lower bound the round time covers)."""
    gather_s: float
    """The all-gather traffic alone."""
    strategy: str
    """What the shares amount to: butterfly, parameter-server, byteps or hybrid."""
    solve_s: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)

    def share_of(self, peer_id: str) -> float:
        return self.shares[self.peer_ids.index(peer_id)]

    def step_time(self, target_batch_size: int, samples_per_second: float, delayed: bool = False) -> tuple[float, float]:
        """(compute seconds, step seconds) of one global step under this plan.

        Compute is ``B / sum(s_i)``; with delayed updates averaging overlaps the next step's
        compute, so a step lasts the longer of the two, otherwise their sum.
        """
        compute = target_batch_size / samples_per_second if samples_per_second > 0 else math.inf
        step = max(compute, self.predicted_s) if delayed else compute + self.predicted_s
        return compute, step


def _rates(peers: Sequence[PlanPeer], nbytes: float) -> tuple[np.ndarray, np.ndarray]:
    up = np.array([max(MIN_RATE, p.upload) for p in peers], dtype=float) / nbytes
    down = np.array([max(MIN_RATE, p.download) for p in peers], dtype=float) / nbytes
    return up, down


def _check(peers: Sequence[PlanPeer], nbytes: float) -> None:
    if not peers:
        raise ConfigError("cannot plan a round with no peers")
    if not any(p.can_aggregate for p in peers):
        raise ConfigError("cannot plan a round in which no peer can aggregate (all are in client mode)")
    if not nbytes > 0:
        raise ConfigError(f"vector size must be > 0 bytes, got {nbytes}")
    for p in peers:
        if not (math.isfinite(p.upload) and math.isfinite(p.download)) or p.upload < 0 or p.download < 0:
            raise ConfigError(f"peer {p.peer_id}: bandwidth must be finite and >= 0 "
                              f"(upload {p.upload}, download {p.download})")


class Prediction(NamedTuple):
    """A partitioned round's predicted seconds (the LP's model)."""

    round_s: float
    reduce_s: float
    """The reduce-scatter traffic alone."""
    gather_s: float
    """The all-gather traffic alone."""


def predict(peers: Sequence[PlanPeer], shares: Sequence[float], nbytes: float,
            pairs: dict[tuple[int, int], float] | None = None) -> Prediction:
    """Predicted times of a partitioned round with these shares."""
    _check(peers, nbytes)
    g = np.asarray(shares, dtype=float)
    g = g / g.sum()
    up, down = _rates(peers, nbytes)
    s = np.array([p.sends for p in peers], dtype=float)
    r = np.array([p.receives for p in peers], dtype=float)
    up1, down1 = s * (1 - g), (s.sum() - s) * g
    up2, down2 = (r.sum() - r) * g, r * (1 - g)
    t1 = max(np.max(up1 / up), np.max(down1 / down))
    t2 = max(np.max(up2 / up), np.max(down2 / down))
    t = max(np.max((up1 + up2) / up), np.max((down1 + down2) / down))
    for (i, j), c in (pairs or {}).items():
        if i == j:
            continue
        c = max(MIN_RATE, c) / nbytes
        first = g[j] / c if peers[i].sends else 0.0
        second = g[i] / c if peers[j].receives else 0.0
        t1, t2, t = max(t1, first), max(t2, second), max(t, first + second)
    return Prediction(float(t), float(t1), float(t2))


def ring_time(peers: Sequence[PlanPeer], nbytes: float) -> float:
    """Predicted time of a ring all-reduce among the peers that need the result.

    ``2(n-1)`` steps, each moving ``1/n`` of the vector over every ring edge at once, so each
    step lasts as long as the slowest edge: ``min(u_i, d_next)``.
    """
    _check(peers, nbytes)
    ring = [p for p in peers if p.receives or p.sends]
    n = len(ring)
    if n < 2:
        return 0.0
    edge = min(min(max(MIN_RATE, a.upload), max(MIN_RATE, b.download)) for a, b in zip(ring, ring[1:] + ring[:1]))
    return 2 * (n - 1) * (nbytes / n) / edge


def classify(peers: Sequence[PlanPeer], shares: Sequence[float], tol: float = 0.02) -> str:
    """Name the strategy a share vector amounts to."""
    total = sum(shares)
    g = [x / total for x in shares]
    active = [i for i, x in enumerate(g) if x > tol / max(1, len(g))]
    eligible = [i for i, p in enumerate(peers) if p.can_aggregate]
    if len(active) == 1 and len(peers) > 2:
        return "parameter-server"
    if active and all(not peers[i].sends for i in active):
        return "byteps"
    if set(active) == set(eligible) and max(g[i] for i in eligible) - min(g[i] for i in eligible) <= tol / len(eligible):
        return "butterfly"
    return "hybrid"


# ---- the canonical strategies, as share vectors -------------------------------------------------
def equal_shares(peers: Sequence[PlanPeer]) -> list[float]:
    """Butterfly all-reduce: every reachable peer aggregates the same share."""
    return [1.0 if p.can_aggregate else 0.0 for p in peers]


def bandwidth_shares(peers: Sequence[PlanPeer]) -> list[float]:
    """Hivemind-style: shares proportional to each reachable peer's bandwidth (min of up and down)."""
    return [max(MIN_RATE, min(p.upload, p.download)) if p.can_aggregate else 0.0 for p in peers]


def server_shares(peers: Sequence[PlanPeer]) -> list[float]:
    """Parameter server: the best-connected reachable peer aggregates everything."""
    best = max((i for i, p in enumerate(peers) if p.can_aggregate),
               key=lambda i: (min(peers[i].upload, peers[i].download), peers[i].peer_id))
    return [1.0 if i == best else 0.0 for i in range(len(peers))]


def byteps_shares(peers: Sequence[PlanPeer]) -> list[float] | None:
    """BytePS: only aggregator-only peers aggregate, in proportion to their bandwidth (None if there are none)."""
    if not any(p.can_aggregate and not p.sends for p in peers):
        return None
    return [max(MIN_RATE, min(p.upload, p.download)) if p.can_aggregate and not p.sends else 0.0 for p in peers]


# ---- the LP --------------------------------------------------------------------------------------
def solve(peers: Sequence[PlanPeer], nbytes: float, pairs: dict[tuple[int, int], float] | None = None,
          min_share: float = 0.01, exclude: frozenset[int] = frozenset()) -> Plan:
    """The shares minimising the predicted round time ``T`` (HiGHS).

    ``pairs[(i, j)]`` is a measured rate from peer ``i`` to peer ``j`` in bytes/s (indices into
    ``peers``); peers in ``exclude`` get share 0. Shares below ``min_share / n`` are dropped and
    the rest renormalised; the reported times are re-predicted after that.
    Raises ConfigError for an impossible input (no reachable peer, negative bandwidth).
    """
    _check(peers, nbytes)
    t0 = time.perf_counter()
    n = len(peers)
    up, down = _rates(peers, nbytes)
    s = np.array([p.sends for p in peers], dtype=float)
    r = np.array([p.receives for p in peers], dtype=float)
    S, R = s.sum(), r.sum()
    T, Z = n, n + 1
    rows, cols, vals, rhs = [], [], [], []

    def row(entries: list[tuple[int, float]], b: float) -> None:
        k = len(rhs)
        for c, v in entries:
            rows.append(k), cols.append(c), vals.append(v)
        rhs.append(b)

    for i in range(n):
        agg = peers[i].can_aggregate
        row([(i, (R - r[i] - s[i]) if agg else 0.0), (T, -up[i])], -s[i])    # s_i (1 - g_i) + (R - r_i) g_i <= u_i T
        row([(i, (S - s[i] - r[i]) if agg else 0.0), (T, -down[i])], -r[i])  # (S - s_i) g_i + r_i (1 - g_i) <= d_i T
    for i in range(n):  # Z >= g_i / min(u_i, d_i): the tie-break below spreads load by bandwidth
        if peers[i].can_aggregate:
            row([(i, 1.0 / min(up[i], down[i])), (Z, -1.0)], 0.0)
    for (i, j), c in (pairs or {}).items():
        if i == j or not (0 <= i < n and 0 <= j < n):
            continue
        c = max(MIN_RATE, c) / nbytes
        entries = [(j, s[i])] if peers[j].can_aggregate else []        # i ships part j to j
        entries += [(i, r[j])] if peers[i].can_aggregate else []       # i ships its averaged part to j
        if any(v for _, v in entries):
            row(entries + [(T, -c)], 0.0)
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(rhs), n + 2)).tocsr()
    a_eq = coo_matrix(([1.0] * n, ([0] * n, list(range(n)))), shape=(1, n + 2)).tocsr()
    bounds = [(0.0, 1.0 if p.can_aggregate and i not in exclude else 0.0) for i, p in enumerate(peers)] \
        + [(0.0, None)] * 2
    cost = np.zeros(n + 2)
    cost[T] = 1.0
    cost[Z] = TIE_BREAK  # among equally fast plans, the one loading peers in proportion to bandwidth
    res = linprog(cost, A_ub=a_ub, b_ub=np.array(rhs), A_eq=a_eq, b_eq=np.array([1.0]), bounds=bounds,
                  method="highs")
    if res.status != 0:  # cannot happen for valid input (the problem is always feasible); fail loudly if it does
        raise ConfigError(f"the averaging LP could not be solved: {res.message}")
    objective = float(res.x[T])
    g = _symmetrize(peers, np.clip(res.x[:n], 0.0, None), pairs, exclude)
    g[g < min_share / n] = 0.0
    if g.sum() <= 0:  # everyone eligible was excluded
        raise ConfigError("cannot plan a round in which every reachable peer is excluded from aggregating")
    g = g / g.sum()
    shares = tuple(float(x) for x in g)
    return Plan(tuple(p.peer_id for p in peers), shares, *predict(peers, g, nbytes, pairs), classify(peers, shares),
                time.perf_counter() - t0, {"lp_objective_s": objective})


def _symmetrize(peers: Sequence[PlanPeer], g: np.ndarray, pairs: dict | None, exclude: frozenset[int]) -> np.ndarray:
    """Give interchangeable peers the mean of their shares.

    The LP is invariant under swapping two peers with identical inputs and its feasible set is
    convex, so averaging an optimum over such swaps is still optimal; it removes the arbitrary
    choice the solver makes between equivalent vertices (plans stay deterministic and even).
    """
    paired = {i for ij in (pairs or {}) for i in ij}
    classes: dict[tuple, list[int]] = {}
    for i, p in enumerate(peers):
        if i not in paired:
            key = (p.upload, p.download, p.sends, p.receives, p.can_aggregate and i not in exclude)
            classes.setdefault(key, []).append(i)
    out = g.copy()
    for idx in classes.values():
        out[idx] = g[idx].mean()
    return out


def plan_with(peers: Sequence[PlanPeer], shares: Sequence[float], nbytes: float,
              pairs: dict[tuple[int, int], float] | None = None) -> Plan:
    """A Plan for given shares (a baseline strategy), with the model's prediction."""
    g = [float(x) / sum(shares) for x in shares]
    return Plan(tuple(p.peer_id for p in peers), tuple(g), *predict(peers, g, nbytes, pairs), classify(peers, g))


def choose(peers: Sequence[PlanPeer], nbytes: float, pairs: dict[tuple[int, int], float] | None = None,
           tolerance: float = 0.05) -> Plan:
    """The simplest plan predicted within ``tolerance`` of the LP's optimum.

    Candidates, simplest first: equal shares (butterfly); the LP re-solved without the peers
    it gave a sliver (under a quarter of an equal share); the LP itself. Each extra aggregator
    costs streams and latency the model does not see, and a plan that jitters with measurement
    noise helps nobody, so a near-tie goes to the simpler plan.
    """
    best = solve(peers, nbytes, pairs)
    limit = (1 + tolerance) * best.predicted_s
    equal = plan_with(peers, equal_shares(peers), nbytes, pairs)
    chosen = best
    if equal.predicted_s <= limit:
        chosen = equal
    else:
        eligible = sum(p.can_aggregate for p in peers)
        slivers = frozenset(i for i, g in enumerate(best.shares) if 0 < g < 0.25 / eligible)
        if slivers:
            pruned = solve(peers, nbytes, pairs, exclude=slivers)
            if pruned.predicted_s <= limit:
                chosen = pruned
    return Plan(chosen.peer_ids, chosen.shares, chosen.predicted_s, chosen.reduce_s, chosen.gather_s, chosen.strategy,
                best.solve_s + (chosen.solve_s if chosen is not best else 0.0),
                {"lp_predicted_s": best.predicted_s})
