"""The Gluon names the warp-specialized kernels use, the same under every Triton this package supports (3.6 to 3.9).

Gluon (``triton.experimental.gluon``) moves between releases.  What differs for these kernels:

* the bulk tensor copy into shared memory is ``tma.async_copy_global_to_shared`` up to 3.7 and ``tma.async_load``
  from 3.8 (3.9 removes the old name): :data:`tma_load`;
* a shared-memory view as another dtype is ``_reinterpret(dtype, shape, layout)`` in 3.6 and
  ``reinterpret(dtype, shape, layout)`` in 3.9 (:data:`PUBLIC_REINTERPRET` says which; :func:`shared_view`, the one
  view the kernels take, branches on it as a constexpr), and tensor descriptors take 8-, 16- and 32-bit elements
  only from 3.9 (the kernels copy bytes and view them as int64);
* the CTA (or warp-specialize partition) barrier is ``gl.thread_barrier()`` in 3.6 and ``gl.barrier()`` in 3.9:
  :data:`thread_barrier`;
* ``gl.warp_specialize`` takes ``([(default, args), (worker, args), ...], worker_warps, worker_registers)`` in 3.6
  and 3.9 alike; its register list became optional in 3.9, which these kernels always pass.

Everything else they use (shared-memory descriptors, mbarriers, ``cp.async.mbarrier.arrive``, distributed layouts,
``inline_asm_elementwise``) is spelled alike.  ``tests/test_kernels_engine.py`` compiles the engine for sm_90 under
the installed Triton, which CI runs under both 3.6 and 3.9.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["gluon", "gl", "tma", "mbarrier", "async_copy", "tma_load", "thread_barrier", "TensorDescriptor",
           "PUBLIC_REINTERPRET", "shared_view", "ring_barriers"]

# The bulk copy global -> shared, completing on an mbarrier: (descriptor, coordinates, barrier, destination).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# A barrier of the calling partition's threads (the whole CTA outside warp_specialize).
thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# Whether shared-memory descriptors have the public ``reinterpret`` (3.9) rather than ``_reinterpret`` (3.6).
PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def shared_view(buf, DTYPE: gl.constexpr, SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
    """The shared-memory descriptor ``buf`` viewed as ``DTYPE`` ``SHAPE`` in ``LAYOUT`` (same bytes), under either
    spelling of the reinterpretation."""
    if PUBLIC_REINTERPRET:
        view = buf.reinterpret(DTYPE, SHAPE, LAYOUT)
    else:
        view = buf._reinterpret(DTYPE, SHAPE, LAYOUT)
    return view


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, READY: gl.constexpr, EMPTY: gl.constexpr):
    """A ring's mbarriers, initialized: ``ready`` (slot s complete after ``READY`` arrivals: the copies' expect, and
    any others) and ``empty`` (free again after ``EMPTY`` arrivals, e.g. every consumer thread), ``[STAGES, 1]``
    each."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=EMPTY)
    return ready, empty
