"""The routed expert GEMV of a mixture-of-experts decode step: validate once, plan, launch through the kernel table.

:func:`moe_gemv` computes ``out[t, j] = W[expert_ids[t, j]] @ x[t] (+ bias[expert_ids[t, j]])`` for T tokens
and their top-k experts, reading each distinct expert's weights once (the kernels group the pairs on the GPU).
:func:`plan_moe` makes the :class:`spec.MoeCase` of the arguments and picks the first spec of
``kernels.MOE_KERNELS`` that runs it (``moe_engine``: the routed decode engine, NVFP4 and MXFP4 from T = 4 where
its rule allows, ``kernels.DEFERRALS``; ``moe_weight_only``: the tensor-core step of ``gemv``'s weight_only kernel;
``moe_general``: the CUDA-core fallback; ``moe_reference``: float64).  Validation raises ``TypeError``
(type, dtype) or ``ValueError`` (shape, device, values) naming the argument, the expected and the actual, before
anything is written.

Host time: the kept launch.  An eager decode step calls moe_gemv with new tensors of the same metadata every
token, and validating, planning (``plan_moe``: the case, the kernel table, the config) and Triton's JIT dispatch
on every call made it host-bound.  So, as ``ops.gemv`` does, the first call of a metadata validates in full and
plans, and the plan is kept (:class:`PreparedMoe`, in ``ops``' cache of prepared calls: ``ops.clear_cache``
forgets it) under a key of everything validation and the plan read (``_key_and_addresses``).  A later call of
that metadata builds the key, then does only what each call must: out apart from the inputs (new addresses),
``check_ids`` (a sync; skipped under capture) and ``check_values`` when asked, x's copy where the plan reads one,
out's allocation, the no-backward wrapper in grad mode.  On CUDA with Triton 3.6 it then calls the compiled
kernel's launcher with the operands' addresses on the current stream (``ops.KeptLaunch``, also inside
``torch.cuda.graph``); elsewhere the kept launch goes through the JIT, and specs without a single Triton launch
(``moe_general`` with an epilogue, the reference) run ``spec.launch``, still not planned again.  ``prepare_moe`` returns
the kept call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import formats
from .formats import dtype_names as _names
from .kernels import MOE_KERNELS, choose_kernel
from .kernels.moe_gemv import MAX_PAIRS
from .kernels.spec import DIRECT_LAUNCH, KernelSpec, MoeCase, MoeOperands
from .reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, MOE_ACTIVATIONS
from .ops import (ACTIVATION_DTYPES, OUT_DTYPES, KeptLaunch, _extent, _may_share, _needs_copy,
                  check_apart, check_out, gemv_operands, keep_call, kept_call, without_backward)
from .ops import refuse_gradients as _refuse_gradients
from .target import Backend, Target, interpreting, resolve_target
from .tensor import FP4Tensor, check_device_with_values

__all__ = ["moe_gemv", "prepare_moe", "PreparedMoe", "check_moe_arguments", "check_expert_ids", "plan_moe",
           "MoePlan", "moe_operands", "moe_inputs", "ID_DTYPES", "BIAS_DTYPES"]

ID_DTYPES = (torch.int32, torch.int64)
BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PAIR_WEIGHT_DTYPES = BIAS_DTYPES


def _check_tensor(name: str, t: object, dtypes, dims: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like w, got {t.device}")


def epilogue_constants(activation, alpha, limit) -> tuple[float, float]:
    """(alpha, limit) of ``activation``: the given ones, or gpt-oss's (``reference.GPT_OSS_ALPHA``, ``_LIMIT``)
    when None; ValueError naming the argument for an unknown activation or constants it does not take."""
    if activation is not None and activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
    if activation != "gpt-oss":
        for name, value in (("alpha", alpha), ("limit", limit)):
            if value is not None:
                raise ValueError(f"{name}: expected None (only the 'gpt-oss' activation takes it), got {value!r} "
                                 f"with activation {activation!r}")
        return 0.0, 0.0
    alpha = GPT_OSS_ALPHA if alpha is None else alpha
    limit = GPT_OSS_LIMIT if limit is None else limit
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
            raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return float(alpha), float(limit)


def check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype, *, activation=None, alpha=None,
                        limit=None, pair_weights=None) -> tuple[tuple[int, int, int], torch.dtype, float, float]:
    """The checks of :func:`moe_gemv` that read metadata only (eager calls and ``torch.compile`` share them),
    the activation's first (``epilogue_constants``): the result's shape ``(T, k, M)`` (``M / 2`` with an
    activation) and dtype, and the activation's alpha and limit."""
    alpha, limit = epilogue_constants(activation, alpha, limit)
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor [E, M, K] (see fp4gemv.quantize), got {type(w).__name__}")
    if w.ndim != 3:
        raise ValueError(f"w: expected an FP4Tensor [E, M, K] (one matrix per expert), got shape {tuple(w.shape)}")
    experts, m, k = w.shape
    device = w.device
    check_device_with_values("w", device)
    _check_tensor("x", x, ACTIVATION_DTYPES, 2, device)
    if x.shape[1] != k:
        raise ValueError(f"x: expected [T, K] with K = {k} like w, got shape {tuple(x.shape)}")
    _check_tensor("expert_ids", expert_ids, ID_DTYPES, 2, device)
    tokens, top_k = expert_ids.shape
    if tokens != x.shape[0] or top_k < 1:
        raise ValueError(f"expert_ids: expected [T, k] with T = {x.shape[0]} tokens like x and k >= 1, got shape "
                         f"{tuple(expert_ids.shape)}")
    if not 1 <= tokens * top_k <= MAX_PAIRS:
        raise ValueError(f"expert_ids: expected 1 to {MAX_PAIRS} (token, expert) pairs T * k, got {tokens * top_k}")
    if bias is not None:
        _check_tensor("bias", bias, BIAS_DTYPES, 2, device)
        if tuple(bias.shape) != (experts, m):
            raise ValueError(f"bias: expected shape [E, M] = {(experts, m)}, got {tuple(bias.shape)}")
    if activation is not None and m % 2:
        raise ValueError(f"w: expected an even number of rows M (gate and up) with activation {activation!r}, "
                         f"got shape {tuple(w.shape)}")
    if global_scales is not None:
        two = isinstance(global_scales, torch.Tensor) and global_scales.dim() == 2  # [E, 2]: the shape check says
        _check_tensor("global_scales", global_scales, (torch.float32,), 2 if two else 1, device)
        want = ((experts,), (experts, 2)) if activation is not None else ((experts,),)
        if tuple(global_scales.shape) not in want:
            shapes = f"[E] = [{experts}] or [E, 2] = [{experts}, 2] (gate's, up's)" if activation is not None \
                else f"[E] = [{experts}] ([E, 2] only with an activation)"
            raise ValueError(f"global_scales: expected one per expert, {shapes}, got {tuple(global_scales.shape)}")
        if w.global_scale is not None:
            raise ValueError("global_scales: expected None when w has a global scale (one or the other), got both")
    if out_dtype is None:
        out_dtype = x.dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected {_names(OUT_DTYPES)}, got {out_dtype}")
    if pair_weights is not None:
        _check_tensor("pair_weights", pair_weights, PAIR_WEIGHT_DTYPES, 2, device)
        if tuple(pair_weights.shape) != (tokens, top_k):
            raise ValueError(f"pair_weights: expected [T, k] = {(tokens, top_k)} like expert_ids, got "
                             f"{tuple(pair_weights.shape)}")
    shape = (tokens, top_k, m // 2 if activation is not None else m)
    if out is not None:
        check_out(out, shape, out_dtype, device, shape_name="[T, k, M / 2] = " if activation else "[T, k, M] = ",
                  owner="w", inputs=moe_inputs(w, x, expert_ids, bias, global_scales, pair_weights))
    return shape, out_dtype, alpha, limit


def moe_inputs(w, x, expert_ids, bias, global_scales, pair_weights):
    """The tensors :func:`moe_gemv` reads, by the names errors give them (``(name, tensor or None)`` pairs)."""
    return (("w.data", w.data), ("w.scales", w.scales), ("w.global_scale", w.global_scale), ("x", x),
            ("expert_ids", expert_ids), ("bias", bias), ("global_scales", global_scales),
            ("pair_weights", pair_weights))


def check_expert_ids(expert_ids: torch.Tensor, experts: int) -> None:
    """ValueError naming ``expert_ids`` when one lies outside ``[0, experts)`` (reads the values: a sync on CUDA)."""
    bad = (expert_ids < 0) | (expert_ids >= experts)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"expert_ids: expected ids in [0, {experts}), got {int(expert_ids[tuple(where)])} at "
                         f"{tuple(where)}")


