"""benchmarks/quantize_speed.py runs end to end on the CPU (interpreter, tiny shapes, timing stubbed), so the
script the GPU runs is not first exercised there."""

import json

import torch

from fp4gemv import bench
from scripts import load_benchmark


def test_quantize_speed_script_runs(monkeypatch, tmp_path):
    script = load_benchmark("quantize_speed")
    monkeypatch.setattr(script, "DEVICE", "cpu")
    monkeypatch.setattr(script, "BIG", (8, 64))
    monkeypatch.setattr(script, "FUZZ_SHAPES", (("swizzled", (3, 64)), ("linear", (2, 2, 64))))
    monkeypatch.setattr(script, "DISTINCT_BYTES", 1)
    sweep = script.sweep_configs(16, quick=False, divisions=True)
    assert sweep[0] == script.quantize_config(16) and len(set(sweep)) == len(sweep) > 10
    assert sweep[0]._replace(float64_reciprocal=False) in sweep
    monkeypatch.setattr(script, "sweep_configs", lambda block_size, *args, **kw: [script.quantize_config(block_size)])
    calls = []

    def device_time_us(launch, inputs, replays=15):
        for x in inputs:
            launch(x)
        calls.append(len(inputs))
        return [1.0]

    monkeypatch.setattr(bench, "device_time_us", device_time_us)
    monkeypatch.setattr(bench, "host_time_us", lambda call, calls=200: (call(), 2.0)[1])
    monkeypatch.setenv("OUT", str(tmp_path))
    results = script.main([])
    assert json.loads((tmp_path / "quantize_speed.json").read_text()) == results
    assert set(results["checks"]["cpu_reference_seconds"]) == {"nvfp4", "mxfp4"}
    assert len(results["quantize"]) == 7 and len(results["dequantize"]) == 5
    row = results["quantize"][0]
    # 8 x 64 bf16 read, 256 packed bytes and 128 x 4 swizzled scale bytes written, in 1 us (stubbed)
    assert row["bytes"] == 8 * 64 * 2 + 8 * 32 + 128 * 4 and row["gbps"] == row["bytes"] / 1e3
    assert all(n == 3 for n in calls)  # three distinct inputs at the least
    assert torch.isfinite(torch.tensor([r["fraction_of_copy"] for r in results["dequantize"]])).all()
