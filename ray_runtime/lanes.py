"""Micro-batch lanes at PP>1 with token feedback: which lane the next step plans, and how
many requests a lane admits. The Scheduler (ray_runtime/scheduler.py) asks; the rules live
here.

- Turns. The lanes take turns, and a lane whose turn it is but has nothing to run is
  skipped. Rank 0 runs plans in order, so a lane's step right behind its own previous step
  would hold rank 0 for a whole round trip of the pipeline (it embeds that step's samples).
  So while a step is in flight a lane is not planned while it is among the latest plans,
  one per other lane with running requests: the driver waits for a reply instead. (Found
  on 4x H200 with a deep queue: after a wave of admissions a lane was planned twice in a
  row whenever the others had both their steps out, and the lanes stayed paired, A A B B.)
- Shares. A lane admits up to its share of the requests that can run (running and
  waiting, at most max_num_seqs), so the micro-batches stay even as requests come and go,
  and a queue deeper than max_num_seqs does not fill the first lane alone; no lane ever
  holds more than `lane_capacity(max_num_seqs, lanes)`, what a stage's decode graphs are
  captured up to.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

from ray_runtime.config import lane_capacity


class LaneTurns:
    def __init__(self, num_lanes: int, max_num_seqs: int) -> None:
        self.num_lanes = num_lanes
        self.max_num_seqs = max_num_seqs
        self._next = 0  # the lane whose turn the next step is
        self._recent: deque[int] = deque(maxlen=max(num_lanes - 1, 1))  # the latest plans' lanes

    @property
    def max_lane_size(self) -> int:
        """The most requests one lane holds: its share of max_num_seqs."""
        return lane_capacity(self.max_num_seqs, self.num_lanes)

    def candidates(self, running: Sequence) -> Iterator[int]:
        """The lanes to try for the next step, in turn, without those that would run right
        behind their own step in flight. `running`: the running requests (with .lane and
        .num_inflight_steps)."""
        spacing = None  # computed only when a lane was planned lately
        for i in range(self.num_lanes):
            lane = (self._next + i) % self.num_lanes
            if lane in self._recent:
                if spacing is None:
                    spacing = self._spacing(running)
                if spacing and lane in list(self._recent)[-spacing:]:
                    continue
            yield lane

    def planned(self, lane: int) -> None:
        self._next = (lane + 1) % self.num_lanes
        self._recent.append(lane)

    def _spacing(self, running: Sequence) -> int:
        """How many of the latest plans a lane's next one must not directly follow: one per
        other lane with running requests, while any step is in flight (with none, no step
        can wait behind another)."""
        if not any(r.num_inflight_steps for r in running):
            return 0
        return min(len({r.lane for r in running}) - 1, self.num_lanes - 1)

    def share(self, lane: int, running: Sequence, num_waiting: int) -> tuple[int, int]:
        """(how many requests `lane` holds, how many it may hold) for admitting into it."""
        size = sum(1 for r in running if r.lane == lane)
        runnable = min(self.max_num_seqs, len(running) + num_waiting)
        return size, lane_capacity(runnable, self.num_lanes)

    def check(self, running: Sequence) -> None:
        sizes = [0] * self.num_lanes
        for req in running:
            sizes[req.lane] += 1
        assert max(sizes) <= self.max_lane_size, f"lane sizes {sizes} over {self.max_lane_size}"
