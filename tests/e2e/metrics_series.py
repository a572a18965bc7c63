"""The series the engine's metrics export (issue 19), for the tests that scrape them: no
side effects at import (metrics_scrape_run.py sets Ray's report interval when imported)."""
from __future__ import annotations

from ray_runtime.metric_defs import METRICS

FINISH_REASONS = ("stop", "length", "abort")  # request_success's finished_reason values


def expected_series(pp: int) -> dict:
    """(Prometheus name, sorted label pairs beyond model_name/engine) -> kind, of every
    counter and gauge series an engine at this PP exports from its start: every pp_rank,
    every finish reason (issue 19)."""
    values = {"pp_rank": tuple(str(r) for r in range(pp)), "finished_reason": FINISH_REASONS}
    out = {}
    for d in METRICS:
        if d.kind == "histogram":
            continue
        name = "ray_" + d.ray_name + ("_total" if d.kind == "counter" else "")
        combos = [()]
        for tag in d.tags:
            combos = [c + ((tag, v),) for c in combos for v in values[tag]]
        for c in combos:
            out[(name, tuple(sorted(c)))] = d.kind
    return out
