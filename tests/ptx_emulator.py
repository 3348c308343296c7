"""The integer PTX of the tensor-core kernels' e2m1 decoders, run in Python (the tests check what it computes for
every code in every position)."""


def emulate_ptx(lines, regs):
    """Run the integer PTX the tensor-core kernels' decoders emit (shl, shr, and, or, lop3, prmt, mul.lo, mul.hi, mad.lo, mov on
    .b32/.u32) on ``regs`` (register name -> value), in place; returns ``regs``."""
    def value(x):
        return regs[x] if x in regs else int(x, 0)

    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(a) for a in src]
        if op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = v[0] >> v[1]
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "mov.b32":
            regs[dst] = v[0]
        elif op == "mul.hi.u32":
            regs[dst] = (v[0] * v[1]) >> 32
        elif op == "mul.lo.u32":
            regs[dst] = (v[0] * v[1]) & 0xFFFFFFFF
        elif op == "mad.lo.u32":
            regs[dst] = (v[0] * v[1] + v[2]) & 0xFFFFFFFF
        elif op == "prmt.b32":  # bytes of {b, a} by the four low nibbles of c; bit 3: the byte's sign replicated
            pool = (v[1] << 32 | v[0]).to_bytes(8, "little")
            picked = []
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 15
                byte = pool[sel & 7]
                picked.append((0xFF if byte & 0x80 else 0) if sel & 8 else byte)
            regs[dst] = int.from_bytes(bytes(picked), "little")
        elif op == "shr.u32":
            regs[dst] = v[0] >> v[1]
        elif op == "lop3.b32":  # the one function the decoders use: a | (b & c)
            assert v[3] == 0xF8
            regs[dst] = v[0] | (v[1] & v[2])
        else:
            raise AssertionError(op)
    return regs
