"""The GEMV kernels and their precedence: the tables the dispatchers (``fp4gemv.ops``, ``fp4gemv.moe``) read.

:data:`GEMV_KERNELS` lists the specs in the order they are tried; :data:`DEFERRALS` lists where a kernel that
runs a case leaves it to a later one by default (measured faster there).  :data:`MOE_KERNELS` is the table of
the routed expert GEMV (``spec.MoeCase``).  :func:`choose_kernel` takes the first spec of a table that runs the
case on the target and is not deferred.  A new kernel is its module plus one line in ``GEMV_KERNELS`` or
``MOE_KERNELS`` (and a deferral line, where measurements call for one); kernel modules share device code
through ``_common``, ``_decode``, ``_mma_step`` and ``_ptx``, and the routed kernels call their dense twins'
pieces (``moe_weight_only`` weight_only's step, ``moe_engine`` the engine's; ``moe_gemv`` and ``general`` share
the scale addressing and masked loads of ``_common``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..target import Target
from .engine import Engine
from .gemm import Gemm
from .general import General
from .hmma_gemv import Hmma
from .engine import MIN_N_OVER_WEIGHT_ONLY as ENGINE_MIN_N
from .engine import MULTI_WAVE_MIN_K as ENGINE_MULTI_WAVE_MIN_K
from .engine import SMALL_N_PER_SM as ENGINE_PER_SM
from .engine import STEP_K as ENGINE_STEP_K
from .engine import engine_deferred
from .moe_engine import MIN_TOKENS as MOE_ENGINE_MIN_TOKENS
from .moe_engine import MoeEngine, moe_engine_deferred
from .moe_gemv import MoeGeneral
from .moe_weight_only import MoeWeightOnly
from .reference import MoeReference, Reference
from .spec import GemvCase, KernelSpec, MoeCase
from .stream import MIN_N as STREAM_MIN_N
from .stream import Stream
from .w4a4 import W4A4
from .weight_only import MAX_FLOAT_N_OVER_HMMA, WeightOnly

__all__ = ["GEMV_KERNELS", "MOE_KERNELS", "DEFERRALS", "Deferral", "kernel_by_name", "choose_kernel"]

GEMV_KERNELS: tuple[KernelSpec, ...] = (Gemm(), W4A4(), Engine(), Stream(), WeightOnly(), Hmma(), General(),
                                         Reference())
MOE_KERNELS: tuple[KernelSpec, ...] = (MoeEngine(), MoeWeightOnly(), MoeGeneral(), MoeReference())


class Deferral(NamedTuple):
    """Kernel ``kernel`` leaves the cases where ``when(case, target)`` holds to kernel ``to``, when ``to`` runs
    them."""

    kernel: str
    to: str
    when: Callable[[GemvCase | MoeCase, Target], bool]
    why: str


DEFERRALS: tuple[Deferral, ...] = (
    # docs/performance.md, rounds 26 and 31 (the decode engine at N <= 8, three programs an SM): slower than
    # weight_only below N = 4 and where its programs take more than one wave with K under 7168 (14336 x 4096,
    # 16384 x 6144), faster elsewhere (28672 x 8192 from round 31, K = 7168 from round 32).
    Deferral("engine", "weight_only", lambda case, target: engine_deferred(case, target.sm_count),
             f"N < {ENGINE_MIN_N}, or N <= 8 with more 32-row tiles than {ENGINE_PER_SM} an SM and K < "
             f"{ENGINE_MULTI_WAVE_MIN_K}: weight_only measured faster"),
    # K < 1024: the engine's one step would be mostly copies past K (zero-filled, decoded and multiplied all the
    # same); not measured there, so those cases keep the kernels that ran them before the engine took K tails.
    Deferral("engine", "weight_only", lambda case, target: case.k < ENGINE_STEP_K,
             f"K < {ENGINE_STEP_K}: one step mostly past K (not measured on the engine)"),
    # docs/performance.md, the streaming skeleton: at N <= 8 the register-fed weight_only kernel is faster.
    Deferral("stream", "weight_only", lambda case, target: case.n < STREAM_MIN_N,
             f"N < {STREAM_MIN_N} runs faster on weight_only (measured)"),
    # docs/performance.md, the weight-only kernel's dispatch: at N = 16 hmma was as fast or faster on most shapes.
    Deferral("weight_only", "hmma", lambda case, target: case.fmt.name == "nvfp4" and case.n > MAX_FLOAT_N_OVER_HMMA,
             f"NVFP4 with N > {MAX_FLOAT_N_OVER_HMMA} runs on hmma (measured as fast or faster)"),
    # docs/performance.md, round 16 (the routed engine): with its scale bytes copied it was faster than moe_weight_only
    # from T = 4 rows of x where K takes more than one 1024-element step (gpt-oss gate_up and down, Qwen3's gate_up),
    # slower at T = 1-2 and at K <= 1024 (Qwen3's down: one step per item), 1.08x slower with the scales loaded.
    Deferral("moe_engine", "moe_weight_only", lambda case, target: moe_engine_deferred(case),
             f"T < {MOE_ENGINE_MIN_TOKENS}, K <= {ENGINE_STEP_K}, or scales the engine cannot copy: moe_weight_only "
             "measured faster"),
)


def kernel_by_name(name: str, kernels: tuple[KernelSpec, ...] = GEMV_KERNELS) -> KernelSpec:
    """The spec of ``kernels`` called ``name``; ValueError naming ``kernel`` with the known names otherwise."""
    for spec in kernels:
        if spec.name == name:
            return spec
    names = ", ".join(repr(s.name) for s in kernels)
    raise ValueError(f"kernel: expected one of {names}, got {name!r}")


def _deferred(spec: KernelSpec, case: GemvCase | MoeCase, target: Target,
              kernels: tuple[KernelSpec, ...]) -> str | None:
    """Why ``spec`` leaves ``case`` to a later kernel of ``kernels`` by default (a :data:`DEFERRALS` rule), or
    None."""
    for rule in DEFERRALS:
        if rule.kernel == spec.name and rule.when(case, target) \
                and kernel_by_name(rule.to, kernels).refusal(case, target) is None:
            return rule.why
    return None


def choose_kernel(case: GemvCase | MoeCase, target: Target, kernel: str | None = None,
                  kernels: tuple[KernelSpec, ...] = GEMV_KERNELS) -> KernelSpec:
    """The first spec of ``kernels`` (:data:`GEMV_KERNELS`, or :data:`MOE_KERNELS` for a ``MoeCase``) that runs the
    case on the target and is not deferred, or the one named ``kernel`` (deferrals aside), if it runs the case;
    ValueError with every spec's reason otherwise."""
    if kernel is not None:
        spec = kernel_by_name(kernel, kernels)
        reason = spec.refusal(case, target)
        if reason is not None:
            raise ValueError(f"kernel: {kernel!r} cannot run {case.describe()} on {target.describe()}: {reason}")
        return spec
    reasons = []
    for spec in kernels:
        reason = spec.refusal(case, target)
        if reason is None:
            reason = _deferred(spec, case, target, kernels)
            if reason is None:
                return spec
        reasons.append(f"{spec.name}: {reason}")
    raise ValueError(f"no kernel runs {case.describe()} on {target.describe()} (" + "; ".join(reasons)
                     + "); backend='reference' computes it in float64")


