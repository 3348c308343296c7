"""Decode asm variants for the pair-per-byte layout (bf16 bits v*2^-126: (n&7)<<6 | (n&8)<<12 per nibble)."""

def pairs_from_word():
    # $0..$3 <- byte i of $4: low nibble -> low half, high nibble -> high half.
    lines = ["{", ".reg .b32 b, u, v;"]
    for i in range(4):
        lines.append(f"prmt.b32 b, $4, 0, {0x4440 + i:#x};")
        lines.append("and.b32 u, b, 0xf;")
        lines.append("and.b32 v, b, 0xf0;")
        lines.append("mul.lo.u32 u, u, 0x1040;")     # n<<6 | n<<12
        lines.append("mul.lo.u32 v, v, 0x1040000;")  # (n<<4) << 18 | (n<<4) << 24 -> mag at 22-24, sign at 31
        lines.append("or.b32 u, u, v;")
        lines.append(f"and.b32 ${i}, u, 0x81c081c0;")
    lines.append("}")
    return "\n".join(lines)

def pairs_from_dup():
    # input $2 = [b0, b0, b1, b1] (bytes); $0 <- pair(b0) (nibbles at bits 0-3 and 12-15), $1 <- pair(b1) (16-19, 28-31)
    return "\n".join(["{", ".reg .b32 u, v;",
        "and.b32 u, $2, 0xf;", "and.b32 v, $2, 0xf000;",
        "mul.lo.u32 u, u, 0x1040;",        # bits 0-3 -> 6-9, 12-15
        "mul.lo.u32 v, v, 0x10400;",       # bits 12-15 -> 22-25, 28-31
        "or.b32 u, u, v;", "and.b32 $0, u, 0x81c081c0;",
        "and.b32 u, $2, 0xf0000;", "and.b32 v, $2, 0xf0000000;",
        "mul.hi.u32 u, u, 0x10400000;",    # (u<<22 + u<<28) >> 32: bits 16-19 -> 6-9, 12-15
        "shr.b32 v, v, 6;",                # bits 28-31 -> 22-25 (the sign, bit 31 -> 25, is taken from $2 below)
        "or.b32 u, u, v;", "and.b32 u, u, 0x01c081c0;",
        "and.b32 v, $2, 0x80000000;", "or.b32 $1, u, v;", "}"])
