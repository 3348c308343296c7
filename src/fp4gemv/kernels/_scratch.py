"""Global scratch memory for in-kernel tensor descriptors (``tl.make_tensor_descriptor``), from torch.

Triton asks an allocator, kept per thread (a context variable), for 128 bytes per descriptor and program at each
launch; it has none by default.  The kernels that build descriptors install this one for the calling thread."""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

__all__ = ["install_scratch_allocator"]


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # torch's caching allocator returns 256-byte aligned blocks, more than Triton asks for (128 for descriptors).
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def install_scratch_allocator() -> None:
    """Give Triton this allocator unless the calling thread has one (a thread started later has none: its
    launches raise Triton's "no allocator was set" until it calls this, or ``triton.set_allocator``)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
