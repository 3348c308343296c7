"""MoE routing in one launch: router logits ``[T, E]`` to the top-k expert ids and their routing weights.

One program per ``BLOCK_T`` tokens holds each token's E logits in registers (``E_PAD`` lanes, upcast to fp32:
exact for fp16 and bf16).  Each logit becomes one int64 rank, unique in its row: the order-preserving integer of
its fp32 bits (the sign-magnitude bits folded so that integer order is float order; -0.0 read as +0.0, every
NaN above +inf) times ``E_PAD`` plus ``E_PAD - 1 - e``, so the largest rank is the largest logit, NaN first,
lower index first among equals.  k passes take the row maximum of the ranks, decode its expert from the low
bits and its logit from the high ones, and retire it; so ids come out in descending order with one reduction per
pass, no sort.  With programmatic dependent launch (``RouteConfig.pdl``, where the target has it) the programs
start while the launch before ends and wait for it before reading the logits: 2.3-4.8 -> 1.8-4.2 us on an H100 in
the MoE layer's graphs (docs/performance.md, round 20).

Weights, with ``m`` the first selected logit (the row's largest): ``exp(x - m) / sum exp(x - m)`` over the k
selected logits (``SOFTMAX_ALL`` false) or all E (true), in fp32, the division rounded to nearest
(``tl.div_rn``), then rounded once to the weights' dtype (bf16 nearest even, as ``store_rounded``).  A NaN,
a +inf or an all -inf softmax gives NaN weights, as the float64 formula (``reference.route_reference``).

Error against the exact weight (the tests' bound), d = |x - m| of a term whose exp does not underflow (d <= 104):
``x - m`` rounds once, an absolute ``d * 2^-24`` on the exponent; on the GPU ``tl.exp`` is ``ex2.approx``
(relative about 2^-22) after a multiplication by an fp32 log2(e), which adds ``2 d * 2^-24`` more: each exp is
within ``(3 d + 4) * 2^-24`` relative.  A weight is one exp over the sum of n of them (n - 1 additions), divided
once: within ``(6 d + n + 9) * 2^-24`` relative, d the largest, plus 2^-126 absolute (a subnormal exp; the sum is
at least exp(0) = 1), plus the final rounding's half ulp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import dtype_name
from ..target import Target
from ._common import pow2_at_most, store_rounded
from .spec import Src, TritonKernelSpec, TritonLaunch, check_powers_of_two

__all__ = ["MAX_EXPERTS", "RouteCase", "RouteOperands", "RouteConfig", "route_config", "moe_route_kernel",
           "MoeRoute"]

# Experts per token (the op refuses more, on every backend): a row's logits stay in registers, and an expert index
# fits the rank's low 10 bits.  Covers gpt-oss (32, 128), Qwen3-MoE (128), DeepSeek-V3 (256), Qwen3-Next (512).
MAX_EXPERTS = 1024
# Logits per program: BLOCK_T * E_PAD lanes of fp32 and int64 ranks, 16 per thread at 4 warps (sized, not
# measured).
_LANES = 2048
# Ranks below every real one (those are at least -2^31 * E_PAD): padding lanes and retired experts.
_RETIRED = tl.constexpr(-(2**62))
_NAN_KEY = tl.constexpr(2**31 - 1)


@dataclass(frozen=True)
class RouteCase:
    """Routing ``logits [T, E]`` (strides in elements) to ``top_k`` ids of ``ids_dtype`` and weights of
    ``out_dtype``, by ``weights`` (``"softmax_selected"`` or ``"softmax_all"``): what a routing kernel may look at."""

    tokens: int
    experts: int
    top_k: int
    weights: str
    logits_dtype: torch.dtype
    logits_strides: tuple[int, int]
    ids_dtype: torch.dtype
    out_dtype: torch.dtype

    def describe(self) -> str:
        return (f"routing {dtype_name(self.logits_dtype)} logits T={self.tokens} E={self.experts} top-{self.top_k} "
                f"{self.weights} to {dtype_name(self.ids_dtype)} ids, {dtype_name(self.out_dtype)} weights")


class RouteOperands(NamedTuple):
    """The tensors of one routing: logits ``[T, E]``, and the results ids and weights, ``[T, k]`` contiguous."""

    case: RouteCase
    logits: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


class RouteConfig(NamedTuple):
    """One launch of :func:`moe_route_kernel`: ``rows`` tokens per program (a power of two); ``pdl``: programmatic
    dependent launch where the target has it (the programs start while the launch before ends and wait for it
    before reading the logits)."""

    rows: int
    num_warps: int
    pdl: bool = True


def route_config(tokens: int, experts: int) -> RouteConfig:
    """Tokens per program up to ``_LANES`` logits (never more than the next power of two >= T); 4 warps from
    1024 lanes, fewer below (a warp per 256 lanes; sized, not measured)."""
    e_pad = triton.next_power_of_2(experts)
    rows = min(triton.next_power_of_2(tokens), pow2_at_most(_LANES // e_pad))
    return RouteConfig(rows=rows, num_warps=min(4, pow2_at_most(rows * e_pad // 256)))


class MoeRoute(TritonKernelSpec):
    """Top-k selection and softmax weights in one kernel (any logits strides, both weight modes)."""

    name = "moe_route"
    config_type = RouteConfig

    def why_not(self, case: RouteCase, target: Target) -> str | None:
        return None if target.runs_triton else "runs Triton kernels only"

    def default_config(self, case: RouteCase, target: Target) -> RouteConfig:
        return route_config(case.tokens, case.experts)

    def check_config(self, config: RouteConfig, case: RouteCase | None = None) -> None:
        check_powers_of_two(config, ("rows", "num_warps"))

    def triton_launch(self, case: RouteCase, config: RouteConfig, target: Target) -> TritonLaunch:
        e_pad = triton.next_power_of_2(case.experts)
        pdl = config.pdl and target.pdl
        args = dict(
            logits_ptr=Src("logits", case.logits_dtype), ids_ptr=Src("ids", case.ids_dtype),
            weights_ptr=Src("weights", case.out_dtype),
            T=case.tokens, E=case.experts, TOP_K=case.top_k,
            stride_t=case.logits_strides[0], stride_e=case.logits_strides[1],
            BLOCK_T=config.rows, E_PAD=e_pad, E_BITS=e_pad.bit_length() - 1,
            K_PAD=triton.next_power_of_2(case.top_k), SOFTMAX_ALL=case.weights == "softmax_all",
            PDL=pdl,
        )
        return TritonLaunch(moe_route_kernel, (triton.cdiv(case.tokens, config.rows),), args,
                            dict(num_warps=config.num_warps, launch_pdl=pdl))


@triton.jit
def moe_route_kernel(
    logits_ptr, ids_ptr, weights_ptr,
    T, E, TOP_K,
    stride_t, stride_e,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    E_BITS: tl.constexpr,
    K_PAD: tl.constexpr,
    SOFTMAX_ALL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # the logits come from the launch before: wait for it before the first read (and write)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Tail rows re-read row T-1 instead of masking every load; only the stores are masked.
    rows_in = tl.minimum(rows, T - 1).to(tl.int64)
    lanes = tl.arange(0, E_PAD)
    lane_ok = (lanes < E)[None, :]
    x = tl.load(logits_ptr + rows_in[:, None] * stride_t + lanes[None, :] * stride_e, mask=lane_ok,
                other=float("-inf")).to(tl.float32)

    # Order-preserving integers of the fp32 bits: a negative float's magnitude bits flipped, so that signed
    # integer order is float order; -0.0 as +0.0 (they compare equal), every NaN above +inf.
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = tl.where(x != x, _NAN_KEY, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    rank = key.to(tl.int64) * E_PAD + (E_PAD - 1 - lanes)[None, :]
    rank = tl.where(lane_ok, rank, _RETIRED)

    slots = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    top = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in range(TOP_K):
        best = tl.max(rank, axis=1)
        expert = (E_PAD - 1 - (best & (E_PAD - 1))).to(tl.int32)
        # The fold is its own inverse: the key's float back (the logit, -0.0 as +0.0, a NaN as a NaN).
        best_key = (best >> E_BITS).to(tl.int32)
        value = (best_key ^ ((best_key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        rank = tl.where(lanes[None, :] == expert[:, None], _RETIRED, rank)
        ids = tl.where(slots == j, expert[:, None], ids)
        top = tl.where(slots == j, value[:, None], top)

    selected = slots < TOP_K
    largest = tl.sum(tl.where(slots == 0, top, 0.0), axis=1)[:, None]
    e_top = tl.exp(top - largest)
    if SOFTMAX_ALL:
        total = tl.sum(tl.where(lane_ok, tl.exp(x - largest), 0.0), axis=1)
    else:
        total = tl.sum(tl.where(selected, e_top, 0.0), axis=1)
    weights = tl.div_rn(e_top, total[:, None])

    out = rows.to(tl.int64)[:, None] * TOP_K + slots
    mask = (rows < T)[:, None] & selected
    tl.store(ids_ptr + out, ids.to(ids_ptr.dtype.element_ty), mask=mask)
    store_rounded(weights_ptr + out, weights, mask)