# --- MoE routing (fp4gemv.moe_route): router logits to top-k ids and weights, one launch ---------------------------
# The table ``fp4gemv.route`` reads (``moe_route.RouteCase``): the kernel on CUDA, the float64 oracle elsewhere.

from .moe_route import MoeRoute  # noqa: E402
from .reference import RouteReference  # noqa: E402

ROUTE_KERNELS: tuple[KernelSpec, ...] = (MoeRoute(), RouteReference())
__all__ += ["ROUTE_KERNELS"]


# --- MoE combine (fp4gemv.moe_combine): the k weighted expert outputs of each token summed, one launch -------------
# The table ``fp4gemv.combine`` reads (``moe_combine.CombineCase``): the kernel on CUDA, the reference elsewhere.

from .moe_combine import MoeCombine  # noqa: E402
from .reference import CombineReference  # noqa: E402

COMBINE_KERNELS: tuple[KernelSpec, ...] = (MoeCombine(), CombineReference())
__all__ += ["COMBINE_KERNELS"]


# --- quantize and dequantize (fp4gemv.quantize, fp4gemv.dequantize) ------------------------------------------------
# The tables ``fp4gemv.quantize`` reads (``quantize.QuantizeCase`` / ``DequantizeCase``): the kernels where Triton
# runs, ``formats``' exact CPU path otherwise (and for float64 results, the exact value).

# A global scale chosen per call (global_scale="pow2") on a Triton target adds a first launch from
# QUANTIZE_AMAX_KERNELS (``amax.QuantizeAmax``: x's partial maxima, which the quantize kernel reduces).

from .amax import QuantizeAmax  # noqa: E402
from .quantize import Dequantize, Quantize  # noqa: E402
from .reference import DequantizeReference, QuantizeReference  # noqa: E402

QUANTIZE_KERNELS: tuple[KernelSpec, ...] = (Quantize(), QuantizeReference())
QUANTIZE_AMAX_KERNELS: tuple[KernelSpec, ...] = (QuantizeAmax(),)
DEQUANTIZE_KERNELS: tuple[KernelSpec, ...] = (Dequantize(), DequantizeReference())
__all__ += ["QUANTIZE_KERNELS", "QUANTIZE_AMAX_KERNELS", "DEQUANTIZE_KERNELS"]
