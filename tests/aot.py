"""Compiling kernels for sm_90 without a GPU, exactly as the JIT would for a real call (imported by the scripts
that the ``compile_for_sm90`` fixture runs in a fresh interpreter, where TRITON_INTERPRET is unset).

``sm90_launch`` asks the op layer what a call would launch on an sm_90 target (the kernel spec, its
configuration and its ``TritonLaunch``) and fills the pointer placeholders with the operands' tensors;
``compile_launch`` specializes that launch as the JIT does (types and divisibility by 16 from Triton's own
``native_specialize_impl``, integers equal to 1 made constants) and compiles it with Triton's bundled ptxas.
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

from fp4gemv import ops
from fp4gemv.kernels.spec import GemvOperands, fill_sources
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
        elif "D" in key:
            marked.append(j)
    for name in fn.arg_names[len(args):]:
        sig[name], const[name] = "constexpr", kw[name]
    attrs = {(j,): CUDABackend.parse_attr("D") for j in marked}
    return sig, const, attrs, [fn.arg_names[j] for j in marked]


class Sm90Launch:
    """What ``gemv(a, b, out=out, ...)`` launches on sm_90: ``spec``, ``config``, ``kernel`` (the JIT function),
    ``grid``, ``args`` (every parameter by name, tensors for pointers), ``options``."""

    def __init__(self, a, b, out=None, *, out_dtype=torch.float16, kernel=None, config=None):
        if out is None:
            out = torch.empty(ops.result_shape(a, b), dtype=out_dtype)
        operands = GemvOperands.of(a, b, out)
        case = operands.case
        self.spec = ops.choose_kernel(case, SM90, kernel)
        self.config = config if config is not None else self.spec.default_config(case, SM90)
        launch = self.spec.triton_launch(case, self.config, SM90)
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


def sass_instructions(compiled) -> list[str]:
    """The SASS instructions of a compiled kernel (cuobjdump), without addresses and encodings."""
    path = "/tmp/fp4gemv_aot_%d.cubin" % os.getpid()
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    os.remove(path)
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line and ";" in line]
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in lines]


def local_memory(compiled) -> list[str]:
    """Problems with local memory (spills, stack) in the PTX and, where cuobjdump is bundled, the cubin."""
    found = [w for w in ("ld.local", "st.local") if w in compiled.asm["ptx"]]
    if re.search(r"^\s*\.local\b", compiled.asm["ptx"], re.M):
        found.append(".local declaration")
    if os.path.exists(CUOBJDUMP):
        path = "/tmp/fp4gemv_aot_res_%d.cubin" % os.getpid()
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        os.remove(path)
        for key in ("LOCAL", "STACK"):
            value = re.search(key + r":(\d+)", usage)
            if value is None or int(value.group(1)):
                found.append(key + ":" + (value.group(1) if value else "?"))
    return found
