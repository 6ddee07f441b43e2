"""Holds a fidelity target on live traffic: moves the ratio the calibration picked for a target
along the calibration's grid, by what the blend audit measures on the requests served.

The calibration (:mod:`blendkv.guards.calibration`) picks, per target, the least ratio whose
90th percentile of divergence met the target on the store's own chunks: the **floor**. Live
prompts may drift more than the calibration's. The audit (:mod:`blendkv.guards.audit`) measures
the same divergence (``AuditRecord.max_kl``, the largest next-token KL(full prefill || blend)
over the answer's first tokens) on a sampled share of requests; each audit of a target's
request comes here (:meth:`FidelityController.observe`). Per target the controller keeps the
divergences audited at its current ratio, a window of the last ``window``, and moves one step
along the **ladder** (the floor, the grid's larger ratios, then 1.0: full prefill)::

    ladder   floor=0.1   0.2   0.3   0.5   1.0
    offset       0        1     2     3     4      the ratio run = ladder[offset]

* up one step when the window holds ``min_audits`` or more and its 90th percentile is above
  the target;
* down one step (never below the floor) when the window is full (``window`` audits) and its
  90th percentile is below ``headroom`` x the target.

After a step the window starts empty, and audits of requests still run at the ratio left are
not counted (audits run when the engine is idle, so they lag): the next step waits for
``min_audits`` (up) or ``window`` (down) audits at the new ratio -- the hysteresis that keeps
it from stepping on its own echo. At 1.0 a target runs as full prefill, which is never audited
(there is nothing to measure): after ``probe_after`` requests there it steps down one, and the
audits at that ratio decide again (the drift may have passed). A drift that stays costs
``min_audits`` audits at the lower ratio per probe.

Pure Python, no tensors: the engine resolves targets through :meth:`ratio_for` and feeds it
audit records; an explicit ``recompute_ratio`` never comes here. A lock guards it: the server
resolves targets on its prepare thread while audits land on the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from blendkv.errors import ConfigError
from blendkv.guards.measure import QUANTILE, quantile

if TYPE_CHECKING:
    from blendkv.guards.audit import AuditRecord

__all__ = ["FidelityController", "TargetControl"]

logger = logging.getLogger(__name__)


class TargetControl(NamedTuple):
    """One target's state, as reported (blend_stats, ``/metrics``).

    Attributes:
        floor: the ratio the calibration picks for the target (the conservative one without).
        ratio: the ratio its requests run at now.
        p90: the 90th percentile of the divergence (nats) audited at the ratio, as of the last
            audit counted (None before the first).
        num_audits: audits in the window now (at ``ratio``).
    """

    floor: float
    ratio: float
    p90: float | None
    num_audits: int


@dataclass
class _Track:
    ladder: tuple[float, ...]  # ascending; ladder[0] is the floor, ladder[-1] is 1.0
    window: deque[float]  # divergences audited at ladder[offset], newest last
    offset: int = 0
    p90: float | None = None
    num_full: int = 0  # requests resolved to full prefill since the last step

    @property
    def ratio(self) -> float:
        return self.ladder[self.offset]


class FidelityController:
    """Per fidelity target, the ratio its requests run at: the calibration's floor plus a number
    of grid steps the audits moved it by.

    Args:
        window: audits per target kept at the current ratio (the high percentile is theirs);
            a step down needs a full window.
        min_audits: audits at the current ratio before a step up may be taken (at most
            ``window``): how fast drift is answered. A step up comes within ``min_audits``
            audits of the drift at each ratio.
        headroom: a step down needs the window's 90th percentile below ``headroom`` x target
            (in [0, 1); 0 never steps down).
        probe_after: requests a target runs as full prefill (unaudited) before it steps down
            one to be audited again.
    """

    def __init__(
        self,
        window: int = 32,
        min_audits: int = 8,
        headroom: float = 0.5,
        probe_after: int = 512,
    ) -> None:
        if window < 1:
            raise ConfigError(f"window must be >= 1 audit, got {window}")
        if not 1 <= min_audits <= window:
            raise ConfigError(f"min_audits must be in [1, window={window}], got {min_audits}")
        if not 0.0 <= headroom < 1.0:
            raise ConfigError(f"headroom must be in [0, 1), got {headroom}")
        if probe_after < 1:
            raise ConfigError(f"probe_after must be >= 1 request, got {probe_after}")
        self.probe_after = probe_after
        self.window = window
        self.min_audits = min_audits
        self.headroom = headroom
        self._tracks: dict[float, _Track] = {}  # by target, nats
        self._lock = threading.Lock()

    def ratio_for(self, target: float, floor: float, grid: tuple[float, ...]) -> float:
        """The ratio to run a request with fidelity target ``target`` (nats) at: ``floor`` (what
        the calibration picks for it) moved along ``grid`` (the calibration's ratios) by the
        audits so far. A new floor or grid (a calibration appeared) starts the target over."""
        assert 0.0 <= floor <= 1.0, floor
        ladder = (floor, *sorted(r for r in set(grid) if floor < r < 1.0))
        ladder = ladder if ladder[-1] >= 1.0 else (*ladder, 1.0)
        with self._lock:
            track = self._tracks.get(target)
            if track is None or track.ladder != ladder:
                track = self._tracks[target] = _Track(ladder, deque(maxlen=self.window))
            if track.ratio >= 1.0 and track.offset > 0:
                track.num_full += 1
                if track.num_full > self.probe_after:
                    self._step(target, track, -1)
            return track.ratio

    def observe(self, record: AuditRecord) -> int:
        """Count one audit of a target-mode request; returns the step taken: +1 (up), -1
        (down) or 0. An audit of a ratio the target has left, or of an unknown target, is
        not counted."""
        with self._lock:
            step = self._observe(record)
        self.check_integrity()
        return step

    def _observe(self, record: AuditRecord) -> int:
        track = self._tracks.get(record.fidelity_target)
        if track is None or record.recompute_ratio != track.ratio:
            return 0
        track.window.append(record.max_kl)
        track.p90 = quantile(list(track.window), QUANTILE)
        step = self._decide(record.fidelity_target, track)
        if step:
            self._step(record.fidelity_target, track, step)
        return step

    def _step(self, target: float, track: _Track, step: int) -> None:
        """Move ``track`` one rung (``step`` is +1 or -1); its window starts over."""
        before = track.ratio
        track.offset += step
        track.window.clear()
        track.num_full = 0
        p90 = "none" if track.p90 is None else f"{track.p90:.3g} nats"
        logger.info(
            "fidelity target %g nats: audited p%.0f divergence %s: recompute ratio %g -> %g",
            target,
            QUANTILE * 100,
            p90,
            before,
            track.ratio,
        )

    def _decide(self, target: float, track: _Track) -> int:
        n, p90 = len(track.window), track.p90
        if n >= self.min_audits and p90 > target and track.offset < len(track.ladder) - 1:
            return 1
        if n >= self.window and p90 < self.headroom * target and track.offset > 0:
            return -1
        return 0

    def state(self) -> dict[float, TargetControl]:
        """Per target seen, its floor, ratio now and audited 90th percentile."""
        with self._lock:
            return {
                target: TargetControl(t.ladder[0], t.ratio, t.p90, len(t.window))
                for target, t in self._tracks.items()
            }

    def check_integrity(self) -> None:
        with self._lock:
            for track in self._tracks.values():
                assert 0 <= track.offset < len(track.ladder), (track.offset, track.ladder)
                assert list(track.ladder) == sorted(set(track.ladder)), track.ladder
                assert track.ladder[-1] == 1.0 and 0.0 <= track.ladder[0], track.ladder
                assert len(track.window) <= self.window