class MoePlan(NamedTuple):
    """What :func:`moe_gemv` runs for one metadata: the kernel spec of ``kernels.MOE_KERNELS`` and its
    configuration, the target, the case, and whether x is read from a contiguous copy."""

    spec: KernelSpec
    config: object
    target: Target
    case: MoeCase
    copy_x: bool


def moe_case(w: FP4Tensor, x: torch.Tensor, expert_ids: torch.Tensor, bias, global_scales, out_dtype: torch.dtype,
             out_strides: tuple[int, int, int], activation=None, alpha=0.0, limit=0.0,
             pair_weights=None) -> MoeCase:
    """The :class:`spec.MoeCase` of checked operands (x as the kernel reads it; alpha and limit as
    ``epilogue_constants`` gives them)."""
    experts, m, _ = w.shape
    tokens, top_k = expert_ids.shape
    dense = gemv_operands(w, x, torch.empty((experts, m, tokens), dtype=out_dtype, device="meta")).case
    half_stride = 0
    if global_scales is not None:
        kind, stride = "expert", global_scales.stride(0)
        if global_scales.dim() == 2:  # [E, 2]: gate's and up's (stride 0 when expanded: the same scale)
            half_stride = global_scales.stride(1)
    else:
        kind, stride = ("tensor" if w.global_scale is not None else None), 0
    return MoeCase(dense=dense, experts=experts, tokens=tokens, top_k=top_k, ids_dtype=expert_ids.dtype,
                   ids_strides=tuple(expert_ids.stride()), bias_dtype=None if bias is None else bias.dtype,
                   bias_strides=(0, 0) if bias is None else tuple(bias.stride()), global_scales=kind,
                   global_scales_stride=stride, out_strides=out_strides, global_scales_half_stride=half_stride,
                   activation=activation, alpha=alpha, limit=limit,
                   pair_weights_dtype=None if pair_weights is None else pair_weights.dtype,
                   pair_weights_strides=(0, 0) if pair_weights is None else tuple(pair_weights.stride()))


