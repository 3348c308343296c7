"""The integer PTX of the tensor-core kernels' e2m1 decoders, run in Python (the tests check what it computes for
every code in every position)."""


def emulate_ptx(lines, regs):
    """Run the integer PTX the tensor-core kernels' decoders emit (shl, shr, and, or, prmt, mul.lo, mul.hi, mad.lo, mov on
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
        elif op == "prmt.b32":  # bytes of {b, a}, selected by the four low nibbles of c (no sign mode used)
            pool = (v[1] << 32 | v[0]).to_bytes(8, "little")
            assert all((v[2] >> (4 * i)) & 8 == 0 for i in range(4))
            regs[dst] = int.from_bytes(bytes(pool[(v[2] >> (4 * i)) & 7] for i in range(4)), "little")
        else:
            raise AssertionError(op)
    return regs
