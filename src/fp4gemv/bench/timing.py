"""Device time by CUDA-graph replay with L2 flushed, and host time per eager call.

Device time: a CUDA graph holds one launch per distinct input (``inputs`` together several times the L2), L2
is flushed by a large memset before each replay, and events around the replay give the time per launch.
Eager back-to-back timing would measure the host, so host cost is measured separately (wall clock per call).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["device_time_us", "host_time_us", "input_count", "summarize", "event_time_us"]

_L2_FLUSH_BYTES = 256 << 20


def input_count(nbytes: int) -> int:
    """Distinct inputs per timed round: at least 20 and 300 MB, so no launch finds its operands in L2."""
    return max(20, -(-300_000_000 // nbytes))


def device_time_us(launch: Callable[[object], object], inputs: Sequence[object], replays: int = 15,
                   before_replay: Callable[[], object] | None = None) -> list[float]:
    """Per-launch device times (us), one per graph replay, of ``launch(x)`` for every ``x`` in ``inputs``.

    before_replay: called after the L2 flush and before the timed replay, outside the timing (the
    tensor-parallel benchmark lines up the ranks there)."""
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs:  # compile and warm up outside the capture
            launch(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            launch(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        flush.zero_()
        if before_replay is not None:
            before_replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return times


def host_time_us(call: Callable[[], object], calls: int = 2000, rounds: int = 5) -> float:
    """Wall-clock microseconds per eager call (median of ``rounds`` rounds of ``calls`` calls, synchronized at the
    ends of each round): the host's cost wherever it exceeds the device work it launches."""
    call()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_round)


def event_time_us(call: Callable[[], object], repeats: int = 10) -> float:
    """Median device-and-host time of a synchronous call, for baselines that cannot be graph-captured."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def summarize(times: Sequence[float]) -> dict:
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}
