"""In-kernel e2m1 decode and 16-element block dot products, in pure Triton and in PTX.

Numbers are handled as "doubled integers": 2 * e2m1 is an integer in [-12, 12], so the product of two
doubled operands is 4 * a * b, an integer, and a block of 16 such products sums exactly in int32
(|sum| <= 16 * 144).  Both variants below return that exact block sum as float32, so the rest of the
kernel (scaling, fp32 accumulation, the final reduction) is shared code and the two paths agree bit for bit.

A 16-element block is one int64: packed byte i holds elements 2i (low nibble) and 2i+1 (high nibble).
"""

import triton
import triton.language as tl

from ..formats import CODE_ORDERS

# Doubled e2m1 magnitudes 0,1,2,3,4,6,8,12 as the byte table prmt indexes: bytes 0..3 and 4..7.  Kernels
# take the two words as runtime arguments and pass them to the PTX below as register operands: written as
# constants inside each asm block, ptxas copied the low word into a fresh register before every prmt (one
# extra instruction per prmt; docs/performance.md, the section on 2-byte scale loads, small K steps and PDL).
MAG_TABLE = (0x03020100, 0x0C080604)
# float32 1.5 * 2^23: adding a small int32 to its bits adds that integer to its value.
_MAGIC_F32_BITS = 0x4B400000


# The 32-bit halves of a block: selector words w (elements 0-3 in bits 0-15; s = w >> 16 for elements 4-7)
# and their sign-flipped twins x = w ^ 0x88888888, for the two words of an int64 block.
_SPLIT_WORDS_PTX = """
        xor.b32 x0, w0, 0x88888888;
        xor.b32 x1, w1, 0x88888888;
        shr.u32 s0, w0, 16;
        shr.u32 s1, w1, 16;
        shr.u32 sx0, x0, 16;
        shr.u32 sx1, x1, 16;"""
# (selector of the magnitudes, selector of the negated elements) for each group of 4 elements, in order.
_SELECTORS = (("w0", "x0"), ("s0", "sx0"), ("w1", "x1"), ("s1", "sx1"))

_ACTIVATION_BYTES_PTX = tl.constexpr(
    """{
        .reg .b32 w0, w1, x0, x1, s0, s1, sx0, sx1, p, n, r0, r1, r2, r3;
        mov.b64 {w0, w1}, $2;"""
    + _SPLIT_WORDS_PTX
    + "".join(
        f"""
        prmt.b32 p, $3, $4, {pos};
        prmt.b32 n, $3, $4, {neg};
        or.b32 p, p, 0x80808080;
        sub.u32 p, p, n;
        xor.b32 r{i}, p, 0x80808080;"""
        for i, (pos, neg) in enumerate(_SELECTORS)
    )
    + """
        mov.b64 $0, {r0, r1};
        mov.b64 $1, {r2, r3};
        }"""
)

_BLOCK_DOT_PTX = tl.constexpr(
    """{
        .reg .b32 w0, w1, x0, x1, s0, s1, sx0, sx1, p, accp, accn;
        .reg .b32 b0, b1, b2, b3;
        .reg .f32 f;
        mov.b64 {w0, w1}, $1;
        mov.b64 {b0, b1}, $2;
        mov.b64 {b2, b3}, $3;"""
    + f"""
        mov.b32 accp, {_MAGIC_F32_BITS:#010x};
        mov.b32 accn, 0;"""
    + _SPLIT_WORDS_PTX
    + "".join(
        f"""
        prmt.b32 p, $4, $5, {sel};
        dp4a.s32.s32 {acc}, p, b{i}, {acc};"""
        for column, acc in ((0, "accp"), (1, "accn"))
        for i, sel in enumerate(s[column] for s in _SELECTORS)
    )
    + f"""
        sub.s32 accp, accp, accn;
        mov.b32 f, accp;
        sub.f32 $0, f, 0f{_MAGIC_F32_BITS:08X};
        }}"""
)


@triton.jit
def doubled_e2m1(code):
    """2 * value of e2m1 codes 0..15 (any integer dtype): 0,1,2,3,4,6,8,12 and their negatives."""
    mag = code & 7
    exp = mag >> 1
    man = mag & 1
    # exp 0 is subnormal (0 or 0.5 -> 0 or 1); otherwise (2 + man) << (exp - 1).
    dbl = tl.where(exp == 0, man, (2 + man) << tl.maximum(exp - 1, 0))
    return tl.where((code & 8) != 0, -dbl, dbl)


