"""Device script: the fastest read of the GEMV's bytes we can write, timed exactly as ``fp4gemv bench`` times
the kernels (CUDA-graph replay, one launch per distinct input, L2 flushed per replay).

PYTHONPATH=src python benchmarks/stream_ceiling.py   -> one line per shape; stream_ceiling.json in $OUT.

Why: issue 3's bars (90% of 4.53 TB/s on the large task shapes, 85% elsewhere) are per launch; no GEMV can
beat a kernel that only reads the same bytes.  Besides the Triton read the bench uses, CUDA C++ reads built
here with nvcc (torch.utils.cpp_extension): each block one contiguous chunk (many blocks, like the Triton
read) or a persistent grid (a few blocks per SM, grid-stride), 16-byte loads with the default or the
streaming (.cs) cache operator, 4-8 independent loads in flight per thread, with and without programmatic
dependent launch (launch_dependents + wait first, launched with cudaLaunchKernelEx).
"""

import json
import os

import torch
from torch.utils.cpp_extension import load_inline

from fp4gemv import bench
from fp4gemv.bench import Shape, device_time_us, floor_us, input_count, summarize

CUDA = r"""
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

void stream_read_cuda(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, int64_t chunk16, int64_t unroll,
          bool streaming, bool pdl) {
  if (unroll == 4 && !streaming) launch<4, false>(buf, out, blocks, threads, chunk16, pdl);
  else if (unroll == 4) launch<4, true>(buf, out, blocks, threads, chunk16, pdl);
  else if (!streaming) launch<8, false>(buf, out, blocks, threads, chunk16, pdl);
  else launch<8, true>(buf, out, blocks, threads, chunk16, pdl);
}
"""

DECLARATION = ("void stream_read_cuda(torch::Tensor buf, torch::Tensor out, int64_t blocks, int64_t threads, "
               "int64_t chunk16, int64_t unroll, bool streaming, bool pdl);")

SHAPES = bench.TASK_SHAPES + bench.DECODE_SHAPES


def variants(n16, sms):
    """(name, blocks, threads, chunk16, unroll, streaming, pdl)."""
    chunk = 2048  # 32 KB per block, like the Triton read
    for streaming in (False, True):
        for pdl in (False, True):
            tag = ("cs " if streaming else "") + ("pdl" if pdl else "")
            yield f"chunk32K {tag}".strip(), -(-n16 // chunk), 256, chunk, 8, streaming, pdl
            yield f"persist {tag}".strip(), sms * 4, 512, 0, 4, streaming, pdl
    yield "chunk128K pdl", -(-n16 // 8192), 512, 8192, 8, False, True


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    ext = load_inline("fp4gemv_stream_ceiling", cpp_sources=DECLARATION, cuda_sources=CUDA,
                      functions=["stream_read_cuda"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for s in SHAPES:
        nbytes = bench.task_bytes(s.m, s.k, s.l)
        bufs = [torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
                for _ in range(input_count(nbytes))]
        out = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
        line = {"triton": summarize(bench.stream_read_time_us(nbytes))["median_us"],
                "triton pdl": summarize(bench.stream_read_time_us(nbytes, pdl=True))["median_us"]}
        for name, blocks, threads, chunk, unroll, streaming, pdl in variants(nbytes // 16, sms):
            launch = (lambda x, b=blocks, t=threads, c=chunk, u=unroll, st=streaming, p=pdl:
                      ext.stream_read_cuda(x, out, b, t, c, u, st, p))
            line[name] = summarize(device_time_us(launch, bufs))["median_us"]
        best = min(line, key=line.get)
        results.append({"shape": s.__dict__, "bytes": nbytes, "floor_us": floor_us(nbytes), "us": line})
        print(f"{s.m}x{s.k}x{s.l} floor {floor_us(nbytes):.2f}: " + " | ".join(f"{k} {v:.2f}" for k, v in line.items())
              + f" || best {best} {line[best]:.2f} ({100 * floor_us(nbytes) / line[best]:.0f}%)", flush=True)
        del bufs
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "stream_ceiling.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
