"""The two-process half of tests/test_nn_parallel.py: each rank of a gloo group runs every case and writes
``{case: error message or None}`` to ``<out>/rank<r>.json``; the test file asserts on what they wrote.

Layers are read from the checkpoints the test wrote (one per convention) with sharded loading, and compared
with the whole layer read by ``FP4Linear.from_state_dict``, run on the same rank with the same CPU path
(``fp4gemv.gemv``'s float64 reference, one rounding to the output dtype).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import traceback

import torch
import torch.distributed as dist

from fp4gemv import dequantize
from fp4gemv.nn import ColumnParallelFP4Linear, FP4Linear, RowParallelFP4Linear
from fp4gemv.nn.checkpoints import SafetensorsDirectory

U32 = 2.0 ** -24
CONVENTIONS = ("compressed-tensors", "modelopt", "gpt-oss")
PREFIX = "layer"


def _whole(directory: str) -> FP4Linear:
    tensors = SafetensorsDirectory(directory)
    try:
        return FP4Linear.from_state_dict(tensors, PREFIX)
    finally:
        tensors.close()


def _x(tokens: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, k, generator=g).to(dtype)


def row_bound(layer: FP4Linear, x: torch.Tensor, world: int, activation=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, the bound on |s - S|): S the exact sums [T, N], the fp32 reduction's bound of the module docstring,
    plus the float64 accumulation of the oracle (K 2^-53 sum |w x|, both ways)."""
    w = dequantize(layer.quantized_weight(), torch.float64)
    xv = (dequantize(activation, torch.float64) if activation is not None else x.to(torch.float64))
    k_local = layer.in_features // world
    partials = [xv[:, r * k_local:(r + 1) * k_local] @ w[:, r * k_local:(r + 1) * k_local].t() for r in range(world)]
    exact = sum(partials)
    gamma = (world - 1) * U32 / (1 - (world - 1) * U32)
    bound = (U32 + (1 + U32) * gamma) * sum(p.abs() for p in partials)
    bound = bound + 2 * layer.in_features * 2.0 ** -53 * (xv.abs() @ w.abs().t())
    return exact, bound


def _check_row_fp32(y_tp, y_one, exact, bound, what):
    # y_one = fl32(S); y_tp is the float32 sum itself (reduce and output dtype are float32).
    err = (y_tp.double() - y_one.double()).abs()
    limit = bound + U32 * exact.abs()
    assert bool((err <= limit).all()), (
        f"{what}: |y_tp - y_one| exceeds the bound at {int((err > limit).sum())} outputs "
        f"(max excess {float((err - limit).max()):.3e})")


def adjacent_or_equal(y_tp, y_one, exact, bound) -> torch.Tensor:
    """Per output: equal, or neighbours in the output dtype with a rounding boundary (their midpoint)
    within ``bound`` of the exact sum: the only way one rounding of s and one of S can differ."""
    same = y_tp == y_one
    up = torch.nextafter(y_one, torch.full_like(y_one, math.inf))
    down = torch.nextafter(y_one, torch.full_like(y_one, -math.inf))
    neighbour = (y_tp == up) | (y_tp == down)
    midpoint = (y_tp.double() + y_one.double()) / 2
    near = (midpoint - exact).abs() <= bound
    return same | (neighbour & near)


def case_column_gathered(world, rank, dirs):
    for convention in CONVENTIONS:
        whole = _whole(dirs[convention])
        layer = ColumnParallelFP4Linear.from_safetensors(dirs[convention], PREFIX)
        for tokens, dtype in ((1, torch.float32), (3, torch.float16), (16, torch.bfloat16)):
            x = _x(tokens, whole.in_features, dtype, seed=tokens)
            y_tp, y_one = layer.to(dtype)(x), whole.to(dtype)(x)
            assert y_tp.shape == y_one.shape, f"{convention}: shape {tuple(y_tp.shape)} != {tuple(y_one.shape)}"
            assert torch.equal(y_tp, y_one), (f"{convention} T={tokens} {dtype}: gathered output differs at "
                                              f"{int((y_tp != y_one).sum())} places")
        x3 = _x(6, whole.in_features, torch.float32, seed=9).reshape(2, 3, -1)
        assert torch.equal(layer.float()(x3), whole.float()(x3)), f"{convention}: [2, 3, K] input"


def case_column_sharded_output(world, rank, dirs):
    for convention in CONVENTIONS:
        whole = _whole(dirs[convention])
        layer = ColumnParallelFP4Linear.from_safetensors(dirs[convention], PREFIX, gather_output=False)
        x = _x(4, whole.in_features, torch.float32, seed=4)
        n = whole.out_features // world
        assert torch.equal(layer(x), whole(x)[:, rank * n:(rank + 1) * n]), f"{convention}: this rank's slice"


