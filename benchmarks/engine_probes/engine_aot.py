import sys, os, torch, triton, re
sys.path.insert(0, '/work/main/.dev'); sys.path.insert(0, '/work/main/tests'); sys.path.insert(0, '/work/main/src')
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from aot import jit_specialization, sass_instructions, registers, local_memory
import engine_probe as ep

M, K, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
W = int(sys.argv[4]) if len(sys.argv) > 4 else 4
T = int(sys.argv[5]) if len(sys.argv) > 5 else 1
wq = torch.zeros(M, K // 2, dtype=torch.uint8)
sc = torch.zeros(M, K // 16, dtype=torch.uint8)
x = torch.zeros(N, K, dtype=torch.bfloat16)
out = torch.zeros(N, M, dtype=torch.bfloat16)
args, kw, grid = ep.build(wq, sc, x, out, W=W, T=T, STAGES=int(sys.argv[8]) if len(sys.argv) > 8 else 4, variant=os.environ.get("VARIANT", "full"), box=int(os.environ.get("BOX", "0")))
fn = ep.engine_kernel
sig, const, attrs, marked = jit_specialization(fn, args, kw)
src = GluonASTSource(fn, sig, const, attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=W, maxnreg=int(sys.argv[6]) if len(sys.argv) > 6 else None))
open('/tmp/engine.ptx', 'w').write(c.asm['ptx'])
open('/tmp/engine.ttgir', 'w').write(c.asm['ttgir'])
open('/tmp/engine.llir', 'w').write(c.asm['llir'])
ins = sass_instructions(c)
open('/tmp/engine.sass', 'w').write("\n".join(ins))
print("regs", registers(c), "local", local_memory(c)[:3], "n instr", len(ins), "smem", c.metadata.shared)
from collections import Counter
ops = Counter(i.split()[0] if not i.startswith('@') else i.split()[1] for i in ins)
print(sorted(ops.items(), key=lambda kv: -kv[1])[:40])
