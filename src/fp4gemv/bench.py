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


# Activation kinds of ``fp4gemv bench --act``: an FP4 activation in the weights' format, or a float dtype.
ACTIVATIONS = {"fp4": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def case_bytes(shape: Shape, fmt: str = "nvfp4", act: str = "fp4") -> int:
    """Bytes a GEMV must move: weights + scales, the activation (FP4 + scales, or 2 bytes per element), fp16 out."""
    block = formats.FORMATS[fmt].block_size
    m, k, l, n = shape.m, shape.k, shape.l, shape.n
    act_per_element = 0.5 + 1 / block if act == "fp4" else 2
    return int(l * (m * k // 2 + m * k // block) + l * n * k * act_per_element + l * m * n * 2)


def task_bytes(m: int, k: int, l: int = 1) -> int:  # noqa: E741
    """Bytes of the task's case (NVFP4 x NVFP4, N = 1): ``case_bytes`` of it."""
    return case_bytes(Shape(m, k, l))


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


def random_gemv_operands(shape: Shape, fmt: str, act: str, seed: int, device: str = "cuda"):
    """``(a, b, out)`` for ``fp4gemv.gemv``: random FP4 weights (all codes, swizzled scales, powers of two in
    2^-4 .. 2^3), an FP4 or float activation ``[L, N, K]`` and the fp16 output.  For timing only."""
    from .tensor import FP4Tensor

    f = formats.FORMATS[fmt]
    g = torch.Generator(device=device).manual_seed(seed)
    m, k, l, n = shape.m, shape.k, shape.l, shape.n

    def fp4(rows):
        data = torch.randint(0, 256, (l, rows, k // 2), dtype=torch.uint8, device=device, generator=g)
        rows_p, cols_p = layouts.padded_scale_shape(rows, k // f.block_size)
        powers = torch.exp2(torch.randint(-4, 4, (l, rows_p * cols_p), device=device, generator=g).float())
        encode = formats.encode_e4m3 if f.scale_dtype == torch.float8_e4m3fn else formats.encode_e8m0
        scales = encode(powers)
        return FP4Tensor(data, scales, fmt, "swizzled")

    dtype = ACTIVATIONS[act]
    b = fp4(n) if dtype is None else torch.randn((l, n, k), generator=g, device=device).to(dtype)
    return fp4(m), b, torch.empty((l, m, n), dtype=torch.float16, device=device)


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


def dequant_matmul_eager(a_bytes, sfa_linear, b, sfb_linear=None, fmt: formats.FP4Format = formats.NVFP4):
    """Baseline: dequantize with PyTorch ops (fp32, exact), then one batched matmul, fp16 out.

    b: packed FP4 bytes with linear scales ``sfb_linear``, or a float activation (``sfb_linear=None``).
    """
    a = formats.dequantize(a_bytes, sfa_linear, fmt, dtype=torch.float32)
    b = b.float() if sfb_linear is None else formats.dequantize(b, sfb_linear, fmt, dtype=torch.float32)
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
    from .tensor import FP4Tensor

    m, k, l = shape.m, shape.k, shape.l
    nbytes = task_bytes(m, k, l)
    inputs = [random_task_operands(m, k, l, seed=i) for i in range(input_count(nbytes))]
    a, b, sfa_p, sfb_p, _ = inputs[0]
    weights = FP4Tensor.from_task(a, sfa_p)
    activation = FP4Tensor.from_task(b, sfb_p).first_rows(1)
    row = {"m": m, "k": k, "l": l}
    return _measure(row, nbytes, lambda x: ops.task_gemv(*x), inputs,
                    (weights.data, weights.linear_scales(), activation.data, activation.linear_scales()),
                    compile_baseline)


def bench_case(shape: Shape, fmt: str, act: str, compile_baseline: bool = True) -> dict:
    """The same measurements as ``bench_shape`` for ``fp4gemv.gemv`` on any format, activation and N."""
    from .gemv import gemv

    nbytes = case_bytes(shape, fmt, act)
    inputs = [random_gemv_operands(shape, fmt, act, seed=i) for i in range(input_count(nbytes))]
    a, b, _ = inputs[0]
    b_args = (b.data, b.linear_scales()) if act == "fp4" else (b, None)
    row = {"m": shape.m, "k": shape.k, "l": shape.l, "n": shape.n, "fmt": fmt, "act": act}
    return _measure(row, nbytes, lambda x: gemv(x[0], x[1], out=x[2]), inputs,
                    (a.data, a.linear_scales(), *b_args, a.fmt), compile_baseline)


def _measure(row: dict, nbytes: int, launch: Callable[[object], object], inputs: list, eager_args: tuple,
             compile_baseline: bool) -> dict:
    """Fill ``row``: the kernel by graph replay over ``inputs``, host overhead, the stream read of ``nbytes``,
    and ``dequant_matmul_eager(*eager_args)`` eager and compiled (scales already linear, outside the timing)."""
    row.update(bytes=nbytes, floor_us=floor_us(nbytes), inputs=len(inputs))
    row["kernel"] = summarize(device_time_us(launch, inputs))
    row["host_us_per_call"] = host_overhead_us(lambda: launch(inputs[0]))
    row["stream_read"] = summarize(stream_read_time_us(nbytes))
    row["eager_us"] = _event_time_us(lambda: dequant_matmul_eager(*eager_args))
    if compile_baseline:
        compiled = torch.compile(dequant_matmul_eager, dynamic=False)
        row["compile_us"] = _event_time_us(lambda: compiled(*eager_args))
    inputs.clear()  # free the device buffers before the next shape
    return row


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'fmt':>5} {'act':>4} {'N':>2} {'M':>6} {'K':>6} {'L':>2} {'MB':>7} {'floor us':>8} {'kernel us':>9} {'TB/s':>5} {'%floor':>6} "
            f"{'stream us':>9} {'host us':>7} {'eager us':>9} {'x eager':>7} {'compile us':>10} {'x comp':>6}")
    lines = [head]
    for r in rows:
        t = r["kernel"]["median_us"]
        comp = r.get("compile_us")
        lines.append(
            f"{r.get('fmt', 'nvfp4'):>5} {r.get('act', 'fp4'):>4} {r.get('n', 1):>2} "
            f"{r['m']:>6} {r['k']:>6} {r['l']:>2} {r['bytes'] / 1e6:>7.1f} {r['floor_us']:>8.2f} {t:>9.2f} "
            f"{r['bytes'] / t / 1e6:>5.2f} {100 * r['floor_us'] / t:>5.0f}% {r['stream_read']['median_us']:>9.2f} "
            f"{r['host_us_per_call']:>7.1f} {r['eager_us']:>9.1f} {r['eager_us'] / t:>7.1f} "
            f"{comp if comp is not None else float('nan'):>10.1f} {(comp or float('nan')) / t:>6.1f}")
    return "\n".join(lines)


def _case_label(r: dict) -> str:
    """Empty for the task's case (NVFP4 W4A4, N = 1), else e.g. ``\nmxfp4 bf16 N=4``."""
    fmt, act, n = r.get("fmt", "nvfp4"), r.get("act", "fp4"), r.get("n", 1)
    return "" if (fmt, act, n) == ("nvfp4", "fp4", 1) else f"\n{fmt} {act} N={n}"


def plot(rows: Sequence[dict], path: str) -> bool:
    """Bar chart of achieved bandwidth per shape (kernel, stream read) against the floor; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['m']}x{r['k']}x{r['l']}" + _case_label(r) for r in rows]
    kern = [r["bytes"] / r["kernel"]["median_us"] / 1e6 for r in rows]
    stream = [r["bytes"] / r["stream_read"]["median_us"] / 1e6 for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    ax.bar([i - 0.2 for i in x], kern, 0.4, label="fp4gemv kernel")
    ax.bar([i + 0.2 for i in x], stream, 0.4, label="stream read, same bytes")
    ax.axhline(PEAK_READ_TBPS, color="k", ls="--", lw=1, label=f"{PEAK_READ_TBPS} TB/s floor")
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("TB/s (bytes / device time per call)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def run(shapes: Sequence[Shape], out_dir: str, compile_baseline: bool = True, fmt: str = "nvfp4",
        act: str = "fp4", ns: Sequence[int] = (1,)) -> list[dict]:
    """Measure every shape (for each N), write ``bench.json`` and ``bench.png`` to ``out_dir``, print the table.

    NVFP4 x FP4 with N = 1 is the task's case, timed through ``ops.task_gemv`` on the task's layouts; every
    other case goes through ``fp4gemv.gemv`` with swizzled scales.
    """
    import json
    import os

    rows = []
    for s in shapes:
        for n in ns:
            case = Shape(s.m, s.k, s.l, n)
            print(f"measuring {case.m}x{case.k}x{case.l} {fmt} {act} N={n} ...", flush=True)
            if (fmt, act, n) == ("nvfp4", "fp4", 1):
                rows.append(bench_shape(case, compile_baseline))
            else:
                rows.append(bench_case(case, fmt, act, compile_baseline))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_read_tbps": PEAK_READ_TBPS}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(out_dir, "bench.png"))
    print(format_table(rows))
    return rows
