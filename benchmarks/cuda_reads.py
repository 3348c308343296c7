"""CUDA C++ reads of a byte buffer for the stream-ceiling table (``stream_ceiling.py``), built with nvcc through
``torch.utils.cpp_extension`` where a compiler is present: 32 KB or 128 KB per block or a persistent grid (4
blocks per SM, grid-stride), 16-byte loads with the default or the streaming (``.cs``) cache operator, 4-8 loads
in flight per thread, PDL through ``cudaLaunchKernelEx``.  Benchmark-only: ``fp4gemv bench`` times the Triton
reads of ``fp4gemv.bench.stream`` (within 6% of these on every measured shape).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["CUDA_READS"]

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


_CUDA_DECLARATION = ("void stream_read_cuda(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, "
                     "int64_t chunk16, int64_t unroll, bool streaming, bool pdl);")


@functools.lru_cache(maxsize=1)
def _cuda_extension():
    """The CUDA C++ reads, built once per process (about a minute); None where no CUDA compiler works."""
    try:
        from torch.utils.cpp_extension import load_inline  # loaded only here: it imports setuptools

        return load_inline("fp4gemv_stream_read", cpp_sources=_CUDA_DECLARATION, cuda_sources=_CUDA_SOURCE,
                           functions=["stream_read_cuda"],
                           extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    except Exception as exc:  # no nvcc / ninja / headers: the Triton reads still run
        print(f"note: CUDA C++ reads unavailable ({type(exc).__name__}: {str(exc)[:120]}); Triton reads only")
        return None


def _cuda_read(pdl: bool, chunk_bytes: int, threads: int, unroll: int, streaming: bool):
    """The launcher factory of one CUDA read (``stream.ReadLauncher``): bytes per block (0: a persistent grid of 4
    blocks per SM), threads, 16-byte loads in flight per thread, streaming loads, PDL."""
    def launcher(nbytes: int):
        ext = _cuda_extension()
        if ext is None:
            return None
        out = torch.zeros(max(1 << 20, -(-nbytes // 32768)), dtype=torch.int64, device="cuda")
        n16 = nbytes // 16
        if chunk_bytes:
            chunk16 = chunk_bytes // 16
            blocks = -(-n16 // chunk16)
        else:
            chunk16, blocks = 0, 4 * torch.cuda.get_device_properties(0).multi_processor_count
        return lambda buf: ext.stream_read_cuda(buf, out, blocks, threads, chunk16, unroll, streaming, pdl)

    return launcher


def _reads() -> dict:
    found = {}
    for streaming in (False, True):
        for pdl in (False, True):
            tag = " ".join(t for t in ("cs" if streaming else "", "pdl" if pdl else "") if t)
            found[f"cuda 32K {tag}".strip()] = _cuda_read(pdl, 32768, 256, 8, streaming)
            found[f"cuda persistent {tag}".strip()] = _cuda_read(pdl, 0, 512, 4, streaming)
    found["cuda 128K pdl"] = _cuda_read(True, 131072, 512, 8, False)
    return found


# The CUDA reads of docs/performance.md's stream-ceiling table (named "chunk32K", "persist", "chunk128K" there).
CUDA_READS = _reads()
