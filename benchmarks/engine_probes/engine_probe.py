"""Probe: Gluon warp-specialized NVFP4 x bf16 GEMV, TMA ring, consumer decode+mma in inline PTX."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4gemv.kernels._mma_step import _Step, StepSpec, MULTIPLIERS, fold_exponent
from fp4gemv.kernels._ptx import PtxBlock


class RegFold(_Step):
    """fold step on registers: elements e = b + 2u + 4h + 8t of the thread's [W,16T,16] slice."""

    def __init__(self, tiles, n_tiles, variant="full"):
        PtxBlock.__init__(self)
        self.variant = variant
        self.mma_type = "bf16"
        self.spec = StepSpec("nvfp4", "bf16", "fold", tiles, 2, n_tiles, 4, 4, False)
        P = 8 * tiles
        self.P = P
        # operands: $0..P-1 acc out, P..2P-1 tied, then w (P 'l'), s (P/4 'r'), x0..x3 (P 'l' each), muls (P 'r' each)
        idx = 2 * P
        cons = ["=f"] * P + [str(i) for i in range(P)]
        self.ix = {}
        for name, kind, cnt in [("w", "l", P), ("s", "r", P // 4)] + [(f"x{z}", "l", P) for z in range(4)] + [
                (m, "r", P) for m in MULTIPLIERS]:
            self.ix[name] = idx
            cons += [kind] * cnt
            idx += cnt
        self.cons = ",".join(cons)
        self.mul = {m: f"${self.ix[m]}" for m in MULTIPLIERS}
        op = lambda name, e=0: f"${self.ix[name] + e}"
        shared_b = {}
        for u in range(2):
            for nt in range(n_tiles):
                # n-tile nt uses the h = nt registers of x (rows g + 8 nt); the same for every tile t (t = 0's)
                rawn = []
                for b in range(2):
                    for z in range(4):
                        lo, hi = self.reg("b32", f"y{nt}_{u}_{b}_{z}l"), self.reg("b32", f"y{nt}_{u}_{b}_{z}h")
                        self.emit(f"mov.b64 {{{lo}, {hi}}}, {op(f'x{z}', b + 2 * u + 4 * nt)};")
                        rawn += [lo, hi]
                shared_b[u, nt] = self.float_pairs(rawn, f"b{nt}_{u}_")
        for t in range(tiles):
            for u in range(2):
                bpairs = {nt: shared_b[u, nt] for nt in range(n_tiles)}
                # weights: rows h = 0, 1; words q = 2b + half
                words = {}
                for h in range(2):
                    ws = []
                    for b in range(2):
                        lo, hi = self.reg("b32", f"w{t}_{u}_{h}_{b}l"), self.reg("b32", f"w{t}_{u}_{h}_{b}h")
                        self.emit(f"mov.b64 {{{lo}, {hi}}}, {op('w', b + 2 * u + 4 * h + 8 * t)};")
                        ws += [lo, hi]
                    words[h] = ws
                # scales: bytes e = b + 2u + 4h + 8t; reg (e // 4), byte e % 4 -> b16 of (b=0,1) at byte 2u (+4h..)
                scales = []
                for h in range(2):
                    e0 = 2 * u + 4 * h + 8 * t
                    r16 = self.reg("b16", f"sr{t}_{u}_{h}")
                    tmp = self.reg("b32", f"st{t}_{u}_{h}")
                    self.emit(f"shr.u32 {tmp}, {op('s', e0 // 4)}, {8 * (e0 % 4)};", f"cvt.u16.u32 {r16}, {tmp};")
                    scales.append(self.scale_pairs_e4m3(r16, f"sc{t}_{u}_{h}", bias=True))
                for q in range(4):
                    if self.variant == "nodecode":
                        a = [[words[h][q], words[h][(q + 1) % 4], words[h][(q + 2) % 4], words[h][(q + 3) % 4]]
                             for h in range(2)]
                    else:
                        a = [self.decode(words[h][q], f"a{t}_{u}_{h}_{q}") for h in range(2)]
                        for h in range(2):
                            for p in a[h]:
                                self.emit(f"mul.rn.bf16x2 {p}, {p}, {scales[h][q // 2]};")
                    if self.variant == "nomma":
                        for h in range(2):
                            for j, p in enumerate(a[h]):
                                tmp = self.reg("b32", "nm_tmp")
                                self.emit(f"mov.b32 {tmp}, {self.accreg(t, 0, j)};", f"add.u32 {tmp}, {tmp}, {p};",
                                          f"mov.b32 {self.accreg(t, 0, j)}, {tmp};")
                        continue
                    for nt in range(n_tiles):
                        d = [f"${8 * t + 4 * nt + r}" for r in range(4)]
                        for mm in range(2):
                            frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                            self.mma(d, frag, [bpairs[nt][4 * q + 2 * mm], bpairs[nt][4 * q + 2 * mm + 1]], d)


def _accreg(self, t, nt, r):
    return f"${8 * t + 4 * nt + r}"


RegFold.accreg = _accreg


def layouts(W, T, NP):
    import math
    tb = [[0, 16 * (1 << i), 0] for i in range(int(math.log2(T)))]
    wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
    LW = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [W, 1, 1], [2, 1, 0])
    # xt [4W, NP, 16]: d0 = 4w + 2u + c1, d1 = n, d2 = 8 c0 + 4 b + z
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [2, 0, 0]] + ([[0, 8, 0]] if NP == 16 else [])
    g_lanes = [[0, 1 << i, 0] if (1 << i) < NP else [0, 0, 0] for i in range(3)]
    LX = gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 0, 8], [1, 0, 0]] + g_lanes,
                                    warp_bases=[[4 << i, 0, 0] for i in range(int(math.log2(W)))], block_bases=[],
                                    shape=[4 * W, NP, 16])
    return LW, LX