def _row_cases(world, rank, dirs, input_is_parallel):
    for convention in CONVENTIONS:
        whole = _whole(dirs[convention])
        layer = RowParallelFP4Linear.from_safetensors(dirs[convention], PREFIX, input_is_parallel=input_is_parallel)
        # The sums here; the bias on its own in case_bias_once.
        whole.bias, layer.bias = None, None
        k = whole.in_features // world
        layer16, whole16 = RowParallelFP4Linear.from_safetensors(
            dirs[convention], PREFIX, input_is_parallel=input_is_parallel), _whole(dirs[convention])
        layer16.bias, whole16.bias = None, None
        for tokens in (1, 5):
            x = _x(tokens, whole.in_features, torch.float32, seed=10 + tokens)
            x_in = x[:, rank * k:(rank + 1) * k] if input_is_parallel else x
            exact, bound = row_bound(whole, x, world)
            y_tp, y_one = layer(x_in), whole(x)
            _check_row_fp32(y_tp, y_one, exact, bound, f"{convention} T={tokens}")
            # float16 out: the one rounding of the fp32 sum against the single layer's one rounding of S.
            x16 = x.half()
            exact16, bound16 = row_bound(whole16, x16, world)
            x16_in = x16[:, rank * k:(rank + 1) * k] if input_is_parallel else x16
            ok = adjacent_or_equal(layer16(x16_in), whole16(x16), exact16, bound16)
            assert bool(ok.all()), f"{convention} T={tokens} fp16: {int((~ok).sum())} outputs beyond one rounding"


def case_row_parallel_input(world, rank, dirs):
    _row_cases(world, rank, dirs, True)


def case_row_whole_input(world, rank, dirs):
    _row_cases(world, rank, dirs, False)


def case_row_bound_rejects_rounded_partials(world, rank, dirs):
    """Partials rounded to fp16 on each rank before the sum (reduce_dtype=None with fp16 x) break the
    statement the fp32 reduction meets: the test's criterion can tell."""
    whole = _whole(dirs["modelopt"])
    whole.bias = None
    layer = RowParallelFP4Linear.from_safetensors(dirs["modelopt"], PREFIX, reduce_dtype=None)
    layer.bias = None
    k = whole.in_features // world
    x = _x(16, whole.in_features, torch.float16, seed=77)
    exact, bound = row_bound(whole, x, world)
    ok = adjacent_or_equal(layer(x[:, rank * k:(rank + 1) * k]), whole(x), exact, bound)
    assert not bool(ok.all()), "fp16 partials met the fp32 statement: the criterion would not catch them"


def case_bias_once(world, rank, dirs):
    """With all-zero weight codes the output is the bias exactly: added once, not P times or never."""
    whole = _whole(dirs["modelopt"])
    whole.weight.zero_()
    assert whole.bias is not None and bool((whole.bias != 0).all())
    x = _x(3, whole.in_features, torch.float32, seed=3)
    expected = whole.bias.expand(3, -1)
    column = ColumnParallelFP4Linear.from_fp4linear(whole)
    row = RowParallelFP4Linear.from_fp4linear(whole, input_is_parallel=False)
    assert torch.equal(column(x), expected), "column-parallel: output != bias"
    assert torch.equal(row(x), expected), "row-parallel: output != bias"


def case_swizzled_shards(world, rank, dirs):
    """Shards of whole layers with swizzled scales (rows re-swizzled or not, K on tile boundaries)."""
    for convention in ("modelopt", "gpt-oss"):
        whole = FP4Linear.from_state_dict(SafetensorsDirectory(dirs[convention]), PREFIX, scale_layout="swizzled")
        x = _x(2, whole.in_features, torch.float32, seed=21)
        column = ColumnParallelFP4Linear.from_fp4linear(whole)
        assert torch.equal(column(x), whole(x)), f"{convention}: column, swizzled"
        whole.bias = None
        row = RowParallelFP4Linear.from_fp4linear(whole, input_is_parallel=False)
        exact, bound = row_bound(whole, x, world)
        _check_row_fp32(row(x), whole(x), exact, bound, f"{convention}: row, swizzled")
        loaded = RowParallelFP4Linear.from_safetensors(dirs[convention], PREFIX, scale_layout="swizzled",
                                                       input_is_parallel=False)
        loaded.bias = None
        assert loaded.shard.scale_layout == "swizzled"
        assert torch.equal(loaded(x), row(x)), f"{convention}: row loaded swizzled != row sharded"


