"""Probe: Gluon warp-specialized NVFP4 x bf16 GEMV, TMA ring, consumer decode+mma in inline PTX."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4gemv.kernels._mma_step import _Step, StepSpec, MULTIPLIERS, fold_exponent
from fp4gemv.kernels._ptx import PtxBlock


class RegFold(_Step):
    """fold step on registers: elements e = b + 2u + 4h + 8t of the thread's [W,16T,16] slice."""

    def __init__(self, tiles, n_tiles):
        PtxBlock.__init__(self)
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
        for t in range(tiles):
            for u in range(2):
                # activation registers of chunk u: blocks b=0,1, z=0..3 -> 16 b32 regs in K order
                raw = []
                for b in range(2):
                    for z in range(4):
                        lo, hi = self.reg("b32", f"xl{t}_{u}_{b}_{z}"), self.reg("b32", f"xh{t}_{u}_{b}_{z}")
                        self.emit(f"mov.b64 {{{lo}, {hi}}}, {op(f'x{z}', b + 2 * u + 8 * t)};")
                        raw += [lo, hi]
                bpairs = {}
                for nt in range(n_tiles):
                    # n-tile nt uses the h = nt registers of x (rows g + 8 nt)
                    rawn = []
                    for b in range(2):
                        for z in range(4):
                            lo, hi = self.reg("b32", f"y{nt}_{t}_{u}_{b}_{z}l"), self.reg("b32", f"y{nt}_{t}_{u}_{b}_{z}h")
                            self.emit(f"mov.b64 {{{lo}, {hi}}}, {op(f'x{z}', b + 2 * u + 4 * nt + 8 * t)};")
                            rawn += [lo, hi]
                    bpairs[nt] = self.float_pairs(rawn, f"b{nt}_{t}_{u}_")
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
                    a = [self.decode(words[h][q], f"a{t}_{u}_{h}_{q}") for h in range(2)]
                    for h in range(2):
                        for p in a[h]:
                            self.emit(f"mul.rn.bf16x2 {p}, {p}, {scales[h][q // 2]};")
                    for nt in range(n_tiles):
                        d = [f"${8 * t + 4 * nt + r}" for r in range(4)]
                        for mm in range(2):
                            frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                            self.mma(d, frag, [bpairs[nt][4 * q + 2 * mm], bpairs[nt][4 * q + 2 * mm + 1]], d)


def layouts(W, T, NP):
    import math
    LW = gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0])  # one warp: [16T, 16]
    # xt [4, NP, 16]: d0 = 2u + c1, d1 = n, d2 = 8 c0 + 4 b + z
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [2, 0, 0]] + ([[0, 8, 0]] if NP == 16 else [])
    g_lanes = [[0, 1 << i, 0] if (1 << i) < NP else [0, 0, 0] for i in range(3)]
    LX = gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 0, 8], [1, 0, 0]] + g_lanes,
                                    warp_bases=[], block_bases=[], shape=[4, NP, 16])
    return LW, LX


