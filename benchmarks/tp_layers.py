"""Device script: tensor-parallel decode GEMVs on N GPUs against one GPU, one process per GPU (torchrun).

    PYTHONPATH=src torchrun --nproc-per-node N benchmarks/tp_layers.py --tp N [--format nvfp4|mxfp4]
             [--act bf16|fp16] [--n 1,8] [--out DIR]        (benchmarks/bench_tp.sh runs both activations)

Layers (``fp4gemv.nn.parallel``, random FP4 weights with swizzled scales): 28672x8192 column-parallel, its
outputs all-gathered, and 8192x28672 row-parallel, its input already split (``input_is_parallel``), the
partial sums all-reduced in float32; N = 1 and 8 tokens by default; weight-only, activations in bfloat16
(default) or float16.  W4A4 is not timed: ``FP4Linear`` checks a W4A4 activation for NaN on the host
(``fp4gemv.quantize``'s ``check_values``), a synchronisation that a CUDA graph cannot hold.

Every rank measures, by CUDA-graph replay with L2 flushed (``timing.device_time_us``) over distinct layers
(several times L2), with the ranks lined up before each replay (a one-element all-reduce, then a spin of
about 50 us so that every host has queued the replay before any device starts it):

* ``one_gpu_us``: the whole layer on this rank's GPU (all ranks at once, each on its own GPU);
* ``local_us``: this rank's shard, no collective (``forward_local``);
* ``<collective>_us``: the shard with its collective, for each of ``fp4gemv.nn.parallel.COLLECTIVES``
  (``default`` is NCCL; ``symm_mem`` torch's symmetric-memory one-shot all-reduce), or None where the
  collective cannot run the case (symm_mem: float32 and bfloat16 only).

Rank 0 prints, per case, the slowest rank's times, the communication share ``1 - local / with``, the
speed-ups ``one_gpu / local`` (the GEMV part) and ``one_gpu / with`` (the fastest collective), and the
largest difference of the parallel layer's output from the whole layer's on one input, relative to the
output's largest magnitude (column-parallel: 0 unless the kernel's configuration differs between the shard's
and the whole layer's row count; row-parallel: the float32 summation order); it writes ``bench_tp.json``
with every rank's numbers.  NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set before the process group starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from fp4gemv import formats, layouts
from fp4gemv.bench.timing import device_time_us, input_count, summarize
from fp4gemv.nn import ColumnParallelFP4Linear, FP4Linear, RowParallelFP4Linear
from fp4gemv.nn.parallel import COLLECTIVES

__all__ = ["TP_LAYERS", "MULTICAST_OFF", "ACT_DTYPES", "check_launch", "random_layer", "parallel_layer", "output_error",
           "measure_case", "summarize_case", "format_tp_table", "run_tp"]

# (split, out_features, in_features): an MLP's up projection (column) and down projection (row) at 8192 hidden.
TP_LAYERS = (("column", 28672, 8192), ("row", 8192, 28672))
# NVLink multicast (NVLS in NCCL, multimem in torch's symmetric memory) stays off on the machines we use.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_SPIN_CYCLES = 100_000  # ~50 us at H200 clocks: longer than a host takes to queue one graph replay
ACT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_launch(tp: int, environ=os.environ) -> tuple[int, int]:
    """(rank, local rank) of this process; ValueError with what to do when not launched as torchrun does
    for ``tp`` processes, or when this machine has fewer GPUs than that."""
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in environ]
    if missing:
        raise ValueError(f"--tp {tp}: expected one process per GPU started by torchrun "
                         f"(torchrun --nproc-per-node {tp} benchmarks/tp_layers.py --tp {tp}); {', '.join(missing)} "
                         f"not set")
    world = int(environ["WORLD_SIZE"])
    if world != tp:
        raise ValueError(f"--tp {tp}: expected WORLD_SIZE = {tp} processes (torchrun --nproc-per-node {tp}), "
                         f"got {world}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < tp:
        raise ValueError(f"--tp {tp}: expected {tp} CUDA GPUs, found {gpus}")
    return int(environ["RANK"]), int(environ["LOCAL_RANK"])


def random_layer(m: int, k: int, fmt: str, seed: int, device, scale_layout: str = "swizzled") -> FP4Linear:
    """A weight-only ``FP4Linear`` [m, k] of random bytes (every code), power-of-two block scales 2^-4 .. 2^3
    and a unit per-tensor scale (NVFP4); no bias."""
    f = formats.FORMATS[fmt]
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=device, generator=g)
    powers = torch.exp2(torch.randint(-4, 4, (m, k // f.block_size), device=device, generator=g).float())
    encode = formats.encode_e4m3 if f.scale_dtype == torch.float8_e4m3fn else formats.encode_e8m0
    scales = formats.as_uint8(encode(powers))
    if scale_layout == "swizzled":
        scales = layouts.swizzle_scales(scales)
    tensors = {"weight": data, "weight_scale": scales.view(f.scale_dtype)}
    if fmt == "nvfp4":
        tensors["weight_scale_2"] = torch.ones((), device=device)
    return FP4Linear.from_state_dict(tensors, activations="weight-only")


def parallel_layer(split: str, whole: FP4Linear, collective: str):
    """The shard of ``whole`` the benchmark times: column-parallel gathered, row-parallel with split input."""
    if split == "column":
        return ColumnParallelFP4Linear.from_fp4linear(whole, gather_output=True, collective=collective)
    return RowParallelFP4Linear.from_fp4linear(whole, input_is_parallel=True, collective=collective)


def parallel_input(split: str, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if split == "column":
        return x
    k = x.shape[-1] // world
    return x[:, rank * k:(rank + 1) * k].contiguous()


def output_error(split: str, whole: FP4Linear, layer, x: torch.Tensor, rank: int, world: int) -> float:
    """max |parallel - whole| / max |whole| on x (a collective call: every rank runs it)."""
    y = whole(x).float()
    y_tp = layer(parallel_input(split, x, rank, world)).float()
    return float((y_tp - y).abs().max()) / max(float(y.abs().max()), 1e-30)


def summarize_case(per_rank: Sequence[dict]) -> dict:
    """One row from every rank's medians: the slowest rank's times and what follows from them."""
    def slowest(name):
        values = [r.get(name) for r in per_rank]
        return None if any(v is None for v in values) else max(values)

    row = {"one_gpu_us": slowest("one_gpu_us"), "local_us": slowest("local_us")}
    for c in COLLECTIVES:
        row[f"{c}_us"] = slowest(f"{c}_us")
    timed = {c: row[f"{c}_us"] for c in COLLECTIVES if row[f"{c}_us"] is not None}
    if not timed:
        raise ValueError(f"per_rank: expected a time with a collective, got {per_rank}")
    best = min(timed, key=timed.get)
    row["best_collective"] = best
    row["comm_share"] = 1.0 - row["local_us"] / timed[best]
    row["speedup_gemv"] = row["one_gpu_us"] / row["local_us"]
    row["speedup"] = row["one_gpu_us"] / timed[best]
    row["max_rel_error"] = max(r["rel_error"] for r in per_rank)
    return row


def format_tp_table(rows: Sequence[dict], tp: int) -> str:
    head = (f"{'split':>6} {'M x K':>12} {'N':>2} {'1 GPU us':>9} {'local us':>9} "
            + " ".join(f"{c + ' us':>12}" for c in COLLECTIVES)
            + f" {'comm':>5} {'x gemv':>6} {'x all':>6}  best       rel err")
    lines = [f"tensor-parallel over {tp} GPUs (slowest rank; x gemv = 1 GPU / local, x all = 1 GPU / best)", head]
    for r in rows:
        times = " ".join(f"{'n/a':>12}" if r[f"{c}_us"] is None else f"{r[f'{c}_us']:>12.2f}" for c in COLLECTIVES)
        lines.append(f"{r['split']:>6} {r['m']:>5}x{r['k']:<6} {r['n']:>2} {r['one_gpu_us']:>9.2f} "
                     f"{r['local_us']:>9.2f} {times} {r['comm_share']:>5.0%} {r['speedup_gemv']:>6.2f} "
                     f"{r['speedup']:>6.2f}  {r['best_collective']:<10} {r['max_rel_error']:.1e}")
    return "\n".join(lines)


def measure_case(split: str, m: int, k: int, n: int, fmt: str, act: str, rank: int, world: int, sync, device,
                 collectives: Sequence[str] = COLLECTIVES, time_us: Callable = device_time_us,
                 count_inputs: Callable[[int], int] = input_count) -> dict:
    """This rank's medians for one case (module docstring) and its output's relative error (a collective call:
    every rank runs it); ``time_us`` and ``count_inputs``: the timer and the number of distinct layers timed."""
    x = torch.randn(n, k, generator=torch.Generator(device=device).manual_seed(1), device=device,
                    dtype=ACT_DTYPES[act])
    x_tp = parallel_input(split, x, rank, world)
    whole_bytes = m * k // 2 + m * k // formats.FORMATS[fmt].block_size
    result: dict = {}

    wholes = [random_layer(m, k, fmt, seed=i, device=device) for i in range(count_inputs(whole_bytes))]
    result["one_gpu_us"] = summarize(time_us(lambda layer: layer(x), wholes, before_replay=sync))["median_us"]
    check_whole = wholes[0]
    del wholes[1:]
    torch.cuda.empty_cache()

    count = count_inputs(whole_bytes // world)
    for collective in collectives:
        try:
            first = parallel_layer(split, check_whole, collective)
            error = output_error(split, check_whole, first, x, rank, world)
        except TypeError:  # the collective does not take this dtype
            result[f"{collective}_us"] = None
            continue
        if collective == "default":
            result["rel_error"] = error
        shards = [first] + [parallel_layer(split, random_layer(m, k, fmt, seed=i, device=device), collective)
                            for i in range(1, count)]
        if collective == "default":
            result["local_us"] = summarize(time_us(lambda layer: layer.forward_local(x_tp), shards,
                                                          before_replay=sync))["median_us"]
        result[f"{collective}_us"] = summarize(time_us(lambda layer: layer(x_tp), shards,
                                                              before_replay=sync))["median_us"]
        shards.clear()
        torch.cuda.empty_cache()
    return result


def run_tp(tp: int, out_dir: str, fmt: str = "nvfp4", act: str = "bf16", ns: Sequence[int] = (1, 8)) -> list[dict]:
    """The benchmark on this process's rank (launched by torchrun); rank 0 prints and writes ``bench_tp.json``."""
    rank, local_rank = check_launch(tp)
    os.environ.update(MULTICAST_OFF)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    try:
        token = torch.zeros(1, device=device)

        def sync():
            dist.all_reduce(token)
            torch.cuda._sleep(_SPIN_CYCLES)

        rows = []
        for split, m, k in TP_LAYERS:
            for n in ns:
                if rank == 0:
                    print(f"measuring {split}-parallel {m}x{k} {fmt} {act} N={n} on {tp} GPUs ...", flush=True)
                mine = measure_case(split, m, k, n, fmt, act, rank, tp, sync, device)
                per_rank: list = [None] * tp
                dist.all_gather_object(per_rank, mine)
                rows.append({"split": split, "m": m, "k": k, "n": n, "fmt": fmt, "act": act,
                             **summarize_case(per_rank), "per_rank": per_rank})
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tp": tp,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())), "env": MULTICAST_OFF}
            with open(os.path.join(out_dir, "bench_tp.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            print(format_tp_table(rows, tp))
        return rows
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tensor-parallel FP4Linear layers on N GPUs against one (torchrun)")
    parser.add_argument("--tp", type=int, required=True, help="GPUs, one process each (torchrun --nproc-per-node)")
    parser.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4")
    parser.add_argument("--act", choices=tuple(ACT_DTYPES), default="bf16",
                        help="activation dtype (W4A4 is not timed: its NaN check synchronises, which a graph "
                             "cannot hold)")
    parser.add_argument("--n", default="1,8", help="tokens, comma-separated, each 1..16")
    parser.add_argument("--out", default="bench-out", help="folder for bench_tp.json")
    args = parser.parse_args(argv)
    ns = [int(v) for v in args.n.split(",")]
    if not all(1 <= v <= 16 for v in ns):
        parser.error(f"--n: expected comma-separated integers from 1 to 16, got {args.n!r}")
    try:
        check_launch(args.tp)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_tp(args.tp, args.out, fmt=args.format, act=args.act, ns=ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