def plan_moe(w, x, expert_ids, bias, global_scales, out, out_dtype, target: Target, kernel: str | None = None,
             config=None, *, activation=None, alpha=0.0, limit=0.0, pair_weights=None) -> MoePlan:
    """The plan of checked arguments (``check_moe_arguments``; alpha and limit as ``epilogue_constants`` gives
    them) on ``target``; ValueError naming ``kernel`` when no spec (or not the one named) runs the case,
    TypeError / ValueError naming ``config`` for a bad config."""
    copy_x = target.runs_triton and _needs_copy(x)
    if copy_x:
        x = x.contiguous()
    tokens, top_k = expert_ids.shape
    m = w.shape[1] // 2 if activation is not None else w.shape[1]
    out_strides = tuple(out.stride()) if out is not None else (top_k * m, m, 1)
    case = moe_case(w, x, expert_ids, bias, global_scales, out_dtype, out_strides, activation, alpha, limit,
                    pair_weights)
    spec = choose_kernel(case, target, kernel, MOE_KERNELS)
    return MoePlan(spec, spec.resolve_config(config, case, target), target, case, copy_x)


def moe_operands(plan: MoePlan, w, x, expert_ids, bias, global_scales, out, pair_weights=None) -> MoeOperands:
    """The tensors a plan's launch reads (x copied when the plan says so)."""
    if plan.copy_x:
        x = x.contiguous()
    if plan.case.global_scales == "tensor":  # w's one scale: every expert reads it (stride 0)
        global_scales = w.global_scale.reshape(1)
    return MoeOperands(plan.case, w.data, w.scales, global_scales, x, expert_ids, bias, out, pair_weights)