def case_row_w4a4_per_call_scale(world, rank, dirs):
    """W4A4 with the scale picked per call from the whole activation's amax: ranks holding slices agree on it."""
    whole = _whole(dirs["modelopt"])
    whole.bias = None
    w4a4 = FP4Linear.from_state_dict(SafetensorsDirectory(dirs["modelopt"]), PREFIX, activations="w4a4")
    w4a4.bias = None
    layer = RowParallelFP4Linear.from_fp4linear(w4a4)
    k = whole.in_features // world
    x = _x(2, whole.in_features, torch.float32, seed=5)
    # The largest magnitude, in the last rank's slice, 5e4 times the others: with the whole activation's scale
    # the other blocks get subnormal e4m3 scales, so a scale from a rank's own slice gives other codes.
    x[0, (world - 1) * k + 3] = 1e5
    activation = w4a4.quantize_input(x)
    exact, bound = row_bound(w4a4, x, world, activation)
    _check_row_fp32(layer(x[:, rank * k:(rank + 1) * k]), w4a4(x), exact, bound, "w4a4 per-call scale")


def case_prefill(world, rank, dirs):
    """More than 16 tokens: dequantized weights through F.linear; close to the single layer."""
    whole = _whole(dirs["compressed-tensors"])
    x = _x(20, whole.in_features, torch.float32, seed=8)
    column = ColumnParallelFP4Linear.from_safetensors(dirs["compressed-tensors"], PREFIX)
    row = RowParallelFP4Linear.from_safetensors(dirs["compressed-tensors"], PREFIX, input_is_parallel=False)
    y = whole(x)
    scale = float(y.abs().max())
    assert float((column(x) - y).abs().max()) <= 1e-5 * scale, "column prefill"
    assert float((row(x) - y).abs().max()) <= 1e-5 * scale, "row prefill"


def case_symm_mem_needs_cuda(world, rank, dirs):
    layer = RowParallelFP4Linear.from_safetensors(dirs["modelopt"], PREFIX, collective="symm_mem")
    x = _x(1, layer.shard.in_features, torch.float32, seed=1)
    try:
        layer(x)
    except ValueError as exc:
        assert "symm_mem" in str(exc) and "cpu" in str(exc), str(exc)
    else:
        raise AssertionError("collective='symm_mem' ran on CPU tensors")


def case_bench_measure_on_cpu(world, rank, dirs):
    """benchmarks/tp_layers.py's per-rank measurement with a timer that runs every launch instead of the GPU's:
    the layers it builds, the shards, the output check, the ranks' summary and table."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "tp_layers.py")
    spec = importlib.util.spec_from_file_location("tp_layers", path)
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    timed = []

    def run_every_launch(launch, inputs, replays=15, before_replay=None):
        for item in inputs:
            launch(item)
        before_replay()
        timed.append(len(inputs))
        return [float(len(timed))]

    rows = []
    for split, m, k in (("column", 256, 512), ("row", 128, 1024)):
        for fmt, act in (("nvfp4", "bf16"), ("mxfp4", "fp16")):
            mine = tp.measure_case(split, m, k, 3, fmt, act, rank, world, dist.barrier, torch.device("cpu"),
                                   collectives=("default",), time_us=run_every_launch, count_inputs=lambda nbytes: 2)
            if split == "column":
                assert mine["rel_error"] == 0.0, f"column {fmt} {act}: {mine['rel_error']}"
            else:  # one rounding of a bf16 / fp16 output at most
                assert mine["rel_error"] <= 2.0 ** -7, f"row {fmt} {act}: {mine['rel_error']}"
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            rows.append({"split": split, "m": m, "k": k, "n": 3, **tp.summarize_case(per_rank)})
    assert timed == [2, 2, 2] * 4, timed  # whole layers, shards without and with the collective
    assert all(r["best_collective"] == "default" and r["symm_mem_us"] is None for r in rows)
    table = tp.format_tp_table(rows, world).splitlines()
    assert len(table) == 2 + len(rows) and "column" in table[2] and "n/a" in table[2], table


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}


def worker(rank: int, world: int, port: int, dirs: dict, out: str) -> None:
    torch.set_num_threads(1)  # two processes on a small CI machine: no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    try:
        for name, fn in CASES.items():
            try:
                torch.manual_seed(0)
                fn(world, rank, dirs)
                results[name] = None
            except Exception:  # reported per case to the test, which fails with it
                results[name] = traceback.format_exc(limit=4)
            dist.barrier()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
