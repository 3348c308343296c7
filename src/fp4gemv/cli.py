"""The ``fp4gemv`` command line.

    fp4gemv task test       [--device cpu|cuda] [--seed N] [--full-range]
    fp4gemv task benchmark  [--device cpu|cuda] [--seed N] [--repeats N] [--inputs N]
    fp4gemv bench           [--shapes task|decode|all] [--format nvfp4|mxfp4] [--act fp4|fp16|bf16] [--n N,N,..]
                            [--out DIR] [--no-compile]   (GPU only)

Each top-level command is one ``_add_<command>_parser`` function listed in ``_COMMANDS``; it adds its
sub-parser and sets ``func``, which ``main`` calls with the parsed arguments and returns as the exit code.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from fp4gemv import task

__all__ = ["build_parser", "main"]

NO_GPU_NOTICE = "no CUDA GPU found: running the CPU reference path"


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
        print(NO_GPU_NOTICE if requested is None else "running the CPU reference path (--device cpu)")
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_checked(data: task.TaskInput, device: torch.device) -> tuple[task.Comparison, float]:
    """Run ``custom_kernel`` once on ``data`` with c poisoned, and compare with a fresh reference."""
    # NaN in c first: a kernel that skips some outputs cannot pass on c's previous contents.
    data[6].fill_(float("nan"))
    _synchronize(device)
    start = time.perf_counter()
    try:
        output = task.custom_kernel(data)
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
        from fp4gemv import bench

        return [us / 1e6 for us in bench.device_time_us(kernel, inputs, replays=repeats)]
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        kernel(inputs[i % len(inputs)])
        times.append(time.perf_counter() - start)
    return times


def _task_test(args: argparse.Namespace) -> int:
    device = _select_device(args.device)
    if device is None:
        return 2
    generate = task.generate_full_range_input if args.full_range else task.generate_input
    passed = failed = 0
    for index, shape in enumerate(task.TEST_SHAPES):
        data = generate(*shape, seed=args.seed + index, device=device)
        comparison, elapsed = _run_checked(data, device)
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


def _run_bench(args: argparse.Namespace) -> int:
    try:
        ns = [int(v) for v in args.n.split(",")]
    except ValueError:
        print(f"error: --n: expected comma-separated integers, got {args.n!r}", file=sys.stderr)
        return 2
    if not all(1 <= v <= 16 for v in ns):
        print(f"error: --n: expected values from 1 to 16, got {args.n!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: fp4gemv bench measures GPU kernels: no CUDA GPU found", file=sys.stderr)
        return 2
    from fp4gemv import bench

    shapes = {"task": bench.TASK_SHAPES, "decode": bench.DECODE_SHAPES,
              "all": bench.TASK_SHAPES + bench.DECODE_SHAPES}[args.shapes]
    bench.run(shapes, args.out, compile_baseline=not args.no_compile, fmt=args.format, act=args.act, ns=ns)
    return 0


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="time the kernels against a stream read and PyTorch baselines (GPU)")
    p.add_argument("--shapes", choices=("task", "decode", "all"), default="all")
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    p.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4", help="weight (and FP4 activation) format")
    p.add_argument("--act", choices=("fp4", "fp16", "bf16"), default="fp4",
                   help="activation: FP4 in the weights' format (W4A4) or a float dtype (W4A16)")
    p.add_argument("--n", default="1", help="activation rows (decode batch), comma-separated, each 1..16")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.set_defaults(func=_run_bench)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_task_parser, _add_bench_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4gemv", description="Fast FP4 (NVFP4 / MXFP4) GEMV kernels.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in _COMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the command, return its exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)
