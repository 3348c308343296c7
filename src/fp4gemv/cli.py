"""The ``fp4gemv`` command line.

    fp4gemv --version
    fp4gemv task test       [--device cpu|cuda] [--backend auto|triton|triton-ptx|reference] [--seed N]
                            [--full-range]
    fp4gemv task benchmark  [--device cpu|cuda] [--seed N] [--repeats N] [--inputs N]
    fp4gemv bench           [--shapes task|decode|model|all|every] [--format nvfp4|mxfp4] [--act fp4|fp16|bf16]
                            [--n N,N,..] [--bf16] [--out DIR]   (GPU only)
    fp4gemv bench --host    host time per eager call, as a ratio to x.add_(1)   (GPU only)
    fp4gemv bench --model llama3-8b|llama3-70b [--n 1,8]   one decode token's linear layers   (GPU only)
    fp4gemv bench --model gpt-oss-20b|gpt-oss-120b|qwen3-30b-a3b [--n 1,8,16]
                            MoE layers of one decode step: parts, whole layer, host time   (GPU only)

(Tensor-parallel layers on N GPUs are timed by the benchmark script ``benchmarks/tp_layers.py`` under torchrun.)

Each top-level command is one ``_add_<command>_parser`` function listed in ``_COMMANDS``; it adds its
sub-parser and sets ``func``, which ``main`` calls with the parsed arguments and returns as the exit code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

import fp4gemv
from fp4gemv import bench, task
from fp4gemv.bench.host import format_host_table, host_costs
from fp4gemv.bench.model import decode_benchmark, format_decode_table
from fp4gemv.bench.moe import MOE_MODELS, format_moe_table, moe_benchmark
from fp4gemv.bench.prefill import PREFILL_TOKENS, format_prefill_table, prefill_benchmark
from fp4gemv.target import BACKENDS, interpreting

__all__ = ["build_parser", "main"]

NO_GPU_NOTICE = "no CUDA GPU found: running on the CPU"


def _progress(message: str) -> None:
    """One line of progress on stderr, so stdout stays the result table."""
    print(message, file=sys.stderr, flush=True)


def _format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _select_device(requested: str | None) -> torch.device | None:
    """The device to run on, announcing the CPU fallback; None (after an error message) if unavailable."""
    if requested == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA GPU found", file=sys.stderr)
        return None
    device = task.resolve_device(requested)
    if device.type == "cpu":
        print(NO_GPU_NOTICE if requested is None else "running on the CPU (--device cpu)")
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_checked(data: task.TaskInput, device: torch.device, backend: str = "auto") -> tuple[task.Comparison, float]:
    """Run ``custom_kernel`` once on ``data`` with c poisoned, and compare with a fresh reference."""
    # NaN in c first: a kernel that skips some outputs cannot pass on c's previous contents.
    data[6].fill_(float("nan"))
    _synchronize(device)
    start = time.perf_counter()
    try:
        output = task.custom_kernel(data) if backend == "auto" else task.custom_kernel(data, backend=backend)
        _synchronize(device)
    except (ValueError, TypeError, RuntimeError) as exc:
        return task.Comparison(False, f"custom_kernel raised {type(exc).__name__}: {exc}", -1, math.nan), math.nan
    elapsed = time.perf_counter() - start
    return task.compare_to_reference(output, task.reference_output(data)), elapsed


def _time_calls(
    kernel: Callable[[task.TaskInput], torch.Tensor],
    inputs: Sequence[task.TaskInput],
    device: torch.device,
    repeats: int,
) -> list[float]:
    """Seconds per call of ``kernel``, cycling through distinct inputs so no call finds its operands in L2.

    On CUDA: device time per launch by CUDA-graph replay of one call per input, L2 flushed before each of
    ``repeats`` replays (``bench.device_time_us``); eager event timing would measure the host's launch cost.
    On the CPU: the wall clock per call.  One untimed warm-up call first (Triton compiles on first use).
    """
    kernel(inputs[0])
    _synchronize(device)
    if device.type == "cuda":
        return [us / 1e6 for us in bench.device_time_us(kernel, inputs, replays=repeats)]
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        kernel(inputs[i % len(inputs)])
        times.append(time.perf_counter() - start)
    return times


def _task_test(args: argparse.Namespace) -> int:
    if args.backend == "triton-ptx" and args.device != "cuda" and task.resolve_device(args.device).type != "cuda":
        print(f"error: --backend triton-ptx: needs a CUDA GPU (its decode is PTX), got device "
              f"{task.resolve_device(args.device)}; --backend triton runs the pure-Triton paths on a CPU",
              file=sys.stderr)
        return 2
    device = _select_device(args.device)
    if device is None:
        return 2
    generate = task.generate_full_range_input if args.full_range else task.generate_input
    print(f"backend {args.backend}" + (" (the float64 reference on the CPU)" if device.type == "cpu" and args.backend
                                         == "auto" else ""))
    passed = failed = 0
    for index, shape in enumerate(task.TEST_SHAPES):
        data = generate(*shape, seed=args.seed + index, device=device)
        comparison, elapsed = _run_checked(data, device, args.backend)
        verdict = "PASS" if comparison.ok else "FAIL"
        print(f"{str(shape):<24} {verdict}  max abs err {comparison.max_abs_error:.3e}  {_format_seconds(elapsed)}")
        if comparison.ok:
            passed += 1
        else:
            failed += 1
            print(f"    {comparison.message}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def _task_benchmark(args: argparse.Namespace) -> int:
    if args.device is None and not torch.cuda.is_available():
        # Timing the float64 reference is no benchmark; only an explicit --device cpu asks for it.
        print("error: fp4gemv task benchmark times the GPU kernel: no CUDA GPU found "
              "(--device cpu times the float64 reference instead)", file=sys.stderr)
        return 2
    device = _select_device(args.device)
    if device is None:
        return 2
    # The CPU path is the float64 reference: seconds per call on the benchmark shapes, so few calls.
    repeats = args.repeats or (100 if device.type == "cuda" else 3)
    n_inputs = args.inputs or (4 if device.type == "cuda" else 1)
    shapes = task.BENCHMARK_SHAPES
    medians = []
    failed = 0
    for index, shape in enumerate(shapes):
        _progress(f"[{index + 1}/{len(shapes)}] {shape}: generating {n_inputs} input(s) and checking")
        seeds = [args.seed + 1000 * index + j for j in range(n_inputs)]
        inputs = [task.generate_input(*shape, seed=seed, device=device) for seed in seeds]
        comparison, _ = _run_checked(inputs[0], device)
        if not comparison.ok:
            failed += 1
            print(f"{str(shape):<24} FAIL  {comparison.message}")
            continue
        _progress(f"[{index + 1}/{len(shapes)}] {shape}: timing {repeats} calls")
        times = sorted(_time_calls(task.custom_kernel, inputs, device, repeats))
        median = times[len(times) // 2]
        medians.append(median)
        print(
            f"{str(shape):<24} median {_format_seconds(median)}  min {_format_seconds(times[0])}  "
            f"mean {_format_seconds(sum(times) / len(times))}  ({repeats} calls, {n_inputs} input(s), {device.type})"
        )
    if medians and not failed:
        geomean = math.exp(sum(math.log(t) for t in medians) / len(medians))
        print(f"geometric mean of medians: {_format_seconds(geomean)}")
    if failed:
        print(f"{failed} of {len(shapes)} shapes failed the check")
    return 1 if failed else 0


def _add_task_parser(commands: argparse._SubParsersAction) -> None:
    task_parser = commands.add_parser("task", help="the GPU MODE nvfp4_gemv task: check or time our kernel")
    actions = task_parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is found, else cpu"
    )
    common.add_argument("--seed", type=int, default=42, help="base seed; every shape and input gets its own seed from it")

    test = actions.add_parser("test", parents=[common], help="check custom_kernel on every test shape")
    test.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="auto: the kernels on CUDA, the float64 reference on the CPU; triton: the kernels' pure-Triton "
             "paths (on a CPU, in Triton's interpreter)")
    test.add_argument(
        "--full-range",
        action="store_true",
        help="all 16 e2m1 codes (negatives too) and scales over e4m3's whole range, not the task's 0..3 / {0,1,2}",
    )
    test.set_defaults(func=_task_test)

    bench = actions.add_parser(
        "benchmark", parents=[common], help="check, then time custom_kernel on the benchmark shapes"
    )
    bench.add_argument(
        "--repeats", type=_positive_int, default=None, help="timed calls per shape (default: 100 on cuda, 3 on cpu)"
    )
    bench.add_argument(
        "--inputs", type=_positive_int, default=None, help="distinct inputs, cycled (default: 4 on cuda, 1 on cpu)"
    )
    bench.set_defaults(func=_task_benchmark)


def _parse_ns(text: str) -> list[int] | None:
    try:
        ns = [int(v) for v in text.split(",")]
    except ValueError:
        return None
    return ns if all(1 <= v <= 16 for v in ns) else None


def _run_prefill(args: argparse.Namespace) -> int:
    """``bench --prefill``: the prefill table (bench.prefill), or with ``--model`` the model's linear layers at
    prefill sizes (default 2048 tokens)."""

    default = "2048" if args.model else ",".join(map(str, PREFILL_TOKENS))
    text = args.n if args.n is not None else default
    try:
        tokens = [int(v) for v in text.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        print(f"error: --n: expected comma-separated positive integers with --prefill, got {text!r}", file=sys.stderr)
        return 2
    if args.model in MOE_MODELS:
        print(f"error: --model: --prefill takes llama3-8b or llama3-70b (the MoE models have no prefill benchmark), "
              f"got {args.model!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: fp4gemv bench measures GPU kernels: no CUDA GPU found", file=sys.stderr)
        return 2
    if args.model:
        rows = decode_benchmark(args.model, tokens)
        _write_rows(args.out, f"prefill-{args.model}.json", rows)
        print(format_decode_table(rows))
        return 0
    rows = prefill_benchmark(tokens=tuple(tokens))
    _write_rows(args.out, "prefill.json", rows)
    print(format_prefill_table(rows))
    return 0


def _write_rows(out_dir: str, name: str, rows) -> None:
    """A benchmark's rows as ``out_dir/name`` (JSON)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(rows, f, indent=1)


