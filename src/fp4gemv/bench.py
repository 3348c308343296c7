"""Measuring the kernels on a GPU: device time by CUDA-graph replay, host overhead, baselines, report.

Device time: a CUDA graph holds one launch per distinct input (``inputs`` together several times the L2),
L2 is flushed by a large memset before each replay, and events around the replay give the time per launch.
Eager back-to-back timing would measure the host (13-24 us per launch on the H200 we use), so host
overhead is measured separately, as wall-clock time per eager call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
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


def input_count(nbytes: int) -> int:
    """Distinct inputs per timed round: at least 20 and 300 MB, so no launch finds its operands in L2."""
    return max(20, -(-300_000_000 // nbytes))


def stream_read_time_us(nbytes: int, pdl: bool = False) -> list[float]:
    """Device times of a stream read of ``nbytes`` per launch, over ``input_count`` distinct random buffers."""
    bufs = [torch.empty(nbytes // 8 * 8, dtype=torch.uint8, device="cuda").random_(0, 255)
            for _ in range(input_count(nbytes))]
    out = torch.empty(stream_read_programs(nbytes), dtype=torch.int64, device="cuda")
    return device_time_us(lambda x: stream_read(x, out, pdl), bufs)


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


def stream_read(buf: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> None:
    """Read every byte of ``buf`` (a multiple of 8 bytes) once; ``out`` needs ``stream_read_programs`` int64."""
    from .kernels.stream import stream_read_kernel

    words = buf.view(torch.int64)
    stream_read_kernel[(stream_read_programs(buf.numel()),)](words, out, words.numel(), WORDS=1024, STEPS=4,
                                                         PDL=pdl, num_warps=4, launch_pdl=pdl)


def stream_read_programs(nbytes: int) -> int:
    return -(-(nbytes // 8) // (1024 * 4))


def dequant_matmul_eager(a_bytes, sfa_linear, b_bytes, sfb_linear, dtype=torch.float32):
    """Baseline: dequantize both operands with PyTorch ops, then one batched matmul (fp32, exact inputs)."""
    a = formats.dequantize(a_bytes, sfa_linear, dtype=dtype)
    b = formats.dequantize(b_bytes, sfb_linear, dtype=dtype)
    return torch.matmul(a, b.transpose(-1, -2)).to(torch.float16)


def summarize(times: Sequence[float]) -> dict:
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


TASK_SHAPES = [Shape(7168, 16384, 1), Shape(4096, 7168, 8), Shape(7168, 2048, 4)]
DECODE_SHAPES = [Shape(4096, 4096), Shape(14336, 4096), Shape(4096, 14336), Shape(28672, 8192)]


def _event_time_us(call: Callable[[], object], repeats: int = 10) -> float:
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


def bench_shape(shape: Shape, compile_baseline: bool = True) -> dict:
    """Every measurement of one W4A4 task-layout shape: kernel, stream read, baselines, host overhead."""
    from . import ops

    m, k, l = shape.m, shape.k, shape.l
    nbytes = task_bytes(m, k, l)
    count = input_count(nbytes)
    inputs = [random_task_operands(m, k, l, seed=i) for i in range(count)]
    row = {"m": m, "k": k, "l": l, "bytes": nbytes, "floor_us": floor_us(nbytes), "inputs": count}
    row["kernel"] = summarize(device_time_us(lambda x: ops.task_gemv(*x), inputs))
    row["host_us_per_call"] = host_overhead_us(lambda: ops.task_gemv(*inputs[0]))
    row["stream_read"] = summarize(stream_read_time_us(nbytes))
    a, b, sfa_p, sfb_p, _ = inputs[0]
    a_lin = a.view(torch.uint8).permute(2, 0, 1)
    b_lin = b.view(torch.uint8).permute(2, 0, 1)[:, :1]
    sfa_lin = layouts.unswizzle_scales(layouts.swizzled_from_task_permuted(sfa_p.view(torch.uint8)), m, k // 16)
    sfb_lin = layouts.unswizzle_scales(layouts.swizzled_from_task_permuted(sfb_p.view(torch.uint8)), 128, k // 16)[:, :1]
    eager = lambda: dequant_matmul_eager(a_lin, sfa_lin, b_lin, sfb_lin)  # noqa: E731
    row["eager_us"] = _event_time_us(eager)
    if compile_baseline:
        compiled = torch.compile(dequant_matmul_eager, dynamic=False)
        row["compile_us"] = _event_time_us(lambda: compiled(a_lin, sfa_lin, b_lin, sfb_lin))
    inputs.clear()  # free the device buffers before the next shape
    return row


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'M':>6} {'K':>6} {'L':>2} {'MB':>7} {'floor us':>8} {'kernel us':>9} {'TB/s':>5} {'%floor':>6} "
            f"{'stream us':>9} {'host us':>7} {'eager us':>9} {'x eager':>7} {'compile us':>10} {'x comp':>6}")
    lines = [head]
    for r in rows:
        t = r["kernel"]["median_us"]
        comp = r.get("compile_us")
        lines.append(
            f"{r['m']:>6} {r['k']:>6} {r['l']:>2} {r['bytes'] / 1e6:>7.1f} {r['floor_us']:>8.2f} {t:>9.2f} "
            f"{r['bytes'] / t / 1e6:>5.2f} {100 * r['floor_us'] / t:>5.0f}% {r['stream_read']['median_us']:>9.2f} "
            f"{r['host_us_per_call']:>7.1f} {r['eager_us']:>9.1f} {r['eager_us'] / t:>7.1f} "
            f"{comp if comp is not None else float('nan'):>10.1f} {(comp or float('nan')) / t:>6.1f}")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str) -> bool:
    """Bar chart of achieved bandwidth per shape (kernel, stream read) against the floor; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['m']}x{r['k']}x{r['l']}" for r in rows]
    kern = [r["bytes"] / r["kernel"]["median_us"] / 1e6 for r in rows]
    stream = [r["bytes"] / r["stream_read"]["median_us"] / 1e6 for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    ax.bar([i - 0.2 for i in x], kern, 0.4, label="fp4gemv W4A4 kernel")
    ax.bar([i + 0.2 for i in x], stream, 0.4, label="stream read, same bytes")
    ax.axhline(PEAK_READ_TBPS, color="k", ls="--", lw=1, label=f"{PEAK_READ_TBPS} TB/s floor")
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("TB/s (bytes / device time per call)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def run(shapes: Sequence[Shape], out_dir: str, compile_baseline: bool = True) -> list[dict]:
    """Measure every shape, write ``bench.json`` and ``bench.png`` to ``out_dir``, print the table last."""
    import json
    import os

    rows = []
    for s in shapes:
        print(f"measuring {s.m}x{s.k}x{s.l} ...", flush=True)
        rows.append(bench_shape(s, compile_baseline))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_read_tbps": PEAK_READ_TBPS}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(out_dir, "bench.png"))
    print(format_table(rows))
    return rows
