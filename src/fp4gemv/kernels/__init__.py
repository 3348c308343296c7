"""The GEMV kernels, in the order the dispatcher (``fp4gemv.ops``) tries them: the first whose ``why_not``
and ``why_not_default`` accept the case and the target runs.  A new kernel is one module with its spec and one
line here."""

from .gemm import Gemm
from .general import General
from .hmma_gemv import Hmma
from .reference import Reference
from .spec import KernelSpec
from .w4a4 import W4A4
from .weight_only import WeightOnly

__all__ = ["GEMV_KERNELS", "kernel_by_name"]

GEMV_KERNELS: tuple[KernelSpec, ...] = (Gemm(), W4A4(), WeightOnly(), Hmma(), General(), Reference())


def kernel_by_name(name: str) -> KernelSpec:
    """The spec called ``name``; ValueError naming ``kernel`` with the known names otherwise."""
    for spec in GEMV_KERNELS:
        if spec.name == name:
            return spec
    names = ", ".join(repr(s.name) for s in GEMV_KERNELS)
    raise ValueError(f"kernel: expected one of {names}, got {name!r}")
