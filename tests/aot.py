"""Compiling kernels for sm_90 without a GPU, exactly as the JIT would for a real call (imported by the scripts
that the ``compile_for_sm90`` fixture runs in a fresh interpreter, where TRITON_INTERPRET is unset).

``Sm90Launch`` (``Sm90Launch.moe`` for ``moe_gemv``) asks the op layer what a call would launch on an sm_90 target
(the kernel spec, its configuration and its ``TritonLaunch``) and fills the pointer placeholders with the
operands' tensors; ``compile_launch`` specializes that launch as the JIT does (types and divisibility by 16 from
Triton's own ``native_specialize_impl``, integers equal to 1 made constants) and compiles it with Triton's bundled
ptxas.
"""

import os
import re
import subprocess

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from fp4gemv import moe, ops
from fp4gemv.kernels import choose_kernel
from fp4gemv.kernels.spec import TritonKernelSpec, fill_sources
from fp4gemv.ops import gemv_operands
from fp4gemv.target import SM90

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def jit_specialization(fn, args, kw):
    """(signature, constants, attrs, marked names) of ``fn(*args, **kw)`` as the JIT specializes it on a GPU:
    types and divisibility by 16 from Triton's own native_specialize_impl (integers equal to 1 become
    constants), the keyword constexprs as given."""
    sig, const, marked = {}, {}, []
    for j, (name, value) in enumerate(zip(fn.arg_names, args)):
        ty, key = native_specialize_impl(CUDABackend, value, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            const[name] = value
        elif key and "D" in key:
            marked.append(j)
    for name in fn.arg_names[len(args):]:
        sig[name], const[name] = "constexpr", kw[name]
    attrs = {(j,): CUDABackend.parse_attr("D") for j in marked}
    return sig, const, attrs, [fn.arg_names[j] for j in marked]


def compile_gluon_sm90(kernel, args, options):
    """A Gluon kernel compiled ahead of time for sm_90 on ``args`` (positional, as the launch passes them) and
    ``options`` (the launch's keyword constexprs, ``num_warps`` and ``maxnreg``)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    kw = {k: v for k, v in options.items() if k not in ("num_warps", "maxnreg")}
    sig, const, attrs, _ = jit_specialization(kernel, args, kw)
    return triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=options["num_warps"], maxnreg=options["maxnreg"]))


class Sm90Launch:
    """What ``gemv(a, b, out=out, ...)`` launches on sm_90 (``target``: SM90, PTX mode; its ``mode="triton"``
    twin for the pure-Triton paths): ``spec``, ``config``, ``kernel`` (the JIT function), ``grid``, ``args``
    (every parameter by name, tensors for pointers), ``options``."""

    def __init__(self, a, b, out=None, *, out_dtype=torch.float16, kernel=None, config=None, target=SM90):
        if out is None:
            out = torch.empty(ops.result_shape(a, b), dtype=out_dtype)
        operands = gemv_operands(a, b, out)
        case = operands.case
        spec = choose_kernel(case, target, kernel)
        config = config if config is not None else spec.default_config(case, target)
        launch = spec.triton_launch(case, config, target) if isinstance(spec, TritonKernelSpec) else None
        if launch is None:
            raise TypeError(f"kernel {spec.name!r} launches through its own launch() here, not one TritonLaunch")
        self._set(spec, config, launch, operands)

    @classmethod
    def moe(cls, w, x, expert_ids, *, bias=None, global_scales=None, out_dtype=torch.bfloat16, kernel=None,
            target=SM90, activation=None, pair_weights=None):
        """What ``moe_gemv(w, x, expert_ids, ...)`` launches on sm_90 (``moe.plan_moe`` on ``target``)."""
        alpha, limit = moe.epilogue_constants(activation, None, None)
        rows = w.shape[1] // 2 if activation else w.shape[1]
        out = torch.empty((*expert_ids.shape, rows), dtype=out_dtype)
        plan = moe.plan_moe(w, x, expert_ids, bias, global_scales, out, out_dtype, target, kernel,
                            activation=activation, alpha=alpha, limit=limit, pair_weights=pair_weights)
        self = cls.__new__(cls)
        self._set(plan.spec, plan.config, plan.spec.triton_launch(plan.case, plan.config, target),
                  moe.moe_operands(plan, w, x, expert_ids, bias, global_scales, out, pair_weights))
        return self

    @classmethod
    def route(cls, logits, top_k, *, weights="softmax_selected", ids_dtype=torch.int32, out_dtype=torch.float32,
              target=SM90):
        """What ``moe_route(logits, top_k, ...)`` launches on sm_90 (the first spec of ``ROUTE_KERNELS`` there)."""
        from fp4gemv.kernels import ROUTE_KERNELS
        from fp4gemv.kernels.moe_route import RouteOperands
        from fp4gemv.route import route_case

        case = route_case(logits, top_k, weights, ids_dtype, out_dtype)
        spec = choose_kernel(case, target, None, ROUTE_KERNELS)
        config = spec.default_config(case, target)
        shape = (logits.shape[0], top_k)
        operands = RouteOperands(case, logits, torch.empty(shape, dtype=ids_dtype),
                                 torch.empty(shape, dtype=out_dtype))
        self = cls.__new__(cls)
        self._set(spec, config, spec.triton_launch(case, config, target), operands)
        return self

    @classmethod
    def combine(cls, y, out_dtype=torch.bfloat16, target=SM90):
        """What ``moe_combine(y, out_dtype=...)`` launches on sm_90 (the first spec of ``COMBINE_KERNELS`` there)."""
        from fp4gemv.combine import combine_case
        from fp4gemv.kernels import COMBINE_KERNELS
        from fp4gemv.kernels.moe_combine import CombineOperands

        case = combine_case(y, out_dtype)
        spec = choose_kernel(case, target, None, COMBINE_KERNELS)
        config = spec.default_config(case, target)
        operands = CombineOperands(case, y, torch.empty((y.shape[0], y.shape[2]), dtype=out_dtype))
        self = cls.__new__(cls)
        self._set(spec, config, spec.triton_launch(case, config, target), operands)
        return self

    def _set(self, spec, config, launch, operands):
        self.spec, self.config = spec, config
        self.kernel, self.grid, self.options = launch.kernel, launch.grid, launch.options
        self.args = fill_sources(launch.args, operands)
        for p in self.kernel.params:
            self.args.setdefault(p.name, p.default)

    @property
    def constexprs(self):
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}

    def specialization(self):
        positional = [self.args[p.name] for p in self.kernel.params if not p.is_constexpr]
        return jit_specialization(self.kernel, positional, self.constexprs)

    def compile(self):
        sig, const, attrs, _ = self.specialization()
        return triton.compile(ASTSource(self.kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=self.options)


def _cuobjdump(compiled, flag: str) -> str:
    """cuobjdump ``flag`` (``--dump-sass``, ``-res-usage``) of a compiled kernel's cubin."""
    path = "/tmp/fp4gemv_aot_%d.cubin" % os.getpid()
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([CUOBJDUMP, flag, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def sass_instructions(compiled) -> list[str]:
    """The SASS instructions of a compiled kernel (cuobjdump), without addresses and encodings."""
    sass = _cuobjdump(compiled, "--dump-sass")
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line and ";" in line]
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in lines]


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def sass_listing(compiled) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of every SASS instruction (predicates dropped)."""
    out = []
    for line in _cuobjdump(compiled, "--dump-sass").splitlines():
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def main_loop(instrs: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the largest loop of a ``sass_listing``: a backward branch's target up to the branch."""
    best = []
    for i, (addr, op, rest) in enumerate(instrs):
        if op.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", rest)
            if target and int(target.group(1), 16) < addr:
                body = [x for x in instrs[:i + 1] if int(target.group(1), 16) <= x[0] <= addr]
                if len(body) > len(best):
                    best = body
    return best


def mma_loop(instrs: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The K loop of a ``sass_listing``: of the backward branches' bodies, the one with the most MMA instructions
    (the shortest such), for kernels whose largest loop is not the main one (a prologue or epilogue loop)."""
    best = None
    for addr, op, rest in instrs:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [x for x in instrs if int(target.group(1), 16) <= x[0] <= addr]
            key = (sum("MMA" in x[1] for x in body), -len(body))
            if best is None or key > best[0]:
                best = (key, body)
    return best[1]


def registers(compiled) -> int:
    """Registers per thread of a compiled kernel (cuobjdump's resource usage)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage")).group(1))


def local_memory(compiled) -> list[str]:
    """Problems with local memory (spills, stack) in the PTX and, where cuobjdump is bundled, the cubin."""
    found = [w for w in ("ld.local", "st.local") if w in compiled.asm["ptx"]]
    if re.search(r"^\s*\.local\b", compiled.asm["ptx"], re.M):
        found.append(".local declaration")
    if os.path.exists(CUOBJDUMP):
        usage = _cuobjdump(compiled, "-res-usage")
        for key in ("LOCAL", "STACK"):
            value = re.search(key + r":(\d+)", usage)
            if value is None or int(value.group(1)):
                found.append(key + ":" + (value.group(1) if value else "?"))
    return found
