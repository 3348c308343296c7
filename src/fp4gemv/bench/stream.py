"""Reads of a byte buffer: the speed-of-light baseline every kernel is reported against.

``fp4gemv bench`` gives each case's time as a fraction of the best read of the same number of bytes, timed
the same way (``timing.device_time_us``).  The reads: a Triton kernel (each program xors its share of int64
words into one stored word, so no load is dropped), with and without programmatic dependent launch, and CUDA
C++ reads built with nvcc through ``torch.utils.cpp_extension`` where a compiler is present: 32 KB or 128 KB
per block or a persistent grid (4 blocks per SM, grid-stride), 16-byte loads with the default or the streaming
(``.cs``) cache operator, 4-8 loads in flight per thread, PDL through ``cudaLaunchKernelEx``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from .timing import device_time_us, input_count, summarize

__all__ = ["ReadVariant", "READ_VARIANTS", "BEST_READ_VARIANTS", "stream_read", "read_times_us", "best_read"]

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


_CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

template <int UNROLL, bool STREAMING>
__global__ void read_kernel(const int4* __restrict__ src, long long n16, long long chunk16, int pdl,
                            unsigned long long* __restrict__ out) {
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  // chunk16 > 0: block b reads [b * chunk16, (b + 1) * chunk16); 0: grid-stride over everything.
  long long begin = chunk16 ? (long long)blockIdx.x * chunk16 : (long long)blockIdx.x * blockDim.x * UNROLL;
  long long end = chunk16 ? min(begin + chunk16, n16) : n16;
  long long stride = chunk16 ? (long long)blockDim.x * UNROLL : (long long)gridDim.x * blockDim.x * UNROLL;
  int4 acc = make_int4(0, 0, 0, 0);
  for (long long i = begin + threadIdx.x; i < end; i += stride) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      long long j = i + (long long)u * blockDim.x;
      v[u] = j < end ? (STREAMING ? __ldcs(src + j) : __ldg(src + j)) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w;
    }
  }
  unsigned long long r = (unsigned long long)(acc.x ^ acc.y) << 32 | (unsigned)(acc.z ^ acc.w);
  if (r == 0x123456789abcdefULL) out[blockIdx.x] = r;  // keeps the loads; practically never stores
}

template <int UNROLL, bool STREAMING>
void launch(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, int64_t chunk16, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  long long n16 = buf.numel() / 16;
  TORCH_CHECK(cudaLaunchKernelEx(&cfg, read_kernel<UNROLL, STREAMING>, (const int4*)buf.data_ptr(), n16,
                                 (long long)chunk16, (int)pdl, (unsigned long long*)out.data_ptr()) == cudaSuccess);
}

void stream_read_cuda(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, int64_t chunk16,
                      int64_t unroll, bool streaming, bool pdl) {
  if (unroll == 4 && !streaming) launch<4, false>(buf, out, blocks, threads, chunk16, pdl);
  else if (unroll == 4) launch<4, true>(buf, out, blocks, threads, chunk16, pdl);
  else if (!streaming) launch<8, false>(buf, out, blocks, threads, chunk16, pdl);
  else launch<8, true>(buf, out, blocks, threads, chunk16, pdl);
}
"""

_CUDA_DECLARATION = ("void stream_read_cuda(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, "
                     "int64_t chunk16, int64_t unroll, bool streaming, bool pdl);")


@functools.lru_cache(maxsize=1)
def _cuda_extension():
    """The CUDA C++ reads, built once per process (about a minute); None where no CUDA compiler works."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline("fp4gemv_stream_read", cpp_sources=_CUDA_DECLARATION, cuda_sources=_CUDA_SOURCE,
                           functions=["stream_read_cuda"],
                           extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    except Exception as exc:  # no nvcc / ninja / headers: the Triton reads still run
        print(f"note: CUDA C++ reads unavailable ({type(exc).__name__}: {str(exc)[:120]}); Triton reads only")
        return None


class ReadVariant(NamedTuple):
    """One read: ``kind`` "triton" or "cuda"; for CUDA: bytes per block (0: persistent grid of 4 blocks per SM),
    threads, 16-byte loads in flight per thread, streaming loads."""

    name: str
    kind: str
    pdl: bool
    chunk_bytes: int = 0
    threads: int = 0
    unroll: int = 0
    streaming: bool = False

    def launcher(self, nbytes: int) -> Callable[[torch.Tensor], None] | None:
        out = torch.zeros(max(1 << 20, -(-nbytes // 32768)), dtype=torch.int64, device="cuda")
        if self.kind == "triton":
            return lambda buf: stream_read(buf, out, self.pdl)
        ext = _cuda_extension()
        if ext is None:
            return None
        n16 = nbytes // 16
        if self.chunk_bytes:
            chunk16 = self.chunk_bytes // 16
            blocks = -(-n16 // chunk16)
        else:
            chunk16, blocks = 0, 4 * torch.cuda.get_device_properties(0).multi_processor_count
        return lambda buf: ext.stream_read_cuda(buf, out, blocks, self.threads, chunk16, self.unroll,
                                                self.streaming, self.pdl)


def _variants() -> tuple[ReadVariant, ...]:
    found = [ReadVariant("triton", "triton", False), ReadVariant("triton pdl", "triton", True)]
    for streaming in (False, True):
        for pdl in (False, True):
            tag = " ".join(t for t in ("cs" if streaming else "", "pdl" if pdl else "") if t)
            found.append(ReadVariant(f"cuda 32K {tag}".strip(), "cuda", pdl, 32768, 256, 8, streaming))
            found.append(ReadVariant(f"cuda persistent {tag}".strip(), "cuda", pdl, 0, 512, 4, streaming))
    found.append(ReadVariant("cuda 128K pdl", "cuda", True, 131072, 512, 8, False))
    return tuple(found)


# Every read of docs/performance.md's stream-ceiling table; BEST_READ_VARIANTS are those that were the fastest
# on at least one of its seven shapes (H200), which ``fp4gemv bench`` times for every case.
READ_VARIANTS = _variants()
BEST_READ_VARIANTS = tuple(v for v in READ_VARIANTS
                           if v.name in ("triton pdl", "cuda 32K pdl", "cuda 32K cs pdl", "cuda persistent pdl",
                                         "cuda 128K pdl"))


def read_times_us(nbytes: int, variants: tuple[ReadVariant, ...] = BEST_READ_VARIANTS) -> dict[str, float]:
    """Median device time of each read of ``nbytes`` (rounded down to 16 bytes), over ``input_count`` distinct
    random buffers; variants that cannot run here are left out."""
    bufs = [torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
            for _ in range(input_count(nbytes))]
    times = {}
    for variant in variants:
        launch = variant.launcher(nbytes)
        if launch is not None:
            times[variant.name] = summarize(device_time_us(launch, bufs))["median_us"]
    del bufs
    torch.cuda.empty_cache()
    return times


@functools.lru_cache(maxsize=None)
def best_read(nbytes: int) -> tuple[str, float]:
    """(variant, us) of the fastest of BEST_READ_VARIANTS on ``nbytes``; cached per byte count."""
    times = read_times_us(nbytes)
    name = min(times, key=times.get)
    return name, times[name]
