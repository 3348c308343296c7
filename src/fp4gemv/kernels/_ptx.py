"""The one emitter of the tensor-core kernels' inline PTX (``hmma_gemv.py``, ``_mma_step.py``, ``gemm.py``,
``stream.py``): numbered asm operands by name, a block of PTX with its register declarations, the e2m1 -> fp16
word decode of the first two, and the e2m1 byte-table lookup of the last two."""

from __future__ import annotations

__all__ = ["AsmOperands", "PtxBlock", "decode_word_f16", "E2M1_BYTE_TABLES", "E2M1_LOOKUP_REGISTERS",
           "e2m1_table_lookup", "e2m1_pair"]


class AsmOperands:
    """Numbering of an ``inline_asm_elementwise`` call's operands: ``n_out`` outputs of ``pack`` registers
    each, then (``tied``) an input tied to each output register, then named inputs of ``pack`` registers each,
    in order (element e of input ``name`` is ``self(name, e)``).  A name given as ``(name, kind, registers)``
    takes that many registers instead: an 8-bit input packs four elements per 32-bit register (``pack // 4``)."""

    def __init__(self, n_out: int, pack: int, names: list[tuple[str, str] | tuple[str, str, int]],
                 out_kind: str = "f", tied: bool = True):
        self.pack = pack
        outputs = n_out * pack
        self.constraints = [f"={out_kind}"] * outputs + ([str(i) for i in range(outputs)] if tied else [])
        self.index: dict[str, int] = {}
        first = 2 * outputs if tied else outputs
        for name, kind, *registers in names:
            count = registers[0] if registers else pack
            self.index[name] = first
            self.constraints += [kind] * count
            first += count

    def __call__(self, name: str, e: int = 0) -> str:
        return f"${self.index[name] + e}"

    def out(self, i: int) -> str:
        """Output register i (0 .. n_out * pack - 1)."""
        return f"${i}"

    def constraint_string(self) -> str:
        return ",".join(self.constraints)


class PtxBlock:
    """Lines of PTX in one ``{ }`` scope; registers declared by ``reg`` as they are first named."""

    def __init__(self):
        self.decls: dict[str, set[str]] = {}
        self.code: list[str] = []

    def reg(self, kind: str, name: str) -> str:
        """``name``, declared as a ``.reg .kind``."""
        self.decls.setdefault(kind, set()).add(name)
        return name

    def regs(self, kind: str, prefix: str, count: int) -> list[str]:
        return [self.reg(kind, f"{prefix}{i}") for i in range(count)]

    def emit(self, *lines: str) -> None:
        self.code.extend(lines)

    def text(self) -> str:
        decls = [f".reg .{kind} {', '.join(sorted(names))};" for kind, names in sorted(self.decls.items())]
        return "\n".join(["{", *decls, *self.code, "}"])


def decode_word_f16(word: str, pairs: tuple[str, str, str, str], t: str, u: str, m29: str | None = None) -> list[str]:
    """PTX turning the 8 codes e0..e7 of ``word`` into the fp16 pairs (e_i, e_{i+4}), i = 0..3, each code
    placed as ``sign << 15 | code << 9`` (its value times 2^-14; code 1, 0.5, is fp16's subnormal 2^-15).

    Byte-wise: each byte holds two codes; the high fp16 byte ``sign << 7 | code << 1`` of the low one is
    ``(w << 1) & 0x0E.. | (w << 4) & 0x80..``, of the high one ``((w >> 3) & 0x0E..) | w & 0x80..`` (four codes
    per operation), and one ``prmt`` per pair puts two such bytes above zero bytes: 13 instructions per word.
    With ``m29`` (a register holding 2^29) the shift by 3 is ``mul.hi`` of ``w & 0x70..``, on the FMA pipe
    instead of the ALU pipe (``_mma_step.MULTIPLIERS``).  ``t``, ``u``: scratch, which may be ``pairs[2]``,
    ``pairs[3]``.
    """
    p0, p1, p2, p3 = pairs
    if m29 is None:
        high = [f"shr.b32 {u}, {word}, 3;", f"and.b32 {u}, {u}, 0x0E0E0E0E;"]
    else:
        high = [f"and.b32 {u}, {word}, 0x70707070;", f"mul.hi.u32 {u}, {u}, {m29};"]
    return [
        f"shl.b32 {t}, {word}, 1;", f"and.b32 {t}, {t}, 0x0E0E0E0E;", f"shl.b32 {u}, {word}, 4;",
        f"and.b32 {u}, {u}, 0x80808080;", f"or.b32 {t}, {t}, {u};",  # bytes: codes 0, 2, 4, 6
        *high, f"and.b32 {p0}, {word}, 0x80808080;", f"or.b32 {u}, {u}, {p0};",  # bytes: codes 1, 3, 5, 7
        f"prmt.b32 {p0}, {t}, 0, 0x2404;",  # (e0, e4)
        f"prmt.b32 {p1}, {u}, 0, 0x2404;",  # (e1, e5)
        f"prmt.b32 {p2}, {t}, 0, 0x3414;",  # (e2, e6)
        f"prmt.b32 {p3}, {u}, 0, 0x3414;",  # (e3, e7)
    ]