@gluon.jit
def _producer(w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, row0, n_steps,
              W: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr):
    for i in range(n_steps):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(slot), phase ^ 1)
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes)
        if BOX == 0:
            tma.async_copy_global_to_shared(w_desc, [i * W, row0, 0], ready.index(slot), wbuf.index(slot))
        elif BOX == 1:
            tma.async_copy_global_to_shared(w_desc, [row0, i * W, 0], ready.index(slot), wbuf.index(slot))
        else:
            tma.async_copy_global_to_shared(w_desc, [row0, i * W * 16], ready.index(slot), wbuf.index(slot))
        tma.async_copy_global_to_shared(s_desc, [i * W, row0, 0], ready.index(slot), sbuf.index(slot))
        tma.async_copy_global_to_shared(x_desc, [4 * W * i, 0, 0], ready.index(slot), xbuf.index(slot))


@gluon.jit
def _x_operands(xt, W: gl.constexpr, T: gl.constexpr, NP: gl.constexpr, LW: gl.constexpr):
    B5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 4], [1, 8 // min(NP, 8), min(NP, 8), 4, 1], [W, 1, 1, 1, 1],
                                        [4, 3, 2, 1, 0])
    B4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 8 // min(NP, 8), min(NP, 8), 4], [W, 1, 1, 1],
                                        [3, 2, 1, 0])
    if NP == 16:
        x = gl.reshape(xt, [W, 2, 2, 2, 8, 2, 2, 4])  # w u c1 h g c0 b z
        x = gl.permute(x, [0, 3, 4, 1, 2, 5, 6, 7])
    else:
        x = gl.reshape(xt, [W, 2, 2, NP, 2, 2, 4])  # w u c1 n c0 b z
        x = gl.permute(x, [0, 3, 1, 2, 4, 5, 6])
    x = gl.convert_layout(gl.reshape(x, [W, 1, NP, 16, 4]), B5)
    x = gl.reshape(x, [W, 1, NP, 16, 2, 2])
    xa, xb = gl.split(x)  # z0 = 0, 1 -> [.., z1]
    x0, x2 = gl.split(xa)
    x1, x3 = gl.split(xb)
    R: gl.constexpr = 16 * T // NP
    x0 = gl.convert_layout(gl.reshape(gl.convert_layout(x0, B4).broadcast_to(W, R, NP, 16), [W, 16 * T, 16]), LW)
    x1 = gl.convert_layout(gl.reshape(gl.convert_layout(x1, B4).broadcast_to(W, R, NP, 16), [W, 16 * T, 16]), LW)
    x2 = gl.convert_layout(gl.reshape(gl.convert_layout(x2, B4).broadcast_to(W, R, NP, 16), [W, 16 * T, 16]), LW)
    x3 = gl.convert_layout(gl.reshape(gl.convert_layout(x3, B4).broadcast_to(W, R, NP, 16), [W, 16 * T, 16]), LW)
    return x0, x1, x2, x3


