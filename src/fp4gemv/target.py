"""What can run a GEMV here: the device's features, read once per device, and how kernels may run on it.

A :class:`Target` is what kernel specs (``kernels/``) look at to say whether they run and how to configure
themselves: the compute capability and SM count of a CUDA device, the features that follow from it (PDL, the
e4m3x2 conversion the tensor-core kernel needs, native FP4 MMA), and the ``backend`` the caller asked for
(Triton kernels with their PTX paths, their pure-Triton twins, or the float64 reference).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
import triton

__all__ = ["Backend", "BACKENDS", "Target", "device_target", "resolve_target", "interpreting", "SM90",
           "TRITON_VERSION", "KERNELS_INTERPRETED"]

# (major, minor) of the installed Triton: its code generation decides some kernels' source (kernels/stream.py's
# K order) and what their sm_90 machine code can be held to.
TRITON_VERSION: tuple[int, int] = tuple(int(part) for part in triton.__version__.split(".")[:2])

Backend = Literal["auto", "triton-ptx", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton-ptx", "triton", "reference")

# What runs: Triton kernels with their PTX paths, the same kernels with pure-Triton decode (also on CPU tensors
# under Triton's interpreter), or the float64 oracle.
Mode = Literal["ptx", "triton", "reference"]


# Triton reads TRITON_INTERPRET when a kernel is defined, and fp4gemv's kernels are defined when it is imported:
# the value at import decides whether they run in Triton's interpreter (and so can run on CPU tensors).
KERNELS_INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Target:
    """A device and the way kernels run on it.

    capability: ``(major, minor)`` of a CUDA device, None elsewhere.  sm_count: its multiprocessors (0
    elsewhere).  mode: ``"ptx"`` (Triton kernels, PTX paths), ``"triton"`` (pure-Triton paths; on a CPU
    target only under Triton's interpreter) or ``"reference"`` (the float64 oracle).
    """

    device_type: str
    capability: tuple[int, int] | None = None
    sm_count: int = 0
    mode: Mode = "reference"

    @property
    def runs_triton(self) -> bool:
        return self.mode != "reference"

    @property
    def interpreter(self) -> bool:
        """Triton kernels run in the interpreter (CPU tensors): no PTX, no launch options such as PDL."""
        return self.runs_triton and self.device_type != "cuda"

    def _at_least(self, major: int, minor: int) -> bool:
        return self.device_type == "cuda" and self.capability is not None and self.capability >= (major, minor)

    @property
    def bf16_arithmetic(self) -> bool:
        """bf16 products and dots compute with numbers.  Not in Triton's interpreter (3.6 to 3.9 alike): it hands
        bf16 tensors to NumPy as their uint16 bit patterns, so a bf16 product or ``tl.dot`` multiplies integers
        (a dot of unit-sized values comes out ~1e10 off); its conversions from and to bf16 are right.  Kernels
        compute such products in fp32 there, exact where the GPU's bf16 product is.  ``TRITON_INTERPRET=1``
        interprets every kernel, CUDA tensors' too."""
        return not (self.interpreter or KERNELS_INTERPRETED)

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (``griddepcontrol``): Triton kernels on sm_90 and newer (the
        interpreter has no launch overlap)."""
        return self.runs_triton and self._at_least(9, 0)

    @property
    def e4m3x2_cvt(self) -> bool:
        """``cvt.rn.f16x2.e4m3x2`` and Triton's fp8e4nv conversions: sm_89 and newer (CPU: the interpreter has
        them)."""
        return self._at_least(8, 9) or self.interpreter

    @property
    def bf16x2_mul(self) -> bool:
        """``mul.rn.bf16x2`` (the bf16 paths of the tensor-core kernels, hmma and weight_only): sm_90 and newer
        (CPU: the interpreter runs the pure-Triton twins)."""
        return self._at_least(9, 0) or self.interpreter

    @property
    def native_fp4_mma(self) -> bool:
        """Block-scaled FP4 tensor-core instructions (sm_100 and newer): no kernel of ours uses them yet
        (docs/targets.md says where one would plug in)."""
        return self._at_least(10, 0)

    def describe(self) -> str:
        if self.device_type == "cuda" and self.capability is not None:
            return f"cuda sm_{self.capability[0]}{self.capability[1]} ({self.sm_count} SMs), mode {self.mode}"
        return f"{self.device_type}, mode {self.mode}"


# sm_90 with 132 SMs (the H200 the configurations were measured on), PTX mode: for compiling and inspecting
# kernels ahead of time on a machine without the GPU.
SM90 = Target("cuda", (9, 0), 132, "ptx")


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def device_target(device: torch.device) -> Target:
    """The device's facts (read once per CUDA device and cached), mode ``"reference"``."""
    if device.type != "cuda":
        return Target(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability, sm_count = _cuda_facts(index)
    return Target("cuda", capability, sm_count)


def resolve_target(backend: str, device: torch.device) -> Target:
    """The target for ``backend`` on ``device``; never a silent fallback.

    ``"auto"``: Triton kernels with PTX on CUDA, the float64 reference elsewhere.  Raises ValueError naming
    ``backend`` for an unknown name, ``"triton-ptx"`` off CUDA (its decode is PTX) and ``"triton"`` off CUDA
    outside the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    target = device_target(device)
    if backend == "auto":
        return replace(target, mode="ptx") if device.type == "cuda" else target
    if backend == "triton-ptx":
        if device.type != "cuda":
            raise ValueError(f"backend: 'triton-ptx' needs CUDA tensors (its decode is PTX), got device {device}")
        return replace(target, mode="ptx")
    if backend == "triton":
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {device}")
        if device.type != "cuda" and not KERNELS_INTERPRETED:
            raise ValueError(f"backend: 'triton' on device {device} needs TRITON_INTERPRET=1 set before fp4gemv is "
                             f"imported (Triton reads it when the kernels are defined), but it was set afterwards: "
                             f"set it in the environment that starts Python")
        return replace(target, mode="triton")
    return target
