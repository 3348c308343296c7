"""The PTX of one K step of the weight-only kernel (``kernels/weight_only.py``): every load of the step, the
e2m1 decode straight into ``mma.sync.m16n8k16`` fragments, the block scales and the ``mma`` themselves.

A thread (lane 4 g + c) holds rows 16 t + 8 h + g of every m16 tile t (element e = 2 t + h of the asm's pack).
The mma's K order is free as long as weights and activation agree, so each mode gives thread c its own K
slots of every mma and decodes each 32-bit word of 8 codes into the pairs (e_i, e_{i+4}) (the activation
pairs are built to match):

* ``fold`` (NVFP4): thread c owns 32 consecutive elements (one 16-byte load) of its rows per 128-element
  chunk; an mma sums 4 threads' different blocks, so the e4m3 scale is folded into the weight fragment
  (``mul.f16x2``, exact).  Any N: the C columns are the activation rows.
* ``k32`` (MXFP4): thread c owns word c of every 32-element block (4-byte loads: a warp's load covers 16 bytes
  of 8 rows); a block's two mma sum into a zeroed fp32 partial that the e8m0 scale multiplies (``fma``).  Any N.
* ``split`` (either format, N <= 2 per n-tile): 16-byte loads as in ``fold``, unscaled weights, and the C
  columns split by K owner: column 2 c + j of an n-tile is activation row j restricted to thread c's K slots
  (the other threads give zeros there), so thread c's C elements are partial sums over its own blocks only,
  which its own scales multiply in fp32; the sum over the 4 owners is the epilogue's.  One fp32 ``fma`` per
  C element and block replaces a ``mul.f16x2`` per weight pair.

Accumulators: output o = 2 nt + j, element e = 2 t + h holds fragment register 2 h + j of tile t, n-tile nt:
C[row 16 t + 8 h + g][column 8 nt + 2 c + j] of this warp's K chunks.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

from ._ptx import AsmOperands, PtxBlock, decode_word_f16

__all__ = ["StepSpec", "MODES", "step_asm", "fold_exponent", "decode_word_bf16", "decode_native_bf16",
           "decode_native_f16", "multipliers", "BF16_SCALE_BIAS", "BF16_ACTIVATION_BIAS", "MULTIPLIERS",
           "NATIVE_PAIR_MULTIPLIERS"]

MODES = ("fold", "k32", "split")
# NVFP4 x bf16, fold: the e4m3 scale times 2^119 keeps weight x scale (v * s * 2^-126 * 2^119) a normal bf16.
BF16_SCALE_BIAS = 119
# bf16 with unscaled weights (k32, split): the activation times 2^64 keeps v * 2^-126 * x * 2^64 finite for
# |x| < 2^64.  Small products fall below fp32's normals, where the tensor cores do not keep every bit: on the
# H200 each product was exact for |x| >= 2^-70 and up to 2^-7 off (relative) from 2^-71 down
# (test_bf16_activations_at_the_ends_of_the_window_are_exact_on_gpu sweeps it).
BF16_ACTIVATION_BIAS = 64
# The constants the decode multiplies by (mp0, mp1: sums of two powers of two, decode_word_bf16), passed in
# registers (kernel arguments) so that ptxas keeps the multiplications on the FMA pipe: with literal constants
# it turns them into shifts and LEA on the ALU pipe, which the decode already fills (64 lanes per cycle per SM
# against the FMA pipe's 128).
MULTIPLIERS = {"mp0": 2**6 + 2**12, "mp1": 2**2 + 2**8, "m24": 2**24, "m29": 2**29}
# The weights' code orders a step decodes (``formats.CODE_ORDERS``): the checkpoint's (code i of a 32-bit word at
# bits 4 i) and the kernel-native one (``formats.reorder_codes``: per 16-bit half, pair 0's magnitude at bits 6-8
# and sign at 15, pair 1's at 3-5 and 12, pair 2's at 0-2 and 14, pair 3's at 9-11 and 13), where the bf16 decode
# takes 10 instructions a word against 13 (docs/performance.md, round 18).  The pair multipliers mp0, mp1 depend on
# the order and the 16-bit float (``multipliers``).
NATIVE_PAIR_MULTIPLIERS = {"bf16": (2**6 + 2**1, 2**2 + 2**8), "f16": (2**6 + 2**3, 2**9 + 2**1)}
_E8M0_ZERO = "0f00400000"  # 2^-127, the value of e8m0 byte 0 (an fp32 subnormal)


class StepSpec(NamedTuple):
    """What one compiled step does.  ``fmt``: 'nvfp4' or 'mxfp4'; ``act``: 'f16', 'bf16' or 'fp4' (the
    weights' format); ``mode``: one of ``MODES``; ``tiles``: m16 tiles per warp; ``chunks``: 128-element K
    chunks per warp and step; ``n_tiles``: 1 or 2; ``sfa_col_tile`` / ``sfb_col_tile``: the scale layouts'
    column-tile strides (4 linear, 512 swizzled); ``tail``: the last, partial step (loads masked by K);
    ``order``: the weights' code order (``formats.CODE_ORDERS``; FP4 activations are in the checkpoint's)."""

    fmt: str
    act: str
    mode: str
    tiles: int
    chunks: int
    n_tiles: int
    sfa_col_tile: int
    sfb_col_tile: int
    tail: bool
    order: str = "checkpoint"


def fold_exponent(fmt: str, act: str, mode: str) -> int:
    """f such that the accumulators hold the result times 2^-f (before global scales): 2^-14 per operand
    decoded to fp16, 2^-7 for fold's bf16 (biased scales), 2^(64 - 126) for bf16 with unscaled weights."""
    if act == "fp4":
        return 28
    if act == "f16":
        return 14
    return 126 - BF16_SCALE_BIAS if mode == "fold" else 126 - BF16_ACTIVATION_BIAS