@triton.jit
def native_codes(bits, i):
    """Codes ``i`` (element order) of ``bits`` (a word or block, broadcast against ``i``) in the native code order:
    code j = i % 4 of half-word i // 4 has its magnitude's lowest bit and its sign at ``formats.NATIVE_CODE_FIELDS[j]``
    = (6, 15), (3, 12), (0, 14), (9, 13)."""
    j = i % 4
    base = 16 * (i // 4)
    mag_bit = base + tl.where(j == 0, 6, tl.where(j == 1, 3, tl.where(j == 2, 0, 9)))
    sign_bit = base + tl.where(j == 0, 15, tl.where(j == 1, 12, tl.where(j == 2, 14, 13)))
    return ((bits >> mag_bit) & 7) | (((bits >> sign_bit) & 1) << 3)


@triton.jit
def ordered_codes(bits, i, ORDER: tl.constexpr):
    """Codes ``i`` (K order) of ``bits`` (a word or block, broadcast against ``i``) in code order ``ORDER``
    (``code_order_index``: 0 the checkpoint's, code i at bits 4i; 1 the native bit fields; 2 the paired order,
    the native fields with K element k of each 32-bit word in its slot 4 (k % 2) + (k % 8) // 2,
    ``formats.PAIRED_SLOTS``)."""
    if ORDER == 0:
        return (bits >> (4 * i)) & 15
    if ORDER == 1:
        return native_codes(bits, i)
    return native_codes(bits, 8 * (i // 8) + 4 * (i % 2) + (i % 8) // 2)


def code_order_index(order: str) -> int:
    """The ``ORDER`` constexpr of ``ordered_codes`` for a ``formats.CODE_ORDERS`` name."""
    return CODE_ORDERS.index(order)


@triton.jit
def e2m1_word_values(words, ORDER: tl.constexpr = 0):
    """int32 words of 8 e2m1 codes ``[...]`` to their values ``[..., 8]`` in float32 (K order; the codes in order
    ``ORDER``, ``ordered_codes``)."""
    w = tl.expand_dims(words, len(words.shape))
    return doubled_e2m1(ordered_codes(w, tl.arange(0, 8), ORDER)).to(tl.float32) * 0.5


@triton.jit
def unpack_block(packed, ORDER: tl.constexpr = 0):
    """One int64 block ``[...]`` to its 16 e2m1 codes ``[..., 16]`` (K order; the codes in order ``ORDER``,
    ``ordered_codes``)."""
    p = tl.expand_dims(packed, len(packed.shape))
    return ordered_codes(p, tl.arange(0, 16).to(tl.int64), ORDER)


@triton.jit
def activation_bytes(b_block, mag_lo, mag_hi):
    """Doubled values of one 16-element activation block as signed int8 bytes, in PTX.

    Returns (lo, hi): int64 words holding elements 0..7 and 8..15, element i in byte i % 8, the operand
    layout ``block_dot_ptx`` expects.  Magnitudes come from the same ``prmt`` table lookup as the weights;
    the signed byte is pos - neg, computed four lanes at a time with the top bit of each byte preset so no
    borrow crosses a byte: ((pos | 0x80) - neg) ^ 0x80.  ``mag_lo, mag_hi``: the words of ``MAG_TABLE``.
    """
    return tl.inline_asm_elementwise(
        asm=_ACTIVATION_BYTES_PTX,
        constraints="=l,=l,l,r,r",
        args=[b_block, mag_lo, mag_hi],
        dtype=(tl.int64, tl.int64),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _doubled_code(word, I: tl.constexpr):
    """2 * value of code ``I`` (bits 4I..4I+3) of int32 words, as int32."""
    return doubled_e2m1((word >> (4 * I)) & 15)


@triton.jit
def block_dot_triton(a_block, b_block):
    """Exact sum of 4*a*b over each 16-element block, as float32, in plain Triton.

    ``a_block``, ``b_block``: int64 packed blocks, shapes broadcastable to each other (the result's).  Element
    by element over the 16 positions of the two 32-bit halves, on tensors of the blocks' own shape: unpacking
    to a ``[..., 16]`` tensor and summing it compiled to a local-memory stack and took half a minute
    (docs/performance.md, "Compile time").  The sum is an exact integer, so any order gives it.
    """
    a_words = (a_block.to(tl.int32), (a_block >> 32).to(tl.int32))
    b_words = (b_block.to(tl.int32), (b_block >> 32).to(tl.int32))
    total = _doubled_code(a_words[0], 0) * _doubled_code(b_words[0], 0)
    for i in tl.static_range(1, 16):
        total += _doubled_code(a_words[i // 8], i % 8) * _doubled_code(b_words[i // 8], i % 8)
    return total.to(tl.float32)


@triton.jit
def block_dot_ptx(a_block, b_lo, b_hi, mag_lo, mag_hi):
    """The same block sum as ``block_dot_triton`` in 22 integer instructions and one float subtraction.

    The weight is split as a = a_pos - a_neg (two magnitudes, one of them zero): ``prmt`` looks each nibble
    up in the magnitude table, and a selector nibble with bit 3 (the e2m1 sign) set yields the table byte's
    sign, 0.  Flipping bit 3 first (xor 0x8) selects the negative elements instead.  ``dp4a`` accumulates
    a_pos . b from the bits of 1.5 * 2^23 and a_neg . b from 0; their integer difference is then read as a
    float with one subtraction instead of an int-to-float convert.
    """
    return tl.inline_asm_elementwise(
        asm=_BLOCK_DOT_PTX,
        constraints="=f,l,l,l,r,r",
        args=[a_block, b_lo, b_hi, mag_lo, mag_hi],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
