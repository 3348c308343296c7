"""benchmarks/moe_sweep.py: every configuration it times is one the routed spec accepts on gpt-oss-20b's
products (on sm_90) and computes the exact result in the interpreter on a tiny shape with the same token
structure; the script runs end to end on the CPU (timing stubbed), so its one GPU call is not its first run."""

import json

import pytest
import torch

import fp4gemv
from fp4gemv import FP4Tensor, moe
from fp4gemv.bench.moe import MoeModel
from fp4gemv.target import SM90
from operands import random_activation, random_fp4
from scripts import load_benchmark
from test_moe import assert_routed_exact, random_ids


def load_script():
    return load_benchmark("moe_sweep")


def real_plan(script, product, tokens, config=None):
    """moe_gemv's plan for the script's ``product`` at ``tokens`` on sm_90 (full shape; bytes never read)."""
    m, k, per_row = script.PRODUCTS[product]
    experts, top_k = script.MODEL.experts, script.MODEL.top_k
    rows, slots = (tokens, top_k) if per_row == top_k else (tokens * top_k, 1)
    w = FP4Tensor(torch.empty(experts, m, k // 2, dtype=torch.uint8),
                  torch.empty(experts, m, k // 32, dtype=torch.uint8), "mxfp4", "linear")
    x = torch.empty(rows, k, dtype=torch.bfloat16)
    ids = torch.zeros(rows, slots, dtype=torch.int64)
    bias = torch.empty(experts, m, dtype=torch.bfloat16)
    out = torch.empty(rows, slots, m, dtype=torch.float32)
    return moe.plan_moe(w, x, ids, bias, None, out, torch.float32, SM90, script.KERNEL, config)


def test_sweep_configs_are_accepted_and_exact():
    """Each (product, T) of the sweep: its first candidate is moe_gemv's default there, every candidate passes
    the spec's why_not and check_config on the full shape, and each distinct candidate computes the exact result
    on a tiny shape of the same class (T = 1 gate_up: one activation row; T = 1 down: four of one pair each;
    T = 8, 16: groups of up to 16 pairs on 4 experts, which loop in k32 and in split), K = 288 (a partial step
    for every configuration), M = 48 (a row tail for 2 and 4 tiles)."""
    script = load_script()
    classes = {}
    for product in script.PRODUCTS:
        for tokens in script.TOKENS:
            default = real_plan(script, product, tokens).config
            configs = script.candidates(product, tokens, default)
            assert configs[0] == default and len(set(configs)) == len(configs) >= 8, (product, tokens, configs)
            for config in configs:
                plan = real_plan(script, product, tokens, config)
                assert plan.spec.name == script.KERNEL and plan.config == config
                assert plan.spec.why_not(plan.case, SM90) is None
            shape = (1, 4) if tokens == 1 and product == "gate_up" else (4, 1) if tokens == 1 else (16, 4)
            classes.setdefault(shape, {}).update(dict.fromkeys(configs))
    w = random_fp4((4, 48, 288), "mxfp4", "linear", seed=70)
    bias = random_activation((4, 48), torch.bfloat16, seed=71)
    for (tokens, top_k), configs in classes.items():
        x = random_activation((tokens, 288), torch.bfloat16, seed=72 + tokens)
        ids = random_ids(tokens, top_k, 4, seed=73 + tokens)
        for config in configs:
            got = fp4gemv.moe_gemv(w, x, ids, bias=bias, out_dtype=torch.float32, backend="triton",
                                   kernel=script.KERNEL, config=config)
            assert_routed_exact(got, w, x, ids, torch.float32, bias=bias, kernel=script.KERNEL, config=config)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_sweep_script_runs(monkeypatch, tmp_path, fmt):
    """main() on the CPU: tiny products (MXFP4 with biases as gpt-oss, NVFP4 with per-expert global scales and no
    bias as Qwen3), the interpreter, two candidates per case, timing and the read stubbed; every row timed, the
    JSON as returned, the swizzled rows after the linear ones."""
    script = load_script()
    monkeypatch.setattr(script, "DEVICE", "cpu")
    monkeypatch.setattr(script, "BACKEND", "triton")
    monkeypatch.setattr(script, "COPIES", 2)
    nvfp4 = dict(fmt="nvfp4", activation="silu", routing="softmax-topk-norm", bias=False) if fmt == "nvfp4" else {}
    monkeypatch.setattr(script, "MODEL", MoeModel("tiny", layers=1, experts=4, hidden=32, intermediate=16, **nvfp4))
    monkeypatch.setattr(script, "PRODUCTS", {"gate_up": (16, 32, 4), "down": (16, 32, 1)})
    original = script.candidates
    monkeypatch.setattr(script, "candidates", lambda p, t, d: original(p, t, d)[:2])
    launches = []

    def device_time_us(launch, inputs, replays=15):  # each configuration timed faster than the one before
        for x in inputs:
            launches.append(launch(x))
        us = 100.0 - len(launches)
        return [us, us - 1, us + 1]

    monkeypatch.setattr(script, "device_time_us", device_time_us)
    monkeypatch.setattr(script, "best_read", lambda nbytes: ("triton", 1.0))
    monkeypatch.setenv("OUT", str(tmp_path))
    result = script.main(["--tokens", "1,8", "--workers", "0", "--budget-s", "3600"])
    assert json.loads((tmp_path / "moe_sweep.json").read_text()) == json.loads(json.dumps(result))
    assert len(result["cases"]) == 4 and not result["skipped"] and launches
    assert len(launches) == 4 * 4 * 2  # 4 rows of 2 copies per case
    for case in result["cases"]:
        rows = case["rows"]
        assert all("error" not in r and r["fraction_of_read"] == 1.0 / r["us"] for r in rows), rows
        assert [r["layout"] for r in rows] == ["linear", "linear", "swizzled", "swizzled"], rows
        # the swizzled rows: the default, then the fastest linear configuration (the second)
        assert rows[0]["config"] == case["default"] == rows[2]["config"] and rows[1]["config"] == rows[3]["config"]


def test_use_model_sets_the_products(monkeypatch):
    """``--model`` picks the model's two products as FP4Experts calls them: Qwen3-30B-A3B's gate_up [2I, H] on
    rows of x with k = 8 ids each, down [H, I] on one row per pair."""
    script = load_script()
    monkeypatch.setattr(script, "MODEL", script.MODEL)  # restored after the test
    monkeypatch.setattr(script, "PRODUCTS", script.PRODUCTS)
    script.use_model("qwen3-30b-a3b")
    assert script.MODEL.fmt == "nvfp4" and script.MODEL.top_k == 8
    assert script.PRODUCTS == {"gate_up": (1536, 2048, 8), "down": (2048, 768, 1)}