@gluon.jit
def _consumer(wbuf, sbuf, xbuf, ready, empty, out_ptr, row0, M, N, n_steps, out_stride_m, out_stride_n,
              m6, m2, m26, m29, m30, BOX: gl.constexpr, CONSUME: gl.constexpr,
              W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
              ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr):
    acc = gl.zeros([W, 16 * T, 16], gl.float32, LW)
    zi = gl.zeros([W, 16 * T, 16], gl.int32, LW)
    for i in range(n_steps):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        if CONSUME:
            if BOX == 0:
                w = wbuf.index(slot).load(LW)
            elif BOX == 1:
                w = wbuf.index(slot).permute([1, 0, 2]).load(LW)
            else:
                w = wbuf.index(slot).reshape([16 * T, W, 16]).permute([1, 0, 2]).load(LW)
            s = sbuf.index(slot).load(LW)
            xt = xbuf.index(slot).load(LX)
            x0, x1, x2, x3 = _x_operands(xt, W, T, NP, LW)
            acc = gl.inline_asm_elementwise(ASM, CONS, [acc, w, s, x0, x1, x2, x3, zi + m6, zi + m2, zi + m26, zi + m29,
                                                        zi + m30], dtype=gl.float32, is_pure=True, pack=P)
        async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
    out = gl.sum(acc, axis=0) * FOLD  # [16T, 16]
    LO: gl.constexpr = gl.SliceLayout(0, LW)
    tr = gl.arange(0, 16 * T, layout=gl.SliceLayout(1, LO))[:, None]
    tj = gl.arange(0, 16, layout=gl.SliceLayout(0, LO))[None, :]
    rows = row0 + 16 * (tr // 16) + 8 * (tj // 8) + tr % 8
    n = 8 * ((tr // 8) % 2) + 2 * ((tj // 2) % 4) + tj % 2
    gl.store(out_ptr + rows * out_stride_m + n * out_stride_n, out.to(gl.bfloat16), mask=(rows < M) & (n < N))


@gluon.jit
def engine_kernel(w_desc, s_desc, x_desc, out_ptr, M, N, K, out_stride_m, out_stride_n, m6, m2, m26, m29, m30,
                  BOX: gl.constexpr, CONSUME: gl.constexpr,
                  W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
                  ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr):
    row0 = gl.program_id(0) * (16 * T)
    n_steps = K // (256 * W)
    wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    sbuf = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=32 * W)
    gl.warp_specialize([
        (_consumer, (wbuf, sbuf, xbuf, ready, empty, out_ptr, row0, M, N, n_steps, out_stride_m, out_stride_n,
                     m6, m2, m26, m29, m30, BOX, CONSUME, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P)),
        (_producer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, row0, n_steps, W, STAGES, BOX)),
    ], [1], [40])


def build(wq, sc, x, out, W=4, T=1, STAGES=4, variant="full", box=0):
    """wq uint8 [M, K/2], sc uint8 [M, K/16] linear e4m3, x bf16 [N, K], out bf16 [N, M]."""
    M, K = wq.shape[0], wq.shape[1] * 2
    N = x.shape[0]
    NP = 16 if N > 8 else 1 << (N - 1).bit_length()
    w64 = wq.view(torch.int64)  # [M, K/16]
    if box == 0:
        w_desc = TensorDescriptor(w64, [K // 256, M, 16], [16, K // 16, 1], [W, 16 * T, 16],
                                  gl.NVMMASharedLayout(128, 64, rank=3))
    elif box == 1:
        w_desc = TensorDescriptor(w64, [M, K // 256, 16], [K // 16, 16, 1], [16 * T, W, 16],
                                  gl.NVMMASharedLayout(128, 64, rank=3))
    else:
        w_desc = TensorDescriptor(w64, [M, K // 16], [K // 16, 1], [16 * T, 16 * W], gl.NVMMASharedLayout(0, 64))
    s_desc = TensorDescriptor(sc, [K // 256, M, 16], [16, K // 16, 1], [W, 16 * T, 16],
                              gl.NVMMASharedLayout(0, 8, rank=3))
    x64 = x.view(torch.int64)  # [N, K/4]
    x_desc = TensorDescriptor(x64, [K // 64, N, 16], [16, K // 4, 1], [4 * W, NP, 16],
                              gl.NVMMASharedLayout(128, 64, rank=3))
    step = RegFold(T, 2 if N > 8 else 1, "full" if variant == "noconsume" else variant)
    LW, LX = layouts(W, T, NP)
    args = (w_desc, s_desc, x_desc, out, M, N, K, out.stride(1), out.stride(0), *MULTIPLIERS.values())
    kw = dict(W=W, T=T, STAGES=STAGES, NP=NP, FOLD=2.0 ** fold_exponent("nvfp4", "bf16", "fold"), ASM=step.text(),
              CONS=step.cons, LW=LW, LX=LX, P=8 * T, BOX=box, CONSUME=variant != "noconsume")
    grid = (triton.cdiv(M, 16 * T),)
    return args, kw, grid


# --- persistent variant: CTA c streams steps [c * total // C, (c + 1) * total // C) of the (tile, step) space,
# fp32 partials atomically added into an fp32 [N, M] buffer (zeroed by the caller) -----------------------------


@gluon.jit
def _p_producer(w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, first, last, S,
                W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr):
    for i in range(first, last):
        j = i - first
        slot = j % STAGES
        phase = (j // STAGES) & 1
        tile = i // S
        step = i % S
        mbarrier.wait(empty.index(slot), phase ^ 1)
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [step * W, tile * (16 * T), 0], ready.index(slot), wbuf.index(slot))
        tma.async_copy_global_to_shared(s_desc, [step * W, tile * (16 * T), 0], ready.index(slot), sbuf.index(slot))
        tma.async_copy_global_to_shared(x_desc, [4 * W * step, 0, 0], ready.index(slot), xbuf.index(slot))


@gluon.jit
def _p_consumer(wbuf, sbuf, xbuf, ready, empty, out_ptr, first, last, S, M, N, m6, m2, m26, m29, m30,
                BOX: gl.constexpr, CONSUME: gl.constexpr, EPI: gl.constexpr,
                W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
                ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr):
    acc = gl.zeros([W, 16 * T, 16], gl.float32, LW)
    zi = gl.zeros([W, 16 * T, 16], gl.int32, LW)
    LO: gl.constexpr = gl.SliceLayout(0, LW)
    tr = gl.arange(0, 16 * T, layout=gl.SliceLayout(1, LO))[:, None]
    tj = gl.arange(0, 16, layout=gl.SliceLayout(0, LO))[None, :]
    rloc = 16 * (tr // 16) + 8 * (tj // 8) + tr % 8
    n = 8 * ((tr // 8) % 2) + 2 * ((tj // 2) % 4) + tj % 2
    for i in range(first, last):
        j = i - first
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        if CONSUME:
            if BOX == 0:
                w = wbuf.index(slot).load(LW)
            elif BOX == 1:
                w = wbuf.index(slot).permute([1, 0, 2]).load(LW)
            else:
                w = wbuf.index(slot).reshape([16 * T, W, 16]).permute([1, 0, 2]).load(LW)
            s = sbuf.index(slot).load(LW)
            xt = xbuf.index(slot).load(LX)
            x0, x1, x2, x3 = _x_operands(xt, W, T, NP, LW)
            acc = gl.inline_asm_elementwise(ASM, CONS, [acc, w, s, x0, x1, x2, x3, zi + m6, zi + m2, zi + m26, zi + m29,
                                                        zi + m30], dtype=gl.float32, is_pure=True, pack=P)
        async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
        step = i % S
        if EPI:
            if (step == S - 1) | (i == last - 1):
                rows = (i // S) * (16 * T) + rloc
                gl.atomic_add(out_ptr + n * M + rows, gl.sum(acc, axis=0) * FOLD, mask=(rows < M) & (n < N))
                acc = gl.zeros([W, 16 * T, 16], gl.float32, LW)
    if not EPI:
        if last < 0:  # never: keeps the accumulator alive when the epilogue is off
            gl.atomic_add(out_ptr + n * M + rloc, gl.sum(acc, axis=0), mask=(rloc < M) & (n < N))


@gluon.jit
def persistent_kernel(w_desc, s_desc, x_desc, out_ptr, M, N, K, total, m6, m2, m26, m29, m30,
                      CONSUME: gl.constexpr, EPI: gl.constexpr,
                      W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
                      ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr):
    c = gl.program_id(0)
    C = gl.num_programs(0)
    first = (c * total) // C
    last = ((c + 1) * total) // C
    S = K // (256 * W)
    wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    sbuf = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=32 * W)
    gl.warp_specialize([
        (_p_consumer, (wbuf, sbuf, xbuf, ready, empty, out_ptr, first, last, S, M, N, m6, m2, m26, m29, m30,
                       0, CONSUME, EPI, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P)),
        (_p_producer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, first, last, S, W, T, STAGES)),
    ], [1], [40])


def build_persistent(wq, sc, x, out32, W=4, T=1, STAGES=4, variant="full", ctas=396, epi=True):
    """out32: fp32 [N, M], zeroed."""
    M, K = wq.shape[0], wq.shape[1] * 2
    N = x.shape[0]
    NP = 16 if N > 8 else 1 << (N - 1).bit_length()
    w64 = wq.view(torch.int64)
    w_desc = TensorDescriptor(w64, [K // 256, M, 16], [16, K // 16, 1], [W, 16 * T, 16],
                              gl.NVMMASharedLayout(128, 64, rank=3))
    s_desc = TensorDescriptor(sc, [K // 256, M, 16], [16, K // 16, 1], [W, 16 * T, 16],
                              gl.NVMMASharedLayout(0, 8, rank=3))
    x64 = x.view(torch.int64)
    x_desc = TensorDescriptor(x64, [K // 64, N, 16], [16, K // 4, 1], [4 * W, NP, 16],
                              gl.NVMMASharedLayout(128, 64, rank=3))
    step = RegFold(T, 2 if N > 8 else 1, "full" if variant == "noconsume" else variant)
    LW, LX = layouts(W, T, NP)
    tiles = triton.cdiv(M, 16 * T)
    total = tiles * (K // (256 * W))
    args = (w_desc, s_desc, x_desc, out32, M, N, K, total, *MULTIPLIERS.values())
    kw = dict(W=W, T=T, STAGES=STAGES, NP=NP, FOLD=2.0 ** fold_exponent("nvfp4", "bf16", "fold"), ASM=step.text(),
              CONS=step.cons, LW=LW, LX=LX, P=8 * T, CONSUME=variant != "noconsume", EPI=epi)
    return args, kw, (min(ctas, total),)
