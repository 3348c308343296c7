"""A streaming read of a byte buffer: the speed-of-light baseline the GEMV kernels are measured against.

Each program xors its share of int64 words together and stores one word, so the compiler keeps every load
and the writes are negligible.
"""

import triton
import triton.language as tl

from ._common import l2_prefetch_rows


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n_words, WORDS: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False,
                       PREFETCH: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL:  # the same launch overlap the GEMV kernel gets (see w4a4.py)
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH:  # the program's whole chunk into L2 while the previous kernel finishes
            # (whole 16-byte units only: a bulk prefetch's size is a multiple of 16)
            l2_prefetch_rows(src_ptr, WORDS * STEPS * 8, pid, tl.num_programs(0), 0,
                             (n_words // 2) * 16 - pid * (WORDS * STEPS * 8), 1, WORDS * STEPS * 8, 32)
        tl.extra.cuda.gdc_wait()
    offs = pid * (WORDS * STEPS) + tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int64)
    for s in tl.static_range(STEPS):
        o = offs + s * WORDS
        acc ^= tl.load(src_ptr + o, mask=o < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))
