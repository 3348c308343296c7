"""The MoE layer's combine in one launch: the k weighted expert outputs ``y [T, k, H]`` (float32) of each token
summed in fp32 in slot order, ``(y[:, 0] + y[:, 1]) + ...``, rounded once to the output dtype (bf16 nearest even,
as ``store_rounded``).

What it replaces: ``y.sum(1).to(dtype)``, a reduction and a cast (two launches: 3.0-3.4 us of device time on the
H200 at gpt-oss and Qwen3 shapes, T = 1-16; this kernel 2.1-2.5 us in the same graphs: docs/performance.md, rounds
18 and 19).  With programmatic dependent launch (``CombineConfig.pdl``, where the target has it) its programs
start while the down launch ends: 2.2-2.6 -> 1.6-2.0 us on an H100 in the layer's graphs (round 20).
One program per (token, ``BLOCK`` columns of H): k loads of ``BLOCK`` floats, k - 1 additions, one store.  The
additions are IEEE fp32 in a fixed order, so every backend gives the same bits (``reference.combine_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import dtype_name
from ..target import Target
from ._common import store_rounded
from .spec import Src, TritonKernelSpec, TritonLaunch, check_powers_of_two

__all__ = ["CombineCase", "CombineOperands", "CombineConfig", "combine_config", "moe_combine_kernel", "MoeCombine"]

# Columns of H per program: the default (one warp, 4 floats a thread per slot) and the most a config may ask.
COMBINE_BLOCK = 128
MAX_BLOCK = 1024


@dataclass(frozen=True)
class CombineCase:
    """Summing ``y [T, k, H]`` (float32; strides in elements) over k into ``[T, H]`` of ``out_dtype``."""

    tokens: int
    top_k: int
    hidden: int
    y_strides: tuple[int, int, int]
    out_dtype: torch.dtype

    def describe(self) -> str:
        return f"combining float32 y T={self.tokens} k={self.top_k} H={self.hidden} into {dtype_name(self.out_dtype)}"


class CombineOperands(NamedTuple):
    """The tensors of one combine: ``y [T, k, H]`` and the result ``out [T, H]``, contiguous."""

    case: CombineCase
    y: torch.Tensor
    out: torch.Tensor


class CombineConfig(NamedTuple):
    """One launch of :func:`moe_combine_kernel`: ``block`` columns of H per program (a power of two); ``pdl``:
    programmatic dependent launch where the target has it (the programs start while the launch before ends and
    wait for it before reading y)."""

    block: int
    num_warps: int
    pdl: bool = True


def combine_config(hidden: int) -> CombineConfig:
    """Programs of one warp and 128 columns (4 floats a thread per slot).  Measured on the H200 (round 19,
    gpt-oss's k = 4, H = 2880 and Qwen3's k = 8, H = 2048 at T = 1, 8, 16): the best or level with it (2.1-2.5
    us) in all six cases, where 1024 columns and 4 warps (8 floats a thread) took 4.6-5.2 us at k = 8."""
    block = min(triton.next_power_of_2(hidden), COMBINE_BLOCK)
    return CombineConfig(block=block, num_warps=1)


class MoeCombine(TritonKernelSpec):
    """The slot-order fp32 sum in one kernel (any strides of y)."""

    name = "moe_combine"
    config_type = CombineConfig

    def why_not(self, case: CombineCase, target: Target) -> str | None:
        return None if target.runs_triton else "runs Triton kernels only"

    def default_config(self, case: CombineCase, target: Target) -> CombineConfig:
        return combine_config(case.hidden)

    def check_config(self, config: CombineConfig, case: CombineCase | None = None) -> None:
        check_powers_of_two(config, ("block", "num_warps"))
        if config.block > MAX_BLOCK:
            raise ValueError(f"config.block: expected at most {MAX_BLOCK} columns, got {config.block}")

    def triton_launch(self, case: CombineCase, config: CombineConfig, target: Target) -> TritonLaunch:
        pdl = config.pdl and target.pdl
        args = dict(y_ptr=Src("y", torch.float32), out_ptr=Src("out", case.out_dtype), H=case.hidden,
                    stride_t=case.y_strides[0], stride_j=case.y_strides[1], stride_h=case.y_strides[2],
                    TOP_K=case.top_k, BLOCK=config.block, PDL=pdl)
        return TritonLaunch(moe_combine_kernel, (case.tokens, triton.cdiv(case.hidden, config.block)), args,
                            dict(num_warps=config.num_warps, launch_pdl=pdl))


@triton.jit
def moe_combine_kernel(y_ptr, out_ptr, H, stride_t, stride_j, stride_h, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # y comes from the launch before: wait for it before the first read (and write)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    row = y_ptr + t * stride_t + h.to(tl.int64) * stride_h
    total = tl.load(row, mask=ok, other=0.0)
    for j in tl.static_range(1, TOP_K):
        total = total + tl.load(row + j * stride_j, mask=ok, other=0.0)
    store_rounded(out_ptr + t * H + h, total, ok)
