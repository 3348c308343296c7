"""A streaming read of a byte buffer: the speed-of-light baseline the GEMV kernels are measured against.

Each program xors its share of int64 words together and stores one word, so the compiler keeps every load
and the writes are negligible.
"""

import triton
import triton.language as tl


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n_words, WORDS: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL:  # the same launch overlap the GEMV kernel gets (see w4a4.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = pid * (WORDS * STEPS) + tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int64)
    for s in tl.static_range(STEPS):
        o = offs + s * WORDS
        acc ^= tl.load(src_ptr + o, mask=o < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))