def decode_word_bf16(word: str, pairs: tuple[str, str, str, str], t: str, u: str, mul: dict[str, str]) -> list[str]:
    """PTX turning the 8 codes of ``word`` into the bf16 pairs (e_i, e_{i+4}), each code placed as
    ``sign << 15 | code << 6`` (its value times 2^-126; code 1 is bf16's subnormal 2^-127).

    Pair i is one multiplication between two masks: its two nibbles (bits 4 i and 4 i + 16) times
    2^(6 - 4 i) + 2^(12 - 4 i) leave one copy of each nibble with its magnitude in place (bits 6-8, 22-24) and
    another with its sign in place (bits 15, 31); the copies fall on disjoint bits, so the sum carries nothing,
    and the mask 0x81C081C0 keeps those bits.  Pairs 2 and 3 take the word shifted right by 8 (a ``mul.hi``)
    and pair 0 and 1's multipliers: 13 instructions per word, 8 on the ALU pipe and 5 on the FMA pipe
    (``mul``: the registers of ``MULTIPLIERS``).  ``t``, ``u``: scratch registers."""
    lines = []
    for i, p in enumerate(pairs):
        if i == 2:
            lines.append(f"mul.hi.u32 {u}, {word}, {mul['m24']};")  # word >> 8
        src, k = (word, u)[i // 2], ("mp0", "mp1")[i % 2]
        lines += [f"and.b32 {t}, {src}, {(0x000F000F, 0x00F000F0)[i % 2]:#010x};",
                  f"mul.lo.u32 {t}, {t}, {mul[k]};", f"and.b32 {p}, {t}, 0x81C081C0;"]
    return lines


def multipliers(act: str, order: str) -> dict[str, int]:
    """The values of ``MULTIPLIERS`` a step decoding ``order`` weights for ``act`` activations passes (kernel
    arguments, in ``MULTIPLIERS``' order): the pair multipliers of the native decodes, the checkpoint's otherwise."""
    if order == "checkpoint":
        return dict(MULTIPLIERS)
    mp0, mp1 = NATIVE_PAIR_MULTIPLIERS["f16" if act in ("f16", "fp4") else "bf16"]
    return {**MULTIPLIERS, "mp0": mp0, "mp1": mp1}


def decode_native_bf16(word: str, pairs: tuple[str, str, str, str], t: str, u: str, mul: dict[str, str]) -> list[str]:
    """``decode_word_bf16`` for a word in the native code order (``NATIVE_PAIR_MULTIPLIERS``): pair 0 is a mask;
    pair 1 a shift by 3 and a mask; pair 2 (magnitude at bits 0-2, sign at 14) a mask, a multiplication by
    2^6 + 2^1 (``mul['mp0']``: the copies at bits 6-8 and 15 fall on disjoint bits, as in ``decode_word_bf16``) and
    a mask; pair 3 (magnitude at 9-11, sign at 13) a mask and a ``mul.hi`` by 2^29 (a shift right by 3) for the
    magnitude, a shift left by 2 for the sign and one ``lop3``: 10 instructions a word."""
    p0, p1, p2, p3 = pairs
    return [f"and.b32 {p0}, {word}, 0x81C081C0;",
            f"shl.b32 {t}, {word}, 3;", f"and.b32 {p1}, {t}, 0x81C081C0;",
            f"and.b32 {t}, {word}, 0x40074007;", f"mul.lo.u32 {t}, {t}, {mul['mp0']};",
            f"and.b32 {p2}, {t}, 0x81C081C0;",
            f"and.b32 {t}, {word}, 0x0E000E00;", f"mul.hi.u32 {t}, {t}, {mul['m29']};", f"shl.b32 {u}, {word}, 2;",
            f"lop3.b32 {p3}, {t}, {u}, 0x80008000, 0xF8;"]


def decode_native_f16(word: str, pairs: tuple[str, str, str, str], t: str, u: str, mul: dict[str, str]) -> list[str]:
    """The fp16 pairs (``_ptx.decode_word_f16``'s ``sign << 15 | code << 9``) of a word in the native code order:
    pair 0 the magnitude masked and shifted by 3 and the sign or-ed in place (``lop3``); pair 1 (magnitude at 3-5,
    sign at 12) a mask, a multiplication by 2^6 + 2^3 (``mul['mp0']``) and a mask; pair 2 (0-2, 14) the same with
    2^9 + 2^1 (``mul['mp1']``); pair 3 (magnitude in place at 9-11, sign at 13) a mask, a shift by 2 and a ``lop3``:
    12 instructions a word."""
    p0, p1, p2, p3 = pairs
    return [f"and.b32 {t}, {word}, 0x01C001C0;", f"shl.b32 {t}, {t}, 3;",
            f"lop3.b32 {p0}, {t}, {word}, 0x80008000, 0xF8;",
            f"and.b32 {t}, {word}, 0x10381038;", f"mul.lo.u32 {t}, {t}, {mul['mp0']};",
            f"and.b32 {p1}, {t}, 0x8E008E00;",
            f"and.b32 {t}, {word}, 0x40074007;", f"mul.lo.u32 {t}, {t}, {mul['mp1']};",
            f"and.b32 {p2}, {t}, 0x8E008E00;",
            f"and.b32 {t}, {word}, 0x0E000E00;", f"shl.b32 {u}, {word}, 2;",
            f"lop3.b32 {p3}, {t}, {u}, 0x80008000, 0xF8;"]


def _f32_hex(x: float) -> str:
    return "0f" + struct.pack(">f", x).hex().upper()


def input_names(spec: StepSpec) -> list[str]:
    """The asm's inputs after the accumulators, in order (``step_asm``)."""
    return [name for name, _ in _inputs(spec)]


def _inputs(spec: StepSpec) -> list[tuple[str, str]]:
    names = [("pa", "l"), ("ps", "l"), ("px", "l")]
    if spec.act == "fp4":
        names += [("pxs0", "l"), ("pxs1", "l")] if spec.fmt == "mxfp4" else [("pxs", "l")]
    names += [("ka", "r"), ("ks", "r"), ("kx", "r")] + ([("kxs", "r")] if spec.act == "fp4" else [])
    names += [("xon", "r")] + [(m, "r") for m in MULTIPLIERS]
    if spec.tail:
        names.append(("kleft", "r"))
    return names


@functools.lru_cache(maxsize=None)
def step_asm(spec: StepSpec) -> tuple[str, str]:
    """(asm, constraints) of one step; see the module docstring for the layout.

    Inputs, each ``pack = 2 * tiles`` registers (``input_names``): ``pa[e]`` / ``ps[e]`` the weight and
    weight-scale pointers of row e at the thread's first chunk; ``px[nt]`` the activation pointer of the thread's
    B fragment row (fold, k32: n = g + 8 nt; split: n = 2 nt + g % 2); for FP4 activations ``pxs[nt]`` (NVFP4:
    that row's scales) or ``pxs0[nt]``, ``pxs1[nt]`` (MXFP4: the scales of its C columns' rows); ``ka``, ``ks``,
    ``kx``, ``kxs`` the step's byte offsets (32-bit); ``xon`` (split: whether the thread supplies B, g // 2 == c);
    ``MULTIPLIERS``; for the tail ``kleft`` = elements of K left from the thread's first chunk.  Cached: a launch
    passes the same string objects again (the JIT's cache key hashes them; a string caches its hash).
    """
    if spec.mode not in MODES:
        raise ValueError(f"spec.mode: expected one of {MODES}, got {spec.mode!r}")
    op = AsmOperands(2 * spec.n_tiles, 2 * spec.tiles, _inputs(spec))
    body = {"fold": _FoldStep, "k32": _K32Step, "split": _SplitStep}[spec.mode](spec, op)
    return body.text(), op.constraint_string()


class _Step(PtxBlock):
    """The step's PTX block and the emitters the modes share: masked loads, decode, activation pairs, scales
    and the mma."""

    def __init__(self, spec: StepSpec, op: AsmOperands):
        super().__init__()
        self.spec, self.op = spec, op
        self.mma_type = "bf16" if spec.act == "bf16" else "f16"
        self.mul = {m: op(m) for m in MULTIPLIERS}

    def acc(self, t: int, nt: int, r: int) -> str:
        """Fragment register r of tile t, n-tile nt: output 2 nt + r % 2, element 2 t + r // 2."""
        return f"${(2 * nt + r % 2) * self.op.pack + 2 * t + r // 2}"

    def load(self, kind: str, dst: list[str], pointer: str, offset: str, imm: int, pred: str | None = None) -> None:
        """``dst`` (one register or a vector) = [pointer + offset + imm]; zero where ``pred`` is false."""
        addr = self.reg("b64", f"ad{len(self.code)}")
        # A 32-bit offset widened here lets ptxas form the address with one IMAD.WIDE (FMA pipe) where a 64-bit
        # one took IADD3 + IADD3.X (ALU pipe).
        wide = self.reg("b64", f"wo{offset[1:]}")
        self.emit(f"cvt.u64.u32 {wide}, {offset};", f"add.s64 {addr}, {pointer}, {wide};")
        target = dst[0] if len(dst) == 1 else "{" + ", ".join(dst) + "}"
        if pred is not None:
            self.emit(*(f"mov.b{16 if kind == 'b16' else 32} {d}, 0;" for d in dst))
            self.emit(f"@{pred} ld.global.nc.{kind} {target}, [{addr}+{imm}];")
        else:
            self.emit(f"ld.global.nc.{kind} {target}, [{addr}+{imm}];")

    def in_k(self, name: str, first_element: int, also: str | None = None) -> str | None:
        """Tail step: the predicate 'element ``first_element`` of the thread's chunks lies in K' (and ``also``)."""
        if not self.spec.tail:
            return also
        p = self.reg("pred", name)
        self.emit(f"setp.gt.s32 {p}, {self.op('kleft')}, {first_element};")
        if also is not None:
            self.emit(f"and.pred {p}, {p}, {also};")
        return p

    def float_pairs(self, raw: list[str], prefix: str) -> list[str]:
        """(x_i, x_{i+4}) pairs of each 8 consecutive 16-bit activation values (4 registers) in ``raw``."""
        out = []
        for q in range(len(raw) // 4):
            for i in range(4):
                b = self.reg("b32", f"{prefix}{4 * q + i}")
                sel = "0x5410" if i % 2 == 0 else "0x7632"
                self.emit(f"prmt.b32 {b}, {raw[4 * q + i // 2]}, {raw[4 * q + 2 + i // 2]}, {sel};")
                out.append(b)
        return out

    def matched_pairs(self, raw: list[str], prefix: str) -> list[str]:
        """The activation's pairs matching :meth:`decode`'s pairing of a weight word: (x_i, x_{i+4}) of each 8
        values (``float_pairs``), or, for weights in the paired order (pair i = K elements 2i, 2i + 1), the
        registers as loaded."""
        return raw if self.spec.order == "paired" else self.float_pairs(raw, prefix)

    def bias_bf16(self, pairs: list[str]) -> None:
        """bf16 activation pairs times 2^64 (``BF16_ACTIVATION_BIAS``), for the unscaled bf16 weights."""
        bias = self.reg("b32", "xbias")
        self.emit(f"mov.b32 {bias}, {(127 + BF16_ACTIVATION_BIAS) * 0x00800080:#010x};")  # (2^64, 2^64)
        self.emit(*(f"mul.rn.bf16x2 {p}, {p}, {bias};" for p in pairs))

    def decode(self, word: str, prefix: str, weights: bool = True) -> list[str]:
        """The pairs (e_i, e_{i+4}) of ``word``: a weight word in the step's code order (``spec.order``), an FP4
        activation word (``weights`` False) in the checkpoint's."""
        pairs = tuple(self.reg("b32", f"{prefix}_{i}") for i in range(4))
        t, u = self.reg("b32", f"{prefix}_t"), self.reg("b32", f"{prefix}_u")
        native = weights and self.spec.order in ("native", "paired")  # paired: the native fields, slots moved
        if self.mma_type == "bf16":
            decode = decode_native_bf16 if native else decode_word_bf16
            self.emit(*decode(word, pairs, t, u, self.mul))
        elif native:
            self.emit(*decode_native_f16(word, pairs, t, u, self.mul))
        else:
            self.emit(*decode_word_f16(word, pairs, t, u, self.mul["m29"]))
        return list(pairs)

    def mma(self, d: list[str], a: list[str], b: list[str], c: list[str]) -> None:
        t = self.mma_type
        self.emit(f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{{', '.join(d)}}}, {{{', '.join(a)}}}, "
                  f"{{{', '.join(b)}}}, {{{', '.join(c)}}};")

    def scale_pairs_e4m3(self, raw16: str, prefix: str, bias: bool) -> tuple[str, str]:
        """(s0, s0) and (s1, s1) of the two e4m3 scale bytes in ``raw16`` (a .b16), in fp16, or in bf16 times
        2^119 when ``bias``."""
        h = self.reg("b32", f"{prefix}_h")
        s0, s1 = self.reg("b32", f"{prefix}_0"), self.reg("b32", f"{prefix}_1")
        self.emit(f"cvt.rn.f16x2.e4m3x2 {h}, {raw16};")
        if not bias:
            self.emit(f"prmt.b32 {s0}, {h}, 0, 0x1010;", f"prmt.b32 {s1}, {h}, 0, 0x3232;")
            return s0, s1
        f0, f1 = self.scales_f32_e4m3(h, prefix)
        self.emit(f"mul.f32 {f0}, {f0}, {_f32_hex(2.0 ** BF16_SCALE_BIAS)};",
                  f"mul.f32 {f1}, {f1}, {_f32_hex(2.0 ** BF16_SCALE_BIAS)};",
                  f"cvt.rn.bf16x2.f32 {s0}, {f0}, {f0};", f"cvt.rn.bf16x2.f32 {s1}, {f1}, {f1};")
        return s0, s1

    def scales_f32_e4m3(self, h: str, prefix: str) -> tuple[str, str]:
        """The two fp16 scales in ``h`` (from ``cvt.rn.f16x2.e4m3x2``) as fp32."""
        lo, hi = self.reg("b16", f"{prefix}_lo"), self.reg("b16", f"{prefix}_hi")
        f0, f1 = self.reg("f32", f"{prefix}_f0"), self.reg("f32", f"{prefix}_f1")
        self.emit(f"mov.b32 {{{lo}, {hi}}}, {h};", f"cvt.f32.f16 {f0}, {lo};", f"cvt.f32.f16 {f1}, {hi};")
        return f0, f1

    def e8m0(self, raw: str, name: str) -> str:
        """The e8m0 byte in ``raw`` as fp32 2^(byte - 127): the byte shifted into the exponent field, byte 0 made
        2^-127 (max), byte 255 (infinity so far) made NaN (inf * 0 + inf)."""
        f = self.reg("f32", name)
        bits = self.reg("b32", name + "_b")
        self.emit(f"shl.b32 {bits}, {raw}, 23;", f"mov.b32 {f}, {bits};", f"max.f32 {f}, {f}, {_E8M0_ZERO};",
                  f"fma.rn.f32 {f}, {f}, 0f00000000, {f};")
        return f

    def zero(self) -> str:
        z = self.reg("f32", "fz")
        self.emit(f"mov.f32 {z}, 0f00000000;")
        return z

    def chunk_weights(self, preds: list[str | None]) -> dict:
        """16-byte weight loads (fold, split): words[e, u] = the 4 words of row e, chunk u."""
        words = {}
        for u in range(self.spec.chunks):
            for e in range(self.op.pack):
                words[e, u] = [self.reg("b32", f"w{e}_{u}_{q}") for q in range(4)]
                self.load("v4.u32", words[e, u], self.op("pa", e), self.op("ka"), 64 * u, preds[u])
        return words

    def chunk_activation(self, nt: int, u: int, pred: str | None) -> list[str]:
        """The B row's 32 K slots of chunk u (16-byte ownership): 16 fp16/bf16 registers or 4 FP4 words."""
        op = self.op
        if self.spec.act == "fp4":
            regs = [self.reg("b32", f"x{nt}_{u}_{q}") for q in range(4)]
            self.load("v4.u32", regs, op("px", nt), op("kx"), 64 * u, pred)
            return regs
        regs = [self.reg("b32", f"x{nt}_{u}_{m}") for m in range(16)]
        for v in range(4):
            self.load("v4.u32", regs[4 * v:4 * v + 4], op("px", nt), op("kx"), 256 * u + 16 * v, pred)
        return regs


class _FoldStep(_Step):
    """NVFP4 weights: 16-byte weight loads, e4m3 scales folded into the fragments."""

    def __init__(self, spec: StepSpec, op: AsmOperands):
        super().__init__(spec, op)
        s, P, U = spec, op.pack, spec.chunks
        mul = "mul.rn.bf16x2" if self.mma_type == "bf16" else "mul.rn.f16x2"
        fp4 = s.act == "fp4"
        preds = [self.in_k(f"pk{u}", 128 * u) for u in range(U)]
        # Every load of the step first: weights, their scales, the activation (and its scales).
        words = self.chunk_weights(preds)
        sraw = {}
        for u in range(U):
            for e in range(P):
                sraw[e, u] = self.reg("b16", f"sr{e}_{u}")
                self.load("b16", [sraw[e, u]], op("ps", e), op("ks"), 2 * s.sfa_col_tile * u, preds[u])
        xraw, xsraw = {}, {}
        for nt in range(s.n_tiles):
            for u in range(U):
                xraw[nt, u] = self.chunk_activation(nt, u, preds[u])
                if fp4:
                    xsraw[nt, u] = self.reg("b16", f"xs{nt}_{u}")
                    self.load("b16", [xsraw[nt, u]], op("pxs", nt), op("kxs"), 2 * s.sfb_col_tile * u, preds[u])
        for u in range(U):
            # Activation pairs b[nt][4 q + i] = (x_i, x_{i+4}) of word q, scaled for FP4.
            b = {}
            for nt in range(s.n_tiles):
                if fp4:
                    xs = self.scale_pairs_e4m3(xsraw[nt, u], f"xsc{nt}_{u}", bias=False)
                    b[nt] = []
                    for q in range(4):
                        for p in self.decode(xraw[nt, u][q], f"xd{nt}_{u}_{q}", weights=False):
                            self.emit(f"mul.rn.f16x2 {p}, {p}, {xs[q // 2]};")
                            b[nt].append(p)
                else:
                    b[nt] = self.matched_pairs(xraw[nt, u], f"b{nt}_{u}_")
            for t in range(s.tiles):
                scales = [self.scale_pairs_e4m3(sraw[2 * t + h, u], f"sc{t}_{h}_{u}", bias=s.act == "bf16")
                          for h in range(2)]
                for q in range(4):
                    # a[h][i]: pair i of word q of row g + 8 h, times its block's scale (block q // 2).
                    a = [self.decode(words[2 * t + h, u][q], f"a{t}_{h}_{u}_{q}") for h in range(2)]
                    for h in range(2):
                        for p in a[h]:
                            self.emit(f"{mul} {p}, {p}, {scales[h][q // 2]};")
                    for nt in range(s.n_tiles):
                        d = [self.acc(t, nt, r) for r in range(4)]
                        for mm in range(2):
                            frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                            self.mma(d, frag, [b[nt][4 * q + 2 * mm], b[nt][4 * q + 2 * mm + 1]], d)


class _SplitStep(_Step):
    """16-byte weight loads, unscaled weights, C columns split by K owner, scales on fp32 partials."""

    def __init__(self, spec: StepSpec, op: AsmOperands):
        super().__init__(spec, op)
        self.mx, self.fp4 = spec.fmt == "mxfp4", spec.act == "fp4"
        on = self.reg("pred", "xon")
        self.emit(f"setp.ne.s32 {on}, {op('xon')}, 0;")
        preds = [self.in_k(f"pk{u}", 128 * u) for u in range(spec.chunks)]
        xpreds = [self.in_k(f"px{u}", 128 * u, on) for u in range(spec.chunks)]
        words = self.chunk_weights(preds)
        sraw = self.weight_scale_loads(preds)
        xraw, xsraw = self.activation_loads(preds, [p if p is not None else on for p in xpreds])
        zero = self.zero()
        for u in range(spec.chunks):
            b, xscale = self.activation_pairs(u, xraw, xsraw)
            for t in range(spec.tiles):
                self.tile_blocks(t, u, words, self.weight_scales(t, u, sraw), b, xscale, zero)

    def weight_scale_loads(self, preds: list[str | None]) -> dict:
        """sraw[e, u]: MXFP4 the scale byte of the thread's block (its chunk), NVFP4 its two blocks' bytes."""
        s, op, sraw = self.spec, self.op, {}
        for u in range(s.chunks):
            for e in range(op.pack):
                if self.mx:
                    sraw[e, u] = self.reg("b32", f"sr{e}_{u}")
                    self.load("u8", [sraw[e, u]], op("ps", e), op("ks"), s.sfa_col_tile * u, preds[u])
                else:
                    sraw[e, u] = self.reg("b16", f"sr{e}_{u}")
                    self.load("b16", [sraw[e, u]], op("ps", e), op("ks"), 2 * s.sfa_col_tile * u, preds[u])
        return sraw

    def activation_loads(self, preds: list[str | None], xpreds: list[str]) -> tuple[dict, dict]:
        """B of each n-tile and chunk and, for FP4, its scales.  Only the threads with g // 2 == c supply B (row
        2 nt + g % 2 at their own K slots); the others give zeros, so column 2 c + j sees thread c's slots only."""
        s, op, xraw, xsraw = self.spec, self.op, {}, {}
        for nt in range(s.n_tiles):
            for u in range(s.chunks):
                xraw[nt, u] = self.chunk_activation(nt, u, xpreds[u])
                if self.fp4 and self.mx:
                    for j in range(2):
                        xsraw[nt, u, j] = self.reg("b32", f"xs{nt}_{u}_{j}")
                        self.load("u8", [xsraw[nt, u, j]], op(f"pxs{j}", nt), op("kxs"), s.sfb_col_tile * u,
                                  preds[u])
                elif self.fp4:
                    xsraw[nt, u] = self.reg("b16", f"xs{nt}_{u}")
                    self.load("b16", [xsraw[nt, u]], op("pxs", nt), op("kxs"), 2 * s.sfb_col_tile * u, preds[u])
        return xraw, xsraw

    def activation_pairs(self, u: int, xraw: dict, xsraw: dict) -> tuple[dict, dict]:
        """b[nt]: the B fragment pairs of chunk u (NVFP4 activations scaled, bf16 biased); xscale[nt]: MXFP4
        activations' fp32 scales of the thread's two C columns."""
        b, xscale = {}, {}
        for nt in range(self.spec.n_tiles):
            if self.fp4:
                b[nt] = []
                if not self.mx:
                    xs = self.scale_pairs_e4m3(xsraw[nt, u], f"xsc{nt}_{u}", bias=False)
                for q in range(4):
                    for p in self.decode(xraw[nt, u][q], f"xd{nt}_{u}_{q}", weights=False):
                        if not self.mx:
                            self.emit(f"mul.rn.f16x2 {p}, {p}, {xs[q // 2]};")
                        b[nt].append(p)
                if self.mx:
                    xscale[nt] = [self.e8m0(xsraw[nt, u, j], f"xsf{nt}_{u}_{j}") for j in range(2)]
            else:
                b[nt] = self.matched_pairs(xraw[nt, u], f"b{nt}_{u}_")
                if self.spec.act == "bf16":
                    self.bias_bf16(b[nt])
        return b, xscale

    def weight_scales(self, t: int, u: int, sraw: dict) -> list[list[str]]:
        """f[h][blk]: the fp32 scales of the thread's blocks of row h: MXFP4 one (the chunk), NVFP4 two (words
        0-1, 2-3)."""
        if self.mx:
            return [[self.e8m0(sraw[2 * t + h, u], f"sf{t}_{h}_{u}")] for h in range(2)]
        f = []
        for h in range(2):
            hx = self.reg("b32", f"sh{t}_{h}_{u}")
            self.emit(f"cvt.rn.f16x2.e4m3x2 {hx}, {sraw[2 * t + h, u]};")
            f.append(list(self.scales_f32_e4m3(hx, f"sf{t}_{h}_{u}")))
        return f

    def tile_blocks(self, t: int, u: int, words: dict, f: list[list[str]], b: dict, xscale: dict, zero: str) -> None:
        """Tile t, chunk u: each block's mma into a zeroed partial, which its scales add to the accumulators."""
        groups = [range(4)] if self.mx else [range(2), range(2, 4)]
        for blk, qs in enumerate(groups):
            a = {(q, h): self.decode(words[2 * t + h, u][q], f"a{t}_{h}_{u}_{q}") for q in qs for h in range(2)}
            for nt in range(self.spec.n_tiles):
                part = [self.reg("f32", f"pp{t}_{nt}_{u}_{blk}_{r}") for r in range(4)]
                first = True
                for q in qs:
                    for mm in range(2):
                        frag = [a[q, 0][2 * mm], a[q, 1][2 * mm], a[q, 0][2 * mm + 1], a[q, 1][2 * mm + 1]]
                        self.mma(part, frag, [b[nt][4 * q + 2 * mm], b[nt][4 * q + 2 * mm + 1]],
                                 [zero] * 4 if first else part)
                        first = False
                for r in range(4):
                    scale = f[r // 2][blk]
                    if self.fp4 and self.mx:
                        fx = self.reg("f32", f"fx{t}_{nt}_{u}_{r}")
                        self.emit(f"mul.f32 {fx}, {scale}, {xscale[nt][r % 2]};")
                        scale = fx
                    d = self.acc(t, nt, r)
                    self.emit(f"fma.rn.f32 {d}, {part[r]}, {scale}, {d};")


class _K32Step(_Step):
    """MXFP4 weights: word c of every 32-element block (4-byte loads), two mma per block into a zeroed partial,
    the e8m0 scale applied to the partial in fp32."""

    def __init__(self, spec: StepSpec, op: AsmOperands):
        super().__init__(spec, op)
        s, P = spec, op.pack
        fp4 = s.act == "fp4"
        blocks = 4 * spec.chunks
        preds = [self.in_k(f"pk{j}", 32 * j) for j in range(blocks)]
        words, sraw, xraw, xsraw = {}, {}, {}, {}
        for j in range(blocks):
            col = (j // 4) * s.sfa_col_tile + j % 4
            for e in range(P):
                words[e, j] = self.reg("b32", f"w{e}_{j}")
                self.load("u32", [words[e, j]], op("pa", e), op("ka"), 16 * j, preds[j])
                sraw[e, j] = self.reg("b32", f"sr{e}_{j}")
                self.load("u8", [sraw[e, j]], op("ps", e), op("ks"), col, preds[j])
        for nt in range(s.n_tiles):
            for j in range(blocks):
                if fp4:
                    xraw[nt, j] = [self.reg("b32", f"x{nt}_{j}")]
                    self.load("u32", xraw[nt, j], op("px", nt), op("kx"), 16 * j, preds[j])
                    col = (j // 4) * s.sfb_col_tile + j % 4
                    for jj in range(2):
                        xsraw[nt, j, jj] = self.reg("b32", f"xs{nt}_{j}_{jj}")
                        self.load("u8", [xsraw[nt, j, jj]], op(f"pxs{jj}", nt), op("kxs"), col, preds[j])
                else:
                    xraw[nt, j] = [self.reg("b32", f"x{nt}_{j}_{m}") for m in range(4)]
                    self.load("v4.u32", xraw[nt, j], op("px", nt), op("kx"), 64 * j, preds[j])
        zero = self.zero()
        for j in range(blocks):
            scale = [self.e8m0(sraw[e, j], f"sf{e}_{j}") for e in range(P)]
            b, xscale = {}, {}
            for nt in range(s.n_tiles):
                if fp4:
                    b[nt] = self.decode(xraw[nt, j][0], f"xd{nt}_{j}", weights=False)
                    xscale[nt] = [self.e8m0(xsraw[nt, j, jj], f"xsf{nt}_{j}_{jj}") for jj in range(2)]
                else:
                    b[nt] = self.matched_pairs(xraw[nt, j], f"b{nt}_{j}_")
                    if s.act == "bf16":
                        self.bias_bf16(b[nt])
            for t in range(s.tiles):
                a = [self.decode(words[2 * t + h, j], f"a{t}_{h}_{j}") for h in range(2)]
                for nt in range(s.n_tiles):
                    part = [self.reg("f32", f"pp{t}_{nt}_{j}_{r}") for r in range(4)]
                    for mm in range(2):
                        frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                        self.mma(part, frag, [b[nt][2 * mm], b[nt][2 * mm + 1]], part if mm else [zero] * 4)
                    for r in range(4):
                        f = scale[2 * t + r // 2]
                        if fp4:
                            fx = self.reg("f32", f"fx{t}_{nt}_{j}_{r}")
                            self.emit(f"mul.f32 {fx}, {f}, {xscale[nt][r % 2]};")
                            f = fx
                        d = self.acc(t, nt, r)
                        self.emit(f"fma.rn.f32 {d}, {part[r]}, {f}, {d};")
