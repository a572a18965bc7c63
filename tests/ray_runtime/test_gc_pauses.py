"""The collector in the engine's processes (ray_runtime/gc_pauses.py): collections timed,
the start-up heap frozen, the first generation's threshold raised."""
import gc
import threading

import pytest

from ray_runtime.gc_pauses import GEN0_THRESHOLD, GcPauses, settle_heap
from ray_runtime.trace import DRIVER_TID, PipelineTrace


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_collections_are_timed_and_drawn_on_the_driver_track():
    trace = PipelineTrace(2, record_events=True)
    pauses = GcPauses(on_pause=lambda t0, t1, gen: trace.driver_span("gc", t0, t1, generation=gen))
    try:
        garbage = [[] for _ in range(10_000)]
        for a, b in zip(garbage, garbage[1:]):  # cycles: work for the full collection
            a.append(b)
            b.append(a)
        del garbage, a, b
        gc.collect()
        snap = pauses.snapshot()
    finally:
        pauses.close()
    assert snap["collections"][2] >= 1 and snap["seconds"][2] > 0
    assert snap["total_s"] >= snap["max_s"] > 0
    spans = [e for e in trace.events if e["name"] == "gc"]
    assert spans and all(e["tid"] == DRIVER_TID for e in spans)
    assert any(e["args"]["generation"] == 2 for e in spans)
    # closed: later collections are not counted
    gc.collect()
    assert pauses.snapshot()["collections"] == snap["collections"]


def test_settle_heap_freezes_and_raises_the_threshold(restore_gc):
    held = [[i] for i in range(1000)]  # survives: frozen with the rest of the heap
    settle_heap()
    assert gc.get_freeze_count() >= len(held)
    assert gc.get_threshold()[0] == GEN0_THRESHOLD
    # a steady step's transient objects (fewer than the threshold) trigger no collection
    pauses = GcPauses()
    try:
        for _ in range(50):
            transient = [[j] for j in range(GEN0_THRESHOLD // 4)]
            del transient
        assert pauses.snapshot()["collections"] == [0, 0, 0]
    finally:
        pauses.close()


def test_snapshot_survives_a_collection_triggered_inside_it(restore_gc):
    """snapshot() allocates; a collection it triggers runs the callback in the same thread,
    which must not wait for anything snapshot() holds (a lock there hung the driver's
    stats() and left the collector disabled for good)."""
    pauses = GcPauses()
    done = threading.Event()

    def poll():
        for _ in range(200):
            pauses.snapshot()
        done.set()

    gc.set_threshold(1)  # every allocation of a tracked object collects
    try:
        worker = threading.Thread(target=poll, daemon=True)
        worker.start()
        worker.join(10)
    finally:
        gc.set_threshold(700, 10, 10)
        pauses.close()
    assert done.is_set(), "snapshot() hung in a collection it triggered"
    assert sum(pauses.count) > 0
