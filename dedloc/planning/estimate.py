"""Smoothed link-rate estimates from noisy, one-sided observations.

Every observed transfer rate is a *lower bound* of the link's capacity: the far end, the path
or a competing transfer may have been the bottleneck. So the estimate is a high quantile of a
short window of recent observations: a single slow measurement does not drag it down, a real
drop in capacity shows once most of the window has seen it, and observations older than
``max_age`` are forgotten. A user override, when set, is the estimate.

Two sources are kept apart, and the estimate is the larger of their quantiles:
- *active* probes, aimed at far ends known to be fast, so that our own link is the bottleneck;
- *passive* averaging rounds, where the plan chose the far ends. They are frequent, but a link
  the plan did not load fully (it was not the round's bottleneck) reads low. Pooled with the
  probes, a run of such rounds would talk the estimate down, the plan would then load the link
  even less, and so on; kept apart, they can only raise what the probes show.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RateEstimate:
    """Bytes/s of one direction of one link (or of a peer's whole uplink/downlink)."""

    override: float | None = None
    window: int = 8
    max_age: float = 600.0
    quantile: float = 0.75
    min_bytes: int = 256 << 10
    """Transfers smaller than this say more about latency than bandwidth and are ignored."""
    _active: deque = field(default_factory=deque, repr=False)
    _passive: deque = field(default_factory=deque, repr=False)

    def observe(self, nbytes: float, seconds: float, now: float | None = None, passive: bool = False) -> None:
        """One transfer of ``nbytes`` in ``seconds``: a probe, or (``passive``) an averaging round."""
        if nbytes < self.min_bytes or not seconds > 0:
            return
        samples = self._passive if passive else self._active
        samples.append((time.monotonic() if now is None else now, nbytes / seconds))
        while len(samples) > self.window:
            samples.popleft()

    def _quantile(self, samples: deque, now: float) -> float:
        while samples and now - samples[0][0] > self.max_age:
            samples.popleft()
        if not samples:
            return 0.0
        rates = sorted(r for _, r in samples)
        return rates[min(len(rates) - 1, int(self.quantile * len(rates)))]

    def value(self, now: float | None = None) -> float:
        """The estimate in bytes/s; 0 when nothing recent was observed and there is no override."""
        if self.override is not None:
            return self.override
        now = time.monotonic() if now is None else now
        return max(self._quantile(self._active, now), self._quantile(self._passive, now))


@dataclass
class LinkEstimates:
    """This peer's upload, download and per-peer outgoing rate estimates."""

    upload: RateEstimate
    download: RateEstimate
    pairs: dict[str, RateEstimate] = field(default_factory=dict)
    max_pairs: int = 32

    @classmethod
    def create(cls, upload_override: float | None = None, download_override: float | None = None) -> "LinkEstimates":
        return cls(RateEstimate(upload_override), RateEstimate(download_override))

    def observe_pair(self, peer: str, nbytes: float, seconds: float) -> None:
        if peer not in self.pairs and len(self.pairs) >= self.max_pairs:
            self.pairs.pop(next(iter(self.pairs)))
        self.pairs.setdefault(peer, RateEstimate()).observe(nbytes, seconds)

    def pair_values(self) -> dict[str, float]:
        return {p: v for p, e in self.pairs.items() if (v := e.value()) > 0}
