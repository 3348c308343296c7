"""Measuring the kernels on a GPU: device time by CUDA-graph replay, host overhead, baselines, report.

Device time: a CUDA graph holds one launch per distinct input (``inputs`` together several times the L2),
L2 is flushed by a large memset before each replay, and events around the replay give the time per launch.
Eager back-to-back timing would measure the host (13-24 us per launch on the H200 we use), so host
overhead is measured separately, as wall-clock time per eager call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from . import formats, layouts

__all__ = [
    "PEAK_READ_TBPS",
    "Shape",
    "task_bytes",
    "device_time_us",
    "host_overhead_us",
    "random_task_operands",
    "stream_read",
    "dequant_matmul_eager",
]

# Streaming read measured on the project's H200 (see docs/performance.md): the floor every result is given against.
PEAK_READ_TBPS = 4.53
_L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Shape:
    """One GEMV problem: M x K weights, L batches, N activation rows."""

    m: int
    k: int
    l: int = 1  # noqa: E741
    n: int = 1


def task_bytes(m: int, k: int, l: int = 1, act_bytes: float = 0.5 + 1 / 16) -> int:  # noqa: E741
    """Bytes a W4A4 GEMV must move: weights + scales, plus the activation and the fp16 output."""
    return int(l * (m * k // 2 + m * k // 16) + l * k * act_bytes + l * m * 2)


def floor_us(nbytes: int, tbps: float = PEAK_READ_TBPS) -> float:
    return nbytes / (tbps * 1e12) * 1e6


def device_time_us(launch: Callable[[object], None], inputs: Sequence[object], replays: int = 15) -> list[float]:
    """Per-launch device times (us), one per graph replay, of ``launch(x)`` for every ``x`` in ``inputs``."""
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
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return times


def host_overhead_us(call: Callable[[], object], calls: int = 200) -> float:
    """Wall-clock microseconds per eager call, device work included only where it is longer than the host's."""
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def random_task_operands(m: int, k: int, l: int, seed: int, device: str = "cuda"):  # noqa: E741
    """Task-layout operands ``(a, b, sfa_permuted, sfb_permuted, c)`` drawn directly on ``device``, fast.

    Bytes are uniform over all 256 values (all 16 codes, both signs); scales are e4m3 values 2^-4 .. 2^3.
    For timing only; correctness is checked on ``task.generate_full_range_input``.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randint(0, 256, (l, m, k // 2), dtype=torch.uint8, device=device, generator=g)
    b = torch.randint(0, 256, (l, 128, k // 2), dtype=torch.uint8, device=device, generator=g)
    # e4m3 bytes 0x18..0x57: exponent fields 3..10, every mantissa.
    sfa = torch.randint(0x18, 0x58, (l, m, k // 16), dtype=torch.uint8, device=device, generator=g)
    sfb = torch.randint(0x18, 0x58, (l, 128, k // 16), dtype=torch.uint8, device=device, generator=g)
    c = torch.empty((l, m, 1), dtype=torch.float16, device=device)
    return (
        a.permute(1, 2, 0).view(torch.float4_e2m1fn_x2),
        b.permute(1, 2, 0).view(torch.float4_e2m1fn_x2),
        layouts.task_permuted_view(layouts.swizzle_scales(sfa), m, k // 16).view(torch.float8_e4m3fn),
        layouts.task_permuted_view(layouts.swizzle_scales(sfb), 128, k // 16).view(torch.float8_e4m3fn),
        c.permute(1, 2, 0),
    )


def stream_read(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Read every byte of ``buf`` (a multiple of 8 bytes) once; ``out`` needs ``stream_read_programs`` int64."""
    from .kernels.stream import stream_read_kernel

    words = buf.view(torch.int64)
    stream_read_kernel[(stream_read_programs(buf.numel()),)](words, out, words.numel(), WORDS=1024, STEPS=4, num_warps=4)


def stream_read_programs(nbytes: int) -> int:
    return -(-(nbytes // 8) // (1024 * 4))


def dequant_matmul_eager(a_bytes, sfa_linear, b_bytes, sfb_linear, dtype=torch.float32):
    """Baseline: dequantize both operands with PyTorch ops, then one batched matmul (fp32, exact inputs)."""
    a = formats.dequantize(a_bytes, sfa_linear, dtype=dtype)
    b = formats.dequantize(b_bytes, sfb_linear, dtype=dtype)
    return torch.matmul(a, b.transpose(-1, -2)).to(torch.float16)


def summarize(times: Sequence[float]) -> dict:
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}