@gluon.jit
def _producer(w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
              out_stride_m, out_stride_n, m6, m2, m26, m29, m30,
              W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
              ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr,
              I: gl.constexpr):
    for i in range(n_steps):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(slot), phase ^ 1)
        mbarrier.expect(ready.index(slot),
                        W * (w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes))
        for j in gl.static_range(W):
            tma.async_copy_global_to_shared(w_desc, [row0, (i * W + j) * 16], ready.index(slot), wbuf.index(slot * W + j))
            tma.async_copy_global_to_shared(s_desc, [row0, (i * W + j) * 16], ready.index(slot), sbuf.index(slot * W + j))
            tma.async_copy_global_to_shared(x_desc, [4 * (i * W + j), 0, 0], ready.index(slot), xbuf.index(slot * W + j))
    LE: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
    mbarrier.wait(done, 0)
    acc = red.index(0).load(LE)
    for j in gl.static_range(1, W):
        acc += red.index(j).load(LE)
    out = acc * FOLD
    tr = gl.arange(0, 16 * T, layout=gl.SliceLayout(1, LE))[:, None]
    tj = gl.arange(0, 16, layout=gl.SliceLayout(0, LE))[None, :]
    rows = row0 + 16 * (tr // 16) + 8 * (tj // 8) + tr % 8
    n = 8 * ((tr // 8) % 2) + 2 * ((tj // 2) % 4) + tj % 2
    gl.store(out_ptr + rows * out_stride_m + n * out_stride_n, out.to(gl.bfloat16), mask=(rows < M) & (n < N))


@gluon.jit
def _x_operands(xt, T: gl.constexpr, NP: gl.constexpr, LW: gl.constexpr):
    B4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 4], [8 // min(NP, 8), min(NP, 8), 4, 1], [1, 1, 1, 1],
                                        [3, 2, 1, 0])
    B3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8 // min(NP, 8), min(NP, 8), 4], [1, 1, 1], [2, 1, 0])
    if NP == 16:
        x = gl.reshape(xt, [2, 2, 2, 8, 2, 2, 4])  # u c1 h g c0 b z
        x = gl.permute(x, [2, 3, 0, 1, 4, 5, 6])
    else:
        x = gl.reshape(xt, [2, 2, NP, 2, 2, 4])  # u c1 n c0 b z
        x = gl.permute(x, [2, 0, 1, 3, 4, 5])
    x = gl.convert_layout(gl.reshape(x, [1, NP, 16, 4]), B4)
    x = gl.reshape(x, [1, NP, 16, 2, 2])
    xa, xb = gl.split(x)  # z0 = 0, 1 -> [.., z1]
    x0, x2 = gl.split(xa)
    x1, x3 = gl.split(xb)
    R: gl.constexpr = 16 * T // NP
    x0 = gl.convert_layout(gl.reshape(gl.convert_layout(x0, B3).broadcast_to(R, NP, 16), [16 * T, 16]), LW)
    x1 = gl.convert_layout(gl.reshape(gl.convert_layout(x1, B3).broadcast_to(R, NP, 16), [16 * T, 16]), LW)
    x2 = gl.convert_layout(gl.reshape(gl.convert_layout(x2, B3).broadcast_to(R, NP, 16), [16 * T, 16]), LW)
    x3 = gl.convert_layout(gl.reshape(gl.convert_layout(x3, B3).broadcast_to(R, NP, 16), [16 * T, 16]), LW)
    return x0, x1, x2, x3


@gluon.jit
def _consumer(w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
              out_stride_m, out_stride_n, m6, m2, m26, m29, m30,
              W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
              ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr,
              I: gl.constexpr):
    acc = gl.zeros([16 * T, 16], gl.float32, LW)
    zi = gl.zeros([16 * T, 16], gl.int32, LW)
    for i in range(n_steps):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        w = wbuf.index(slot * W + I).load(LW)
        s = sbuf.index(slot * W + I).load(LW)
        xt = xbuf.index(slot * W + I).load(LX)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        x0, x1, x2, x3 = _x_operands(xt, T, NP, LW)
        acc = gl.inline_asm_elementwise(ASM, CONS, [acc, w, s, x0, x1, x2, x3, zi + m6, zi + m2, zi + m26, zi + m29,
                                                    zi + m30], dtype=gl.float32, is_pure=True, pack=P)
    red.index(I).store(acc)
    mbarrier.arrive(done, count=1)


@gluon.jit
def engine_kernel(w_desc, s_desc, x_desc, out_ptr, M, N, K, out_stride_m, out_stride_n, m6, m2, m26, m29, m30,
                  W: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, NP: gl.constexpr, FOLD: gl.constexpr,
                  ASM: gl.constexpr, CONS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, P: gl.constexpr,
                  CREGS: gl.constexpr):
    row0 = gl.program_id(0) * (16 * T)
    n_steps = K // (256 * W)
    wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES * W] + w_desc.block_type.shape, w_desc.layout)
    sbuf = gl.allocate_shared_memory(s_desc.dtype, [STAGES * W] + s_desc.block_type.shape, s_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES * W] + x_desc.block_type.shape, x_desc.layout)
    red = gl.allocate_shared_memory(gl.float32, [W, 16 * T, 16], gl.NVMMASharedLayout(0, 32))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=W)
    mbarrier.init(done, count=W)
    gl.warp_specialize([
            (_producer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
                         out_stride_m, out_stride_n, m6, m2, m26, m29, m30, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P, 0)),
            (_consumer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
                         out_stride_m, out_stride_n, m6, m2, m26, m29, m30, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P, 0)),
            (_consumer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
                         out_stride_m, out_stride_n, m6, m2, m26, m29, m30, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P, 1)),
            (_consumer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
                         out_stride_m, out_stride_n, m6, m2, m26, m29, m30, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P, 2)),
            (_consumer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, done, red, out_ptr, row0, M, N, n_steps,
                         out_stride_m, out_stride_n, m6, m2, m26, m29, m30, W, T, STAGES, NP, FOLD, ASM, CONS, LW, LX, P, 3)),
        ], [1, 1, 1, 1], [CREGS, CREGS, CREGS, CREGS])


def build(wq, sc, x, out, W=4, T=1, STAGES=4, CREGS=128):
    """wq uint8 [M, K/2], sc uint8 [M, K/16] linear e4m3, x bf16 [N, K], out bf16 [N, M]."""
    M, K = wq.shape[0], wq.shape[1] * 2
    N = x.shape[0]
    NP = 16 if N > 8 else 1 << (N - 1).bit_length()
    w64 = wq.view(torch.int64)  # [M, K/16]
    w_desc = TensorDescriptor(w64, [M, K // 16], [K // 16, 1], [16 * T, 16], gl.NVMMASharedLayout(128, 64))
    s_desc = TensorDescriptor(sc, [M, K // 16], [K // 16, 1], [16 * T, 16], gl.NVMMASharedLayout(0, 8))
    x64 = x.view(torch.int64)  # [N, K/4]
    x_desc = TensorDescriptor(x64, [K // 64, N, 16], [16, K // 4, 1], [4, NP, 16],
                              gl.NVMMASharedLayout(128 if NP >= 2 else 0, 64, rank=3))
    step = RegFold(T, 2 if N > 8 else 1)
    LW, LX = layouts(W, T, NP)
    args = (w_desc, s_desc, x_desc, out, M, N, K, out.stride(1), out.stride(0), *MULTIPLIERS.values())
    kw = dict(W=W, T=T, STAGES=STAGES, NP=NP, FOLD=2.0 ** fold_exponent("nvfp4", "bf16", "fold"), ASM=step.text(),
              CONS=step.cons, LW=LW, LX=LX, P=8 * T, CREGS=CREGS)
    grid = (triton.cdiv(M, 16 * T),)
    return args, kw, grid
