"""Which implementation runs an op: the ``backend`` argument shared by ``ops.task_gemv`` and ``fp4gemv.gemv``."""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["Backend", "BACKENDS", "interpreting", "resolve_backend"]

Backend = Literal["auto", "triton-ptx", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton-ptx", "triton", "reference")


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' is the PTX-decode kernel on CUDA and the float64 reference elsewhere; never a silent fallback.

    Raises ValueError naming ``backend`` for an unknown name, 'triton-ptx' off CUDA (its decode is PTX) and
    'triton' off CUDA outside the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        return "triton-ptx" if device.type == "cuda" else "reference"
    if backend == "triton-ptx" and device.type != "cuda":
        raise ValueError(f"backend: 'triton-ptx' needs CUDA tensors (its decode is PTX), got device {device}")
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {device}")
    return backend
