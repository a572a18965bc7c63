"""Progress of a generate() call off a terminal: a log line every log_every_s, and one at
the end, with requests done and output tokens (ray_runtime/progress.py)."""
import logging
import time

from ray_runtime.progress import Progress


def test_progress_logs_periodically_and_at_the_end(caplog):
    caplog.set_level(logging.INFO, logger="ray_runtime.progress")
    p = Progress(total=3, enabled=True, log_every_s=0.05)
    assert p._bar is None  # pytest's stderr is not a terminal
    p.update(10)
    time.sleep(0.06)
    p.tick()
    p.update(5)
    p.tick()  # too soon after the last line: nothing
    p.update(7)
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("progress: 1/3 requests done, 10 output tokens")
    assert lines[1].startswith("progress: 3/3 requests done, 22 output tokens")
    assert "tok/s" in lines[1]


def test_progress_disabled_is_silent(caplog):
    caplog.set_level(logging.INFO, logger="ray_runtime.progress")
    p = Progress(total=1, enabled=False, log_every_s=0.0)
    p.update(3)
    p.tick()
    p.close()
    assert not caplog.records


def test_the_last_line_is_not_repeated(caplog):
    caplog.set_level(logging.INFO, logger="ray_runtime.progress")
    p = Progress(total=1, enabled=True, log_every_s=0.0)
    p.update(4)
    p.tick()  # due at once: logs 1/1
    p.close()  # nothing new since: no second line
    assert len(caplog.records) == 1
