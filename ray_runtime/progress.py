"""Progress of a long generate() call: a tqdm bar on a terminal; elsewhere (job logs, CI) one
log line every few seconds. Requests done and output tokens per second, in both."""
from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("ray_runtime.progress")
LOG_EVERY_S = 5.0


class Progress:
    def __init__(self, total: int, enabled: bool = True, log_every_s: float = LOG_EVERY_S) -> None:
        self.total = total
        self.done = 0
        self.tokens = 0
        self.enabled = enabled
        self.t0 = self._last_log = time.monotonic()
        self.log_every_s = log_every_s
        self._bar = None
        self._logged = None  # (done, tokens) of the last line logged
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)

    def update(self, num_tokens: int) -> None:
        self.done += 1
        self.tokens += num_tokens
        if not self.enabled:
            return
        rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
        if self._bar is not None:
            self._bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
            self._bar.update(1)

    def tick(self) -> None:
        """Off a terminal: log the progress line when one is due (called on every poll)."""
        if self.enabled and self._bar is None:
            now = time.monotonic()
            if now - self._last_log >= self.log_every_s:
                self._last_log = now
                self._logged = (self.done, self.tokens)
                logger.info("%s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        return (f"progress: {self.done}/{self.total} requests done, {self.tokens} output tokens, "
                f"{self.tokens / max(elapsed, 1e-9):.1f} tok/s, {elapsed:.0f} s")

    def close(self) -> None:
        """The bar's end, or off a terminal the last progress line (always one per call)."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done and self._logged != (self.done, self.tokens):
            logger.info("%s", self.line(time.monotonic()))
