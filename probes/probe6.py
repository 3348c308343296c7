"""GPU probe 1: TMA-streamed W4A16 skeleton (p8 decode, tl.dot/wgmma) vs the current kernels, FP8, bf16, reads."""
import os, sys, time, statistics, json
sys.path.insert(0, "src"); sys.path.insert(0, ".proto")
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
import fp4gemv
from fp4gemv import FP4Tensor, gemv
from fp4gemv.bench.timing import device_time_us, input_count
from fp4gemv.bench.stream import stream_read
import p11

DEV = "cuda"
RES = []

@triton.jit
def w4_kernel(w_desc, s_desc, x_ptr, out_ptr, M, K, N, s_stride_m, x_stride_n, out_stride_m,
              BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, KSPLIT: tl.constexpr,
              ASM: tl.constexpr, ATOMIC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    k_per = K // KSPLIT
    k_lo = pid_k * k_per
    for k0 in tl.range(k_lo, k_lo + k_per, BK, num_stages=STAGES):
        wp = w_desc.load([row0, k0 // 2])
        sc = s_desc.load([row0, k0 // 16])
        x = tl.load(x_ptr + n[:, None] * x_stride_n + (k0 + tl.arange(0, BK))[None, :], mask=n[:, None] < N, other=0.0)
        r = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [wp], dtype=tl.int32, is_pure=True, pack=4)
        v = tl.reshape(tl.join(r.to(tl.int16), (r >> 16).to(tl.int16)), [BM, BK]).to(tl.bfloat16, bitcast=True)
        s = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e+35).to(tl.bfloat16)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BK // 16, 16]), [BM, BK])
        acc = tl.dot(v * s, tl.trans(x), acc)
    out = acc * 128.0
    ptrs = out_ptr + rows[:, None] * out_stride_m + n[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, out, mask=n[None, :] < N, sem="relaxed")
    else:
        tl.store(ptrs, out, mask=n[None, :] < N)

@triton.jit
def tma_read_kernel(w_desc, out_ptr, K, BM: tl.constexpr, BKB: tl.constexpr, STAGES: tl.constexpr, KSPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb_per = (K // 2) // KSPLIT
    acc = tl.zeros([BM, BKB], tl.uint8)
    for kb in tl.range(pid_k * kb_per, (pid_k + 1) * kb_per, BKB, num_stages=STAGES):
        acc ^= w_desc.load([pid_m * BM, kb])
    tl.store(out_ptr + (pid_m * KSPLIT + pid_k) * BM + tl.arange(0, BM), tl.xor_sum(acc, axis=1))

def t_us(launch, inputs):
    return statistics.median(device_time_us(launch, inputs))

def make_weights(m, k, copies, g):
    ws = []
    base = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=DEV, generator=g)
    sc = torch.randint(0x20, 0x50, (m, k // 16), dtype=torch.uint8, device=DEV, generator=g)
    for i in range(copies):
        ws.append(FP4Tensor(base.clone(), sc.clone(), "nvfp4", "linear"))
    return ws

def run_shape(m, k, ns, configs):
    g = torch.Generator(device=DEV); g.manual_seed(0)
    wbytes = m * k // 2 + m * k // 16
    copies = input_count(wbytes)
    ws = make_weights(m, k, copies, g)
    # correctness reference on copy 0
    for n in ns:
        x = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g)
        ref = (ws[0].dequantize(torch.float32).double() @ x.double().T)
        row = dict(shape=f"{m}x{k}", n=n)
        cur = gemv(ws[0], x, out_dtype=torch.bfloat16)
        row["gemv_err"] = ((cur.double() - ref).abs().max() / ref.abs().max()).item()
        row["gemv_us"] = round(t_us(lambda w: gemv(w, x, out_dtype=torch.bfloat16), ws), 2)
        row["gemv_kernel"] = fp4gemv.select_kernel(ws[0], x, out_dtype=torch.bfloat16).name
        for cfg in configs:
            BM, BK, STAGES, warps, KSPLIT = cfg
            if k % (BK * KSPLIT) or m % BM: continue
            BN = 16
            descs = [TensorDescriptor(w.data, [m, k // 2], [k // 2, 1], [BM, BK // 2]) for w in ws]
            sdescs = [TensorDescriptor(w.scales, [m, k // 16], [k // 16, 1], [BM, BK // 16]) for w in ws]
            out = torch.zeros(m, BN, device=DEV, dtype=torch.float32)
            def launch(i, out=out):
                w = ws[i]
                w4_kernel[(m // BM, KSPLIT)](descs[i], sdescs[i], x, out, m, k, n, w.scales.stride(0), x.stride(0), out.stride(0),
                                              BM=BM, BK=BK, BN=BN, STAGES=STAGES, KSPLIT=KSPLIT, ASM=p11.DECODE,
                                              ATOMIC=KSPLIT > 1, num_warps=warps)
            try:
                out.zero_(); launch(0); torch.cuda.synchronize()
                err = ((out[:, :n].double() - ref).abs().max() / ref.abs().max()).item()
                us = t_us(launch, list(range(copies)))
            except Exception as e:
                err, us = str(e)[:80], float("nan")
            row[f"w4 {cfg}"] = (round(us, 2), err if isinstance(err, str) else float(f"{err:.2e}"))
        RES.append(row)
        print(json.dumps(row), flush=True)
    if os.environ.get("W4_ONLY"):
        del ws; torch.cuda.empty_cache(); return
    # bare TMA read of the weights (data only) for several boxes
    rr = dict(shape=f"{m}x{k}", what="tma_read(data bytes only)", bytes=m * k // 2)
    for BM, BKB, STAGES, KSPLIT in ((64, 128, 4, 1), (64, 256, 4, 1), (128, 128, 4, 1), (32, 256, 6, 1), (64, 128, 6, 2), (16, 256, 6, 1)):
        if (k // 2) % (BKB * KSPLIT) or m % BM: continue
        descs = [TensorDescriptor(w.data, [m, k // 2], [k // 2, 1], [BM, BKB]) for w in ws]
        out = torch.empty(m // BM * KSPLIT * BM, dtype=torch.uint8, device=DEV)
        launch = lambda i: tma_read_kernel[(m // BM, KSPLIT)](descs[i], out, k, BM=BM, BKB=BKB, STAGES=STAGES, KSPLIT=KSPLIT, num_warps=4)
        rr[f"{BM}x{BKB} s{STAGES} ks{KSPLIT}"] = round(t_us(launch, list(range(copies))), 2)
    # triton read of data + scales bytes
    bufs = [torch.empty(wbytes // 8 * 8, dtype=torch.uint8, device=DEV) for _ in range(copies)]
    o = torch.empty(1 << 16, dtype=torch.int64, device=DEV)
    rr["triton_read_pdl(data+scales)"] = round(t_us(lambda b: stream_read(b, o, pdl=True), bufs), 2)
    del bufs
    # FP8 and bf16 peers
    for n in ns:
        w8 = [torch.randn(m, k, device=DEV).to(torch.float8_e4m3fn) for _ in range(max(20, -(-300_000_000 // (m * k))))]
        x8 = torch.randn(max(n, 16), k, device=DEV).to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        rr[f"fp8 N={n}"] = round(t_us(lambda w: torch._scaled_mm(x8[:max(n,16)] if n < 16 else x8, w.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), w8), 2)
        del w8
        wb = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for _ in range(max(20, -(-300_000_000 // (2 * m * k))))]
        xb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        rr[f"bf16 N={n}"] = round(t_us(lambda w: torch.matmul(xb, w.T), wb), 2)
        del wb
    RES.append(rr); print(json.dumps(rr), flush=True)
    del ws; torch.cuda.empty_cache()

CONFIGS = eval(os.environ["CONFIGS"]) if os.environ.get("CONFIGS") else [(64, 256, 4, 4, 1), (64, 512, 4, 4, 1), (64, 256, 6, 4, 1), (128, 256, 4, 8, 1), (128, 256, 4, 4, 1),
           (64, 256, 4, 4, 2), (64, 256, 4, 4, 4), (64, 512, 3, 4, 2)]
if __name__ == "__main__":
    t0 = time.time()
    for m, k in eval(os.environ.get("SHAPES", "((7168, 16384), (28672, 8192), (4096, 4096), (14336, 4096))")):
        run_shape(m, k, (1, 16), CONFIGS)
        print("elapsed", round(time.time() - t0), flush=True)
    json.dump(RES, open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("NAME", "probe") + ".json"), "w"), indent=1)
