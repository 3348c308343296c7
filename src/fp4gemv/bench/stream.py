"""Reads of a byte buffer: the speed-of-light baseline every kernel is reported against.

``fp4gemv bench`` gives each case's time as a fraction of the best read of the same number of bytes, timed
the same way (``timing.device_time_us``).  The reads here are a Triton kernel (each program xors its share of
int64 words into one stored word, so no load is dropped), with and without programmatic dependent launch.
The stream-ceiling table of docs/performance.md also times CUDA C++ reads (``benchmarks/cuda_reads.py``); on
every shape it measured, the faster Triton read was within 6% of the fastest read of all
(docs/stream-ceiling-h200.json, checked by tests/test_bench.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch
import triton
import triton.language as tl

from .timing import device_time_us, input_count, summarize

__all__ = ["TRITON_READS", "stream_read", "read_times_us", "best_read"]

_WORDS, _STEPS = 1024, 4


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n_words, WORDS: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL:  # the same launch overlap the GEMV kernels get
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = pid * (WORDS * STEPS) + tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int64)
    for s in tl.static_range(STEPS):
        o = offs + s * WORDS
        acc ^= tl.load(src_ptr + o, mask=o < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def stream_read(buf: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> None:
    """Read every byte of ``buf`` (a multiple of 8 bytes) once with the Triton read; ``out``: one int64 per
    32 KB."""
    words = buf.view(torch.int64)
    programs = -(-words.numel() // (_WORDS * _STEPS))
    stream_read_kernel[(programs,)](words, out, words.numel(), WORDS=_WORDS, STEPS=_STEPS, PDL=pdl, num_warps=4,
                                    launch_pdl=pdl)


# A read: given the byte count, the function that reads one buffer of it (None where it cannot run here).
ReadLauncher = Callable[[int], Callable[[torch.Tensor], None] | None]


def _triton_read(pdl: bool) -> ReadLauncher:
    def launcher(nbytes: int):
        out = torch.zeros(max(1 << 20, -(-nbytes // 32768)), dtype=torch.int64, device="cuda")
        return lambda buf: stream_read(buf, out, pdl)

    return launcher


TRITON_READS: dict[str, ReadLauncher] = {"triton": _triton_read(False), "triton pdl": _triton_read(True)}


def read_times_us(nbytes: int, reads: Mapping[str, ReadLauncher] = TRITON_READS) -> dict[str, float]:
    """Median device time of each read of ``nbytes`` (rounded down to 16 bytes), over ``input_count`` distinct
    random buffers; reads that cannot run here are left out."""
    bufs = [torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
            for _ in range(input_count(nbytes))]
    times = {}
    for name, make in reads.items():
        launch = make(nbytes)
        if launch is not None:
            times[name] = summarize(device_time_us(launch, bufs))["median_us"]
    del bufs
    torch.cuda.empty_cache()
    return times


@functools.lru_cache(maxsize=None)
def best_read(nbytes: int) -> tuple[str, float]:
    """(read, us) of the fastest of TRITON_READS on ``nbytes``; cached per byte count."""
    times = read_times_us(nbytes)
    name = min(times, key=times.get)
    return name, times[name]