def _run_bench(args: argparse.Namespace) -> int:
    if args.prefill:
        return _run_prefill(args)
    moe_model = args.model in MOE_MODELS
    n_text = args.n if args.n is not None else ("1,8,16" if moe_model else "1,8" if args.model else "1")
    ns = _parse_ns(n_text)
    if ns is None:
        print(f"error: --n: expected comma-separated integers from 1 to 16, got {n_text!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: fp4gemv bench measures GPU kernels: no CUDA GPU found", file=sys.stderr)
        return 2
    if args.host:
        print(format_host_table(host_costs()))
        return 0
    if moe_model:
        rows = moe_benchmark(args.model, ns)
        _write_rows(args.out, f"moe-{args.model}.json", rows)
        print(format_moe_table(rows))
        return 0
    if args.model:
        rows = decode_benchmark(args.model, ns)
        _write_rows(args.out, f"decode-{args.model}.json", rows)
        print(format_decode_table(rows))
        return 0
    bench.run(bench.SHAPE_SETS[args.shapes], args.out, fmt=args.format, act=args.act, ns=ns,
              bf16_baseline=args.bf16, scale_layout=args.scale_layout)
    return 0


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="time the kernels against the best read of the same bytes (GPU)")
    p.add_argument("--shapes", choices=("task", "decode", "model", "all", "every"), default="all",
                   help="task: the task's three benchmark shapes; decode: 4096x4096, 14336x4096, 4096x14336, "
                        "28672x8192; model: 1024x4096, 5760x2880, 2880x2880; all: task + decode; every: all three")
    p.add_argument("--out", default="bench-out", help="folder for bench.json")
    p.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4", help="weight (and FP4 activation) format")
    p.add_argument("--act", choices=("fp4", "fp16", "bf16"), default="fp4",
                   help="activation: FP4 in the weights' format (W4A4) or a float dtype (W4A16)")
    p.add_argument("--n", default=None, help="activation rows (decode batch), comma-separated, each 1..16 "
                                             "(default: 1; with --model: 1,8, 1,8,16 for an MoE model)")
    p.add_argument("--scale-layout", choices=("swizzled", "linear"), default="swizzled",
                   help="the weights' scale layout (the table's cases; the task's own case keeps the task's tuples): "
                        "linear runs the decode engine from N = 9 with bf16 activations")
    p.add_argument("--bf16", action="store_true",
                   help="also time the product with bf16 weights (torch.matmul) and with e4m3 weights and activation "
                        "(torch._scaled_mm, per-tensor scales), the ratios beside")
    p.add_argument("--host", action="store_true",
                   help="instead: host time per eager call of gemv and task.custom_kernel against x.add_(1)")
    p.add_argument("--model", choices=("llama3-8b", "llama3-70b", *MOE_MODELS), default=None,
                   help="instead: one decode token through the model's linear layers, FP4Linear (NVFP4 weight-only) "
                        "against bf16 nn.Linear, in a CUDA graph and eager; writes decode-MODEL.json.  gpt-oss-* "
                        "(MXFP4), qwen3-30b-a3b (NVFP4): its MoE layer at T = --n tokens (default 1,8,16): the routed "
                        "GEMVs (fp4gemv.moe_gemv) against the best read, the layer's parts (routing, gate_up with the "
                        "activation, down, combine) and the whole FP4Experts layer, each in a CUDA graph, the host "
                        "time of eager calls, bf16 experts in torch and triton_kernels' figures (gpt-oss) beside "
                        "(fp4gemv.bench.moe); writes moe-MODEL.json")
    p.add_argument("--prefill", action="store_true",
                   help="instead: FP4Linear (NVFP4, MXFP4; bf16 activations) against bf16 F.linear and FP8 "
                        "torch._scaled_mm at T = 32 .. 8192 tokens (--n: the token counts) on the decode shapes; "
                        "with --model: the model's linear layers at 2048 tokens; writes prefill*.json")
    p.set_defaults(func=_run_bench)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_task_parser, _add_bench_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4gemv", description="Fast FP4 (NVFP4 / MXFP4) GEMV kernels.")
    parser.add_argument("--version", action="version", version=f"fp4gemv {fp4gemv.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in _COMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the command, return its exit code."""
    args = build_parser().parse_args(argv)
    if getattr(args, "backend", "auto") == "triton" and not torch.cuda.is_available() and not interpreting():
        # Triton picks its interpreter when kernels are defined, at import: run again with it switched on.
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execvpe(sys.executable, [sys.executable, "-m", "fp4gemv", *argv], {**os.environ, "TRITON_INTERPRET": "1"})
    return args.func(args)
