"""An opt-in torch.profiler window over a stage's step loop, for finding where a stage's host
or device time goes (the pipeline trace shows when steps run; this shows why).

    RAY_RUNTIME_TORCH_PROFILER_DIR=/tmp/prof  RAY_RUNTIME_PROFILE_STEPS=100:140

in the environment of the stage processes (a Ray runtime_env's env_vars) makes each stage
profile its host (CPU ops, CUDA runtime calls) and its device (kernels, copies, NCCL) from
the plan numbered START it receives to the reply to plan STOP - 1, then write
`stage{rank}_pid{pid}.json` (Chrome trace / Perfetto) there. The step's phases appear as named
ranges (`phase`). Unset, nothing is recorded and `phase` costs one global read.

    RAY_RUNTIME_SYNC_DEBUG=warn   (or error)

makes every stage on CUDA report each call that makes its host wait for the device
(torch.cuda.set_sync_debug_mode), from the moment its step loop starts (set-up, which
synchronizes on purpose, is done by then): the step path is meant to wait only on events
(finish() reading a step's samples, the staging ring), so anything reported is a stall.
`bench/gpu_check.py` runs every engine with `error`: a step that makes its host wait fails.

    RAY_RUNTIME_PHASE_CLOCK=1

makes each stage time its phases on the host with the wall clock (a perf_counter pair per
phase, no profiler: the host runs at its own pace), cumulative counts and seconds per phase
name, carried in every reply's StageTiming.phases; the driver's stats() has the latest per
rank as `stage_phase_s` (bench/pp_scaling.py reports ms per step from them). Nested phases
count inside their parents ("launch" holds "apply plan", ...). On CUDA the replies also carry
each step's device span (DeviceClock), drawn as a "stage r gpu" track in the pipeline trace.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Optional

logger = logging.getLogger(__name__)

DIR_ENV, STEPS_ENV = "RAY_RUNTIME_TORCH_PROFILER_DIR", "RAY_RUNTIME_PROFILE_STEPS"
SYNC_DEBUG_ENV = "RAY_RUNTIME_SYNC_DEBUG"
CLOCK_ENV = "RAY_RUNTIME_PHASE_CLOCK"
DEFAULT_STEPS = "100:140"
_active = False  # a window is open in this process: phases are recorded
_clock: Optional[dict] = None  # phase name -> [count, seconds] while the phase clock runs


class _Timed:
    """One phase on the phase clock: its wall time added to its name's total on exit."""

    __slots__ = ("name", "t0")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if _clock is None:  # the clock was stopped inside the phase
            return
        entry = _clock.get(self.name)
        if entry is None:
            entry = _clock[self.name] = [0, 0.0]
        entry[0] += 1
        entry[1] += time.perf_counter() - self.t0


def phase(name: str):
    """A named range in the profile while a window is open, a timed phase while the phase
    clock runs; nothing otherwise."""
    if _clock is not None:
        return _Timed(name)
    if not _active:
        return _NULL
    import torch

    return torch.profiler.record_function(name)


_NULL = contextlib.nullcontext()


def clock_on() -> bool:
    return _clock is not None


def phase_clock() -> Optional[dict]:
    """The phase clock's totals so far ({name: (count, seconds)}), or None when it is off."""
    if _clock is None:
        return None
    return {k: (v[0], v[1]) for k, v in list(_clock.items())}


class DeviceClock:
    """CUDA events to wall-clock times (time.time()), through one anchor event whose
    completion the host waited for: on one machine every stage's device spans land on the
    same time axis as the hosts' (the pipeline trace's "stage r gpu" tracks)."""

    def __init__(self) -> None:
        import torch

        with sync_allowed():
            self.anchor = torch.cuda.Event(enable_timing=True)
            self.anchor.record()
            self.anchor.synchronize()
            self.t0 = time.time()

    def wall(self, start, end) -> tuple[float, float]:
        """(start, end) of a span on the wall clock; its length measured from start itself
        (elapsed_time is float milliseconds: far from the anchor it loses microseconds)."""
        t = self.t0 + self.anchor.elapsed_time(start) / 1e3
        return t, t + start.elapsed_time(end) / 1e3


def sync_debug_mode() -> Optional[str]:
    """RAY_RUNTIME_SYNC_DEBUG, checked: None, "warn" or "error"."""
    mode = os.environ.get(SYNC_DEBUG_ENV) or None
    if mode not in (None, "warn", "error"):
        raise ValueError(f"{SYNC_DEBUG_ENV}: expected warn or error, got {mode!r}")
    return mode


def start_step_loop(device: str) -> None:
    """When a stage's step loop starts: the sync debug mode, if asked for. It is
    process-wide: stop_step_loop turns it off, and calls that wait on purpose while the loop
    runs (re-forming the link, checks: the driver makes them with no step in flight) run
    inside `sync_allowed`."""
    global _clock
    if os.environ.get(CLOCK_ENV, "") not in ("", "0"):
        _clock = {}
    mode = sync_debug_mode()
    if mode and device == "cuda":
        import torch

        torch.cuda.set_sync_debug_mode(mode)


def stop_step_loop(device: str) -> None:
    if sync_debug_mode() and device == "cuda":
        import torch

        torch.cuda.set_sync_debug_mode(0)


@contextlib.contextmanager
def sync_allowed():
    """Host waits for the device are intended here: the sync debug mode is off inside."""
    import torch

    if not (sync_debug_mode() and torch.cuda.is_available()):
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def prepare(device: str) -> None:
    """At stage start, in the actor's own thread: the variables checked, and when a profile
    window is asked for, one empty profile here first (the profiler's library binds itself
    to the thread that first starts it; the window opens in the step loop's thread)."""
    sync_debug_mode()
    if os.environ.get(DIR_ENV):
        parse_steps(os.environ.get(STEPS_ENV, DEFAULT_STEPS))
    if device != "cuda":
        return
    import torch

    if os.environ.get(DIR_ENV):
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts):
            pass


def parse_steps(value: str) -> tuple[int, int]:
    try:
        start, stop = (int(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(f"{STEPS_ENV}: expected START:STOP (plan numbers), got {value!r}") from None
    if not 0 <= start < stop:
        raise ValueError(f"{STEPS_ENV}: need 0 <= START < STOP, got {value!r}")
    return start, stop


class StepProfiler:
    """Counts the plans a stage receives and the replies it sends; profiles plans
    [start, stop). `from_env` returns None unless the directory variable is set."""

    def __init__(self, out_dir: str, rank: int, start: int, stop: int, cuda: bool) -> None:
        self.path = os.path.join(out_dir, f"stage{rank}_pid{os.getpid()}.json")
        self.start, self.stop, self.cuda = start, stop, cuda
        self.plans = self.replies = 0
        self._prof = None

    @classmethod
    def from_env(cls, runner) -> Optional["StepProfiler"]:
        """For the stage of `runner` (its rank and device), if the variables ask for it."""
        out_dir = os.environ.get(DIR_ENV)
        if not out_dir:
            return None
        start, stop = parse_steps(os.environ.get(STEPS_ENV, DEFAULT_STEPS))
        return cls(out_dir, runner.rank, start, stop, runner.device == "cuda")

    def on_plan(self) -> None:
        global _active
        if self.plans == self.start and self._prof is None:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
            _active = True
        self.plans += 1

    def on_reply(self) -> None:
        self.replies += 1
        if self.replies >= self.stop:
            self.close()

    def close(self) -> None:
        global _active
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        _active = False
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        logger.warning("stage profile written to %s", self.path)