def moe_gemv(
    w: FP4Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    global_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
    check_ids: bool = True,
    check_values: bool = False,
    kernel: str | None = None,
    config=None,
    activation: str | None = None,
    alpha: float | None = None,
    limit: float | None = None,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t, j] = W[expert_ids[t, j]] @ x[t] (+ bias[expert_ids[t, j]])``: T tokens through their k experts,
    optionally through an expert MLP's activation and times the routing weights, in the same launch.

    w: FP4Tensor ``[E, M, K]`` (NVFP4 or MXFP4, either scale layout), data rows contiguous; its global scale,
        when it has one, is one for all experts.
    x: ``[T, K]`` float16, bfloat16 or float32, any strides (Triton kernels read a contiguous copy unless it is
        contiguous along K with 16-byte aligned rows).
    expert_ids: ``[T, k]`` int32 or int64, any strides; 1 <= T * k <= 1024.  Each distinct expert's weights are
        read once per call when every group has at most 16 pairs (top-k ids are distinct per token, so T <= 16).
    bias: optional ``[E, M]`` float16, bfloat16 or float32, added in fp32 before the one rounding.
    global_scales: optional ``[E]`` float32, one global scale per expert (NVFP4 MoE checkpoints), or with an
        ``activation`` ``[E, 2]``: gate's and up's (their checkpoints store them apart); not together with w's
        own global scale.
    out: written and returned when given: ``[T, k, M]`` (``[T, k, M / 2]`` with an activation), ``out_dtype``,
        w's device, any strides that give each element memory of its own, sharing none with an input.
    out_dtype: float16, bfloat16 or float32; None: x's dtype.
    backend: as :func:`fp4gemv.gemv` (``"auto"``: the Triton kernel on CUDA, the float64 reference elsewhere;
        ``"triton"`` runs the kernel in the interpreter on CPU tensors).
    check_ids: read the ids and raise ValueError naming ``expert_ids`` when one lies outside ``[0, E)``, before
        anything is written (on CUDA a sync; skipped while a CUDA graph is captured).  With False, or under
        CUDA-graph capture and ``torch.compile``, such a pair's output is zeros and no memory outside the
        operands is touched.
    check_values: read ``global_scales`` and raise ValueError naming it unless each is a positive normal float32
        (``formats.check_global_scales``, the check of ``FP4Tensor`` and ``quantize``), before anything is
        written.  Off by default, like ``FP4Tensor``'s check of a tensor global scale: reading the values
        synchronises the device, and per-expert scales are weights, best checked once when loaded
        (``nn.FP4Experts`` does).  Unchecked, a 0, negative, NaN or infinite scale multiplies that expert's
        outputs as it is.
    kernel: None (the first spec of ``kernels.MOE_KERNELS`` that runs the case) or a spec's name, which must run
        it (``plan_moe(...).spec`` says which runs).
    config: None (the spec's default) or an instance of its config class.
    activation: None, or w's M rows are gate and up and each pair's result is the gated activation
        (``reference.MOE_ACTIVATIONS``, ``reference.moe_activation``): ``"gpt-oss"`` (rows 2i and 2i + 1;
        ``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)``, alpha and limit
        default to gpt-oss's 1.702 and 7.0) or ``"silu"`` (rows i and M/2 + i; ``silu(g) * u``), of the fp32
        gate and up (global scales and bias applied), computed in fp32.
    pair_weights: optional ``[T, k]`` float16, bfloat16 or float32: each pair's result (after the activation)
        times its routing weight, in fp32.

    Inference only: no backward.  In grad mode with an ``x``, ``bias`` or ``global_scales`` that requires grad the
    result is still computed, and a backward through it raises RuntimeError saying so (every backend); under
    ``torch.compile``, which would trace that backward, such an input is refused up front (ValueError naming it).

    Arithmetic: exact weight-activation products (fp16/bf16), accumulated in fp32 (``moe_weight_only``: every
    product in one accumulation on the tensor cores, with weight_only's bf16 window 2^-70 <= |x| < 2^64 in its
    k32 and split modes; ``moe_general``: fp32 block sums), the global scale and the bias applied in fp32, one
    rounding to ``out_dtype`` (the bound of the spec's ``error_model``, one fp32 addition more for the bias).
    The activation and the pair weight follow in fp32 (``reference.routed_epilogue`` is the float64 oracle), before
    that one rounding.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("moe_gemv: under torch.compile call fp4gemv.moe_gemv (fp4gemv.library.moe_gemv), "
                           "which traces the custom op torch.ops.fp4gemv.moe_gemv")
    key, addresses = _key_and_addresses(w, x, expert_ids, bias, global_scales, out, pair_weights,
                                        (out_dtype, backend, kernel, config, activation, alpha, limit))
    call = kept_call(key)
    if call is not None:
        return call._checked_run(w, x, expert_ids, bias, global_scales, out, pair_weights, addresses, check_ids,
                                 check_values)
    call, x_read = _plan_call(w, x, expert_ids, bias, global_scales, out, out_dtype, backend, kernel, config,
                              activation, alpha, limit, pair_weights, check_ids, check_values)
    keep_call(key, call)
    return call._run(w, x, expert_ids, bias, global_scales, out, pair_weights, addresses, x_read)


NO_BACKWARD = ("moe_gemv has no backward (inference only): x, bias, global_scales and pair_weights get no gradient "
               "through it; call it under torch.no_grad(), or detach them")


def refuse_gradients(x, bias, global_scales, pair_weights=None) -> None:
    """``ops.refuse_gradients`` of moe_gemv's float inputs."""
    _refuse_gradients((("x", x), ("bias", bias), ("global_scales", global_scales), ("pair_weights", pair_weights)),
                      NO_BACKWARD)


# --- prepared calls ----------------------------------------------------------------------------------------------

# MoeOperands' tensors by name -> their index in a call's addresses (MoeOperands' order, case left out).
_FIELDS = {name: i for i, name in enumerate(MoeOperands._fields[1:])}
_X, _OUT = _FIELDS["x"], _FIELDS["out"]


def _key_and_addresses(w, x, expert_ids, bias, global_scales, out, pair_weights,
                       settings: tuple) -> tuple[tuple | None, tuple | None]:
    """Everything :func:`moe_gemv`'s validation and plan depend on, and the operands' addresses in ``_FIELDS``'
    order (0 where absent; out's 0 when not given); (None, None) where validation must look (w not an
    FP4Tensor, an argument that is neither a tensor nor None, a tensor without strides or address).

    Keyed: w's format, layout, code order, data shape and strides, scale strides (their shape follows, ``ops``' key
    says why), whether it has a global scale; each other tensor's dtype, shape, strides and device (on CUDA its index,
    where the current device is keyed too) or None; the alignment (address mod 16) of every address, which the
    plan's alignments and Triton's specialization read; ``settings`` (out_dtype, backend, kernel, config,
    activation, alpha, limit), each with its type (validation refuses a bool alpha, a plain tuple config, which
    compare equal to accepted ones)."""
    if type(w) is not FP4Tensor:
        return None, None
    try:
        wd, ws, wg = w.data, w.scales, w.global_scale
        device = wd.device
        cuda = device.type == "cuda"
        pw, ps, pg = wd.data_ptr(), ws.data_ptr(), 0 if wg is None else wg.data_ptr()
        parts, pointers = [], []
        for t in (x, expert_ids, bias, global_scales, out, pair_weights):
            if t is None:
                parts.append(None)
                pointers.append(0)
            elif isinstance(t, torch.Tensor):
                p = t.data_ptr()
                parts.append((t.dtype, t.shape, t.stride(), t.get_device() if cuda else t.device, p & 15))
                pointers.append(p)
            else:
                return None, None
    except Exception:  # sparse and other tensors without strides or storage: validation says what it says
        return None, None
    px, pi, pb, pgs, po, pp = pointers
    where = torch.cuda.current_device() if cuda else interpreting()
    key = ("moe", w.fmt, w.scale_layout, w.code_order, wd.shape, wd.stride(), ws.stride(), wg is None, device,
           pw & 15, ps & 15, pg & 15, *parts, settings, tuple(map(type, settings)), where)
    return key, (pw, ps, pg if global_scales is None else pgs, px, pi, pb, po, pp)  # _operand_tensors' order


def _operand_tensors(w, x, expert_ids, bias, global_scales, out, pair_weights) -> tuple:
    """The tensors of a call in ``_FIELDS``' order (global_scales: the given ones, else w's global scale)."""
    return (w.data, w.scales, w.global_scale if global_scales is None else global_scales, x, expert_ids, bias, out,
            pair_weights)


def _plan_call(w, x, expert_ids, bias, global_scales, out, out_dtype, backend, kernel, config, activation, alpha,
               limit, pair_weights, check_ids: bool, check_values: bool):
    """Validate :func:`moe_gemv`'s arguments (every check, ids and values when asked), plan: the new
    :class:`PreparedMoe` and x as its first launch reads it (copied when the plan says so)."""
    shape, out_dtype, alpha, limit = check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype,
                                                         activation=activation, alpha=alpha, limit=limit,
                                                         pair_weights=pair_weights)
    device = w.device
    target = resolve_target(backend, device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_ids and not capturing:
        check_expert_ids(expert_ids, w.shape[0])
    if check_values and global_scales is not None:
        formats.check_global_scales(global_scales, "global_scales")
    copy_x = target.runs_triton and _needs_copy(x)
    x_read = x.contiguous() if copy_x else x  # one copy, for the plan and launch
    plan = plan_moe(w, x_read, expert_ids, bias, global_scales, out, out_dtype, target, kernel, config,
                    activation=activation, alpha=alpha, limit=limit, pair_weights=pair_weights)
    extents = tuple(0 if t is None else _extent(t)
                    for t in _operand_tensors(w, x, expert_ids, bias, global_scales, out, pair_weights))
    return PreparedMoe(plan, copy_x, shape, device, extents), x_read


class PreparedMoe(KeptLaunch):
    """:func:`moe_gemv` planned for one metadata (``prepare_moe`` returns it; ``moe_gemv`` keeps it in
    ``ops``' cache): called with new operands of that metadata it checks only what a call must (out apart from
    the inputs, the ids and global scales when asked), copies x when the plan says so, allocates out when none
    is given, and launches the kept plan.

    A spec with a ``triton_launch`` runs it through Triton's JIT on the first call; on CUDA (with Triton 3.6)
    later calls launch the compiled kernel on the operands' addresses (``ops.KeptLaunch``),
    :attr:`launches_by_address` then True.  Other specs (``moe_general`` with an epilogue, two steps; the
    reference) run ``spec.launch`` on every call, with the plan kept."""

    __slots__ = ("plan", "copy_x", "shape", "device", "extents", "_cuda")

    def __init__(self, plan: MoePlan, copy_x: bool, shape: tuple[int, int, int], device: torch.device,
                 extents: tuple[int, ...], direct_launch: bool = DIRECT_LAUNCH):
        cuda = device.type == "cuda"
        # The JIT launches on the current device's stream: so does the kept launch (that device is keyed).
        super().__init__(plan, _FIELDS, torch.device("cuda", torch.cuda.current_device()) if cuda else device,
                         direct_launch)
        self.plan, self.copy_x, self.shape, self.device, self.extents = plan, copy_x, shape, device, extents
        self._cuda = cuda

    def __call__(self, w: FP4Tensor, x: torch.Tensor, expert_ids: torch.Tensor, *, bias=None, global_scales=None,
                 out=None, pair_weights=None, check_ids: bool = True, check_values: bool = False) -> torch.Tensor:
        """``moe_gemv`` (same meaning) with this plan, for arguments of its metadata (not checked again)."""
        addresses = tuple(0 if t is None else t.data_ptr()
                          for t in _operand_tensors(w, x, expert_ids, bias, global_scales, out, pair_weights))
        return self._checked_run(w, x, expert_ids, bias, global_scales, out, pair_weights, addresses, check_ids,
                                 check_values)

    def _checked_run(self, w, x, expert_ids, bias, global_scales, out, pair_weights, addresses, check_ids,
                     check_values) -> torch.Tensor:
        """The checks of a call (moe_gemv's order: out apart from the inputs, ids, global scales), then the run."""
        if out is not None and _may_share(addresses, self.extents, _OUT):
            check_apart(out, moe_inputs(w, x, expert_ids, bias, global_scales, pair_weights))
        if check_ids and not (self._cuda and torch.cuda.is_current_stream_capturing()):
            check_expert_ids(expert_ids, self.plan.case.experts)
        if check_values and global_scales is not None:
            formats.check_global_scales(global_scales, "global_scales")
        return self._run(w, x, expert_ids, bias, global_scales, out, pair_weights, addresses)

    def _run(self, w, x, expert_ids, bias, global_scales, out, pair_weights, addresses,
             x_read=None) -> torch.Tensor:
        """Launch on checked operands (``x_read``: x as read, when the caller has made it already)."""
        plan = self.plan
        if x_read is None:
            x_read = x.contiguous() if self.copy_x else x
        if out is None:
            out = torch.empty(self.shape, dtype=plan.case.dense.out_dtype, device=self.device)
        if self._compiled is not None:
            self._launch((*addresses[:_X], x_read.data_ptr(), *addresses[_X + 1:_OUT], out.data_ptr(),
                          *addresses[_OUT + 1:]))
        else:
            operands = moe_operands(plan, w, x_read, expert_ids, bias, global_scales, out, pair_weights)
            if self._template is not None:
                self._launch_jit(operands)
            else:
                with torch.no_grad():  # no autograd graph on any backend (inference only, moe_gemv's docstring)
                    plan.spec.launch(operands, plan.config, plan.target)
        return without_backward(out, (x, bias, global_scales, pair_weights), NO_BACKWARD)


def prepare_moe(w: FP4Tensor, x: torch.Tensor, expert_ids: torch.Tensor, *, bias=None, global_scales=None, out=None,
                out_dtype=None, backend: Backend = "auto", kernel=None, config=None, activation=None, alpha=None,
                limit=None, pair_weights=None) -> PreparedMoe:
    """The :class:`PreparedMoe` :func:`moe_gemv` runs for these arguments (same meaning): validated and planned
    when their metadata is new (ids and values not read), else the one kept; raises as moe_gemv does."""
    key, _ = _key_and_addresses(w, x, expert_ids, bias, global_scales, out, pair_weights,
                                (out_dtype, backend, kernel, config, activation, alpha, limit))
    call = kept_call(key)
    if call is None:
        call, _ = _plan_call(w, x, expert_ids, bias, global_scales, out, out_dtype, backend, kernel, config,
                             activation, alpha, limit, pair_weights, False, False)
        keep_call(key, call)
    return call
