"""The benchmark's CPU-side pieces: byte counts, the random operands it times, and a row's wiring (the timers
themselves need a GPU)."""

import pytest
import torch

from fp4gemv import bench, formats, layouts, task
from fp4gemv.nn.linear import LINEAR_CODE_ORDER
from scripts import load_benchmark


def test_task_case_bytes_count_weights_scales_activation_and_output():
    for m, k, L in ((7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)):
        weights_and_scales = L * (m * k // 2 + m * k // 16)
        activation = L * (k // 2 + k // 16)
        assert bench.case_bytes(bench.Shape(m, k, L)) == weights_and_scales + activation + L * m * 2


def test_case_bytes_counts_each_part():
    m, k, L, n = 256, 1024, 2, 4
    weights = L * (m * k // 2 + m * k // 32)  # MXFP4: one scale byte per 32 elements
    assert bench.case_bytes(bench.Shape(m, k, L, n), "mxfp4", "bf16") == weights + L * n * k * 2 + L * m * n * 2


@pytest.mark.parametrize("fmt, act", [("nvfp4", "fp4"), ("mxfp4", "fp4"), ("nvfp4", "bf16"), ("mxfp4", "fp16")])
def test_random_gemv_operands_are_valid_and_span_all_codes(fmt, act):
    shape = bench.Shape(256, 512, 2, 3)
    a, b, out = bench.random_gemv_operands(shape, fmt, act, seed=0, device="cpu")
    assert a.shape == (2, 256, 512) and a.fmt.name == fmt and a.scale_layout == "swizzled"
    assert a.code_order == LINEAR_CODE_ORDER["w4a4" if act == "fp4" else "weight-only"]  # what FP4Linear keeps
    assert out.shape == (2, 256, 3) and out.dtype == torch.float16
    codes = formats.unpack_e2m1(a.data)
    assert set(codes.unique().tolist()) == set(range(16))
    # Scales are powers of two 2^-4 .. 2^3 in the used (unpadded) region.
    scales = formats.decode_scales(layouts.unswizzle_scales(a.scales, 256, 512 // a.fmt.block_size), a.fmt)
    assert torch.all(torch.log2(scales) == torch.log2(scales).round())
    assert scales.min() >= 2.0 ** -4 and scales.max() <= 2.0 ** 3
    if act == "fp4":
        assert b.shape == (2, 3, 512) and b.fmt.name == fmt
    else:
        assert b.shape == (2, 3, 512) and b.dtype == bench.ACTIVATIONS[act]


def test_random_task_input_is_a_task_input():
    data = bench.random_task_input(256, 512, 2, seed=0, device="cpu")
    reference = task.generate_input(256, 512, 2, seed=0, device="cpu")
    for got, want in zip(data, reference):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    ok, message = task.check_implementation(data, task.custom_kernel(data))
    assert ok, message


def test_bench_rows_on_cpu_with_timing_stubbed():
    """bench_case's wiring: every timed callable runs (the task case through task.custom_kernel, others through
    gemv) and the rows carry every column of the table.  The timers need a GPU, so stubs that call what they
    are given once are passed in, with the operands on the CPU."""
    def run_once(launch, inputs, *_):
        launch(inputs[0])
        return [1.0]

    calls = []
    measure = bench.Measurements(device_time_us=run_once, host_time_us=lambda call: (calls.append(call()), 2.0)[1],
                                 best_read=lambda nbytes: ("stub read", 0.5), input_count=lambda nbytes: 2,
                                 device="cpu")
    task_row = bench.bench_case(bench.Shape(128, 256, 2), measure=measure)
    case_row = bench.bench_case(bench.Shape(128, 256, 2, 3), "mxfp4", "fp16", measure=measure)
    assert task_row["path"] == "task.custom_kernel" and case_row["path"] == "fp4gemv.gemv"
    for row in (task_row, case_row):
        assert row["inputs"] == 2 and row["time"]["median_us"] == 1.0 and row["host_us"] == 2.0
        assert (row["best_read"], row["best_read_us"]) == ("stub read", 0.5)
        assert row["kernel"] == "reference"  # what select_kernel picks for CPU operands
    assert len(calls) == 2
    assert task_row["bytes"] == bench.case_bytes(bench.Shape(128, 256, 2))
    table = bench.format_table([task_row, case_row]).splitlines()
    assert len(table) == 3 and table[1].split()[:3] == ["nvfp4", "fp4", "1"]
    assert table[2].split()[:3] == ["mxfp4", "fp16", "3"] and table[2].split()[-1] == "reference"
    assert table[1].split()[7] == "0.50"  # the fraction of the best read


def test_decode_benchmark_models_and_bytes():
    """The model shapes of ``fp4gemv bench --model`` and the weight bytes per token they report."""
    from fp4gemv.bench import model

    llama8 = model.MODELS["llama3-8b"]
    assert [s[1:] for s in llama8.linear_shapes()] == [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
                                                       (14336, 4096), (14336, 4096), (4096, 14336)]
    params = 32 * sum(o * i for _, o, i in llama8.linear_shapes())
    assert params == 6_979_321_856  # Llama-3-8B's decoder linear weights
    assert model._weight_bytes(llama8, fp4=False) == 2 * params
    assert model._weight_bytes(llama8, fp4=True) == params // 2 + params // 16
    assert model.MODELS["llama3-70b"].layers == 80 and model.MODELS["llama3-70b"].timed_layers == 20


def test_decode_benchmark_layers_run_a_token_on_cpu():
    """The FP4Linear and bf16 layers it times, on a tiny model on the CPU (one token, both kinds)."""
    from fp4gemv.bench import model

    tiny = model.ModelShape("tiny", layers=4, hidden=64, kv=32, intermediate=128, timed_layers=2)
    for build in (model._fp4_layers, model._bf16_layers):
        layers = build(tiny, "cpu")
        assert len(layers) == 2 * 7
        inputs = model._inputs(tiny, 1, "cpu")
        model._token(layers, inputs)
        outs = [layer(inputs[layer.in_features]) for layer in layers[:7]]
        assert [o.shape[-1] for o in outs] == [64, 32, 32, 64, 128, 128, 64]
        assert all(torch.isfinite(o).all() for o in outs)
    rows = [dict(model="tiny", n=1, kind=k, layers=4, timed_layers=2, graph_us=g, eager_us=e,
                 graph_tokens_per_s=1e6 / g, eager_tokens_per_s=1e6 / e, weight_bytes_per_token=b)
            for k, g, e, b in (("fp4", 100.0, 400.0, 10), ("bf16", 300.0, 500.0, 40))]
    table = model.format_decode_table(rows).splitlines()
    assert table[1].split()[-2:] == ["3.00", "1.25"] and "scaled to all" in table[-1]


# --- benchmarks/tp_layers.py (the measurement itself runs in tests/parallel_worker.py, case_bench_measure_on_cpu) --


def _tp_layers():
    return load_benchmark("tp_layers")


def test_tp_bench_says_how_to_launch_it(monkeypatch, capsys):
    tp = _tp_layers()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert tp.main(["--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2 benchmarks/tp_layers.py --tp 2" in err and "WORLD_SIZE" in err, err
    with pytest.raises(SystemExit):
        tp.main(["--tp", "2", "--act", "fp4"])
    assert "--act: invalid choice: 'fp4'" in capsys.readouterr().err


def test_tp_bench_launch_checks():
    check_launch = _tp_layers().check_launch
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=r"--tp 4: expected WORLD_SIZE = 4 processes .*got 2"):
        check_launch(4, env)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        with pytest.raises(ValueError, match=rf"--tp 2: expected 2 CUDA GPUs, found {gpus}"):
            check_launch(2, env)
    else:
        assert check_launch(2, env) == (1, 1)


def test_prefill_table_has_every_time_and_ratio():
    from fp4gemv.bench.prefill import format_prefill_table

    row = {"shape": [4096, 4096], "tokens": 128, "nvfp4_us": 8.0, "mxfp4_us": 9.0, "bf16_us": 16.0, "fp8_us": 10.0,
           "nvfp4_rel_err": 1e-3}
    lines = format_prefill_table([row]).splitlines()
    assert lines[0].split()[:4] == ["shape", "T", "nvfp4", "us"]
    fields = lines[1].split()
    assert fields[:6] == ["4096x4096", "128", "8.0", "9.0", "16.0", "10.0"]
    assert fields[6:9] == ["0.50", "0.56", "0.62"] and "nvfp4 1.0e-03" in lines[1]


def test_prefill_bench_refuses_moe_models_naming_model(capsys):
    from fp4gemv.cli import main

    assert main(["bench", "--prefill", "--model", "gpt-oss-20b"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "llama3-8b or llama3-70b" in err and "'gpt-oss-20b'" in err


def test_prefill_bench_needs_positive_token_counts(capsys):
    from fp4gemv.cli import main

    assert main(["bench", "--prefill", "--n", "32,0"]) == 2
    assert "positive integers with --prefill" in capsys.readouterr().err
