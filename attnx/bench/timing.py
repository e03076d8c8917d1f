"""How a time is taken: warm-up, calibrated blocks, providers interleaved, median with spread.

Each provider's step is warmed up (compilation, caches, allocator) and calibrated so that one
timed block lasts about BLOCK_SECONDS; then for every repeat the providers run one block each,
in an order rotated each repeat (round-robin), so that machine noise (other processes, clock
changes) falls on all of them alike. On GPU a block is timed with CUDA events (device time);
on CPU with time.perf_counter. We report the median over repeats and the min and max.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

BLOCK_SECONDS = {"cpu": 0.05, "cuda": 0.02}
WARMUP_SECONDS = {"cpu": 0.05, "cuda": 0.1}


@dataclass
class Timing:
    samples: list = field(default_factory=list)  # seconds per call, one per repeat
    calls_per_sample: int = 1
    error: Optional[str] = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def as_dict(self) -> dict:
        if self.error is not None or not self.samples:
            return {"error": self.error}
        return {"median_ms": self.median * 1e3, "min_ms": min(self.samples) * 1e3,
                "max_ms": max(self.samples) * 1e3, "samples_ms": [s * 1e3 for s in self.samples],
                "calls_per_sample": self.calls_per_sample}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_block(step, device: str, calls: int) -> float:
    """Seconds per call of `step`, averaged over `calls` back-to-back calls."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls


def warm_up(step, device: str, scale: float = 1.0) -> int:
    """Runs `step` until warm and returns how many calls make a block of BLOCK_SECONDS
    (both durations times `scale`)."""
    step()  # the first call pays for compilation and lazy initialisation: never timed
    synchronize(device)
    calls, spent = 0, 0.0
    while calls < 2 or spent < WARMUP_SECONDS[device] * scale:
        spent += time_block(step, device, 1)
        calls += 1
    per_call = spent / calls
    return max(1, math.ceil(BLOCK_SECONDS[device] * scale / max(per_call, 1e-9)))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def interleaved(steps: dict, device: str, repeats: int, scale: float = 1.0) -> dict:
    """name -> Timing for each step (a no-argument callable), timed round-robin; `scale`
    shortens (< 1) or lengthens the warm-up and the blocks.

    A step that raises is reported with its error and dropped from the later rounds.
    """
    timings, calls = {}, {}
    for name, step in steps.items():
        try:
            calls[name] = warm_up(step, device, scale)
            timings[name] = Timing(calls_per_sample=calls[name])
        except Exception as exc:  # a provider failing must not stop the sweep
            timings[name] = Timing(error=_error(exc))
    live = [n for n in steps if timings[n].error is None]
    for r in range(repeats):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for name in order:
            if timings[name].error is not None:
                continue
            try:
                timings[name].samples.append(time_block(steps[name], device, calls[name]))
            except Exception as exc:
                timings[name] = Timing(error=_error(exc))
    return timings