# e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as 16-bit floats, split into byte tables that prmt indexes (bytes
# 0..3 in the first word, 4..7 in the second): ((high bytes), (low bytes)); bf16 0x0000 0x3F00 0x3F80 0x3FC0
# 0x4000 0x4040 0x4080 0x40C0, fp16 0x0000 0x3800 0x3C00 0x3E00 0x4000 0x4200 0x4400 0x4600 (low bytes all zero).
E2M1_BYTE_TABLES = {"bf16": ((0x3F3F3F00, 0x40404040), (0xC0800000, 0xC0804000)),
                    "fp16": ((0x3E3C3800, 0x46444240), (0, 0))}
# The registers e2m1_table_lookup writes (declare them in the asm block).
E2M1_LOOKUP_REGISTERS = "m, mh, h0, h1, l0, l1, a, s0, s1"


def e2m1_table_lookup(word: str, high0: str, low0: str | None, kind: str) -> list[str]:
    """PTX from ``word`` (8 e2m1 codes, element i in nibble i) to the high bytes (h0: elements 0-3, h1: 4-7) and
    low bytes (l0, l1) of their exact values in ``kind`` ("bf16" or "fp16"), ``high0`` / ``low0`` the registers
    holding the tables' first words (``low0`` None: fp16, whose low bytes are zero).

    prmt looks the 3-bit magnitudes up in the byte tables, four elements per instruction; the signs come from a
    prmt in sign-replicate mode (selector bit 3) on the bytes whose top bit is a code's sign (w << 4 for the even
    elements, w for the odd ones), or-ed into the high bytes."""
    (_, high1), (_, low1) = E2M1_BYTE_TABLES[kind]
    lines = [f"and.b32 m, {word}, 0x77777777;", "shr.u32 mh, m, 16;",
             f"prmt.b32 h0, {high0}, {high1:#010x}, m;", f"prmt.b32 h1, {high0}, {high1:#010x}, mh;",
             f"shl.b32 a, {word}, 4;", f"prmt.b32 s0, a, {word}, 0xD9C8;", f"prmt.b32 s1, a, {word}, 0xFBEA;",
             "lop3.b32 h0, h0, s0, 0x80808080, 0xF8;", "lop3.b32 h1, h1, s1, 0x80808080, 0xF8;"]
    if low0 is None:
        return lines + ["mov.b32 l0, 0;", "mov.b32 l1, 0;"]
    return lines + [f"prmt.b32 l0, {low0}, {low1:#010x}, m;", f"prmt.b32 l1, {low0}, {low1:#010x}, mh;"]


def e2m1_pair(j: int, dst: str) -> str:
    """PTX interleaving low and high bytes into ``dst``: the two values of byte j of the looked-up word (element
    2j in the low half, 2j + 1 in the high half)."""
    low, high = ("l0", "h0") if j < 2 else ("l1", "h1")
    return f"prmt.b32 {dst}, {low}, {high}, {('0x5140', '0x7362')[j % 2]};"
