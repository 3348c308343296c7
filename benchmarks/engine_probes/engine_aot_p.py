import sys, os, torch, triton
sys.path.insert(0, '/work/main/.dev'); sys.path.insert(0, '/work/main/tests'); sys.path.insert(0, '/work/main/src')
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from aot import jit_specialization, sass_instructions, registers, local_memory
import engine_probe as ep
M, K, N, W, T, R, S = [int(v) for v in sys.argv[1:8]]
wq = torch.zeros(M, K // 2, dtype=torch.uint8); sc = torch.zeros(M, K // 16, dtype=torch.uint8)
x = torch.zeros(N, K, dtype=torch.bfloat16); out = torch.zeros(N, M, dtype=torch.float32)
args, kw, grid = ep.build_persistent(wq, sc, x, out, W=W, T=T, STAGES=S, variant=os.environ.get("VARIANT", "full"), epi=bool(int(os.environ.get("EPI", "1"))))
fn = ep.persistent_kernel
sig, const, attrs, marked = jit_specialization(fn, args, kw)
c = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=W, maxnreg=R))
ins = sass_instructions(c)
open('/tmp/engine_p.sass', 'w').write("\n".join(ins))
print("regs", registers(c), "local", local_memory(c)[:3], "n instr", len(ins), "smem", c.metadata.shared)
