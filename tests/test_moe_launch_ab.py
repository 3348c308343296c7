"""benchmarks/moe_launch_ab.py runs end to end on the CPU (moe_weight_only in Triton's interpreter, the timing and
the layer table stubbed), so that its GPU call is not its first run: the grouping A/B times both groupings of every
part moe_weight_only runs and finds their outputs equal bit for bit, the PDL A/B times the layer with moe_route's
and moe_combine's PDL off and on, and both put the defaults back."""

import json
from types import SimpleNamespace

from fp4gemv.bench import moe as bench_moe
from fp4gemv.bench.moe import MOE_MODELS, MoeModel
from fp4gemv.kernels import moe_weight_only
from fp4gemv.kernels.moe_combine import MoeCombine
from fp4gemv.kernels.moe_route import MoeRoute
from scripts import load_benchmark

TINY = MoeModel("tiny-gpt-oss", layers=2, experts=4, hidden=64, intermediate=32)


def stubbed(monkeypatch, tmp_path):
    """The script on TINY, 2 copies, on the CPU's interpreter, writing into tmp_path; (script, the timed
    launches' copy counts, the layer-table calls with the settings they saw)."""
    script = load_benchmark("moe_launch_ab")
    monkeypatch.setitem(MOE_MODELS, TINY.name, TINY)
    for name, value in (("MODELS", (TINY.name,)), ("COPIES", 2), ("GROUPING_TOKENS", (1,)), ("DEVICE", "cpu"),
                        ("BACKEND", "triton"), ("OUT", str(tmp_path))):
        monkeypatch.setattr(script, name, value)
    timed, layers = [], []

    def device_time_us(launch, inputs, replays=15):
        timed.append(len([launch(c) for c in inputs]))
        return [float(len(timed))]

    def moe_benchmark(name, tokens_list):
        case = SimpleNamespace(tokens=1, experts=TINY.experts, hidden=TINY.hidden)
        layers.append((name, tuple(tokens_list), moe_weight_only.PAIRWISE_PAIRS,
                       MoeRoute().default_config(case, None).pdl, MoeCombine().default_config(case, None).pdl))
        return [dict(model=name, tokens=t, layer_us=1.0) for t in tokens_list]

    monkeypatch.setattr(script, "device_time_us", device_time_us)
    monkeypatch.setattr(bench_moe, "moe_benchmark", moe_benchmark)
    return script, timed, layers


def test_grouping_ab_times_both_groupings_bit_for_bit(monkeypatch, tmp_path):
    script, timed, layers = stubbed(monkeypatch, tmp_path)
    default = moe_weight_only.PAIRWISE_PAIRS
    script.grouping()
    rows = json.loads((tmp_path / "grouping_ab.json").read_text())["rows"]
    parts = [r for r in rows if "part" in r]
    assert [(r["tokens"], r["part"]) for r in parts] == [(1, "gate_up"), (1, "down")]
    for r in parts:
        assert r["kernel"] == "moe_weight_only" and r["bit_equal"] is True, r
        assert len(r["histogram_us"]) == len(r["pairwise_us"]) == 2
    assert timed == [2] * 8
    assert [(pairwise, tokens) for _, tokens, pairwise, _, _ in layers] == [(0, (1, 2)), (256, (1, 2))]
    assert moe_weight_only.PAIRWISE_PAIRS == default


def test_pdl_ab_switches_route_and_combine_and_restores_them(monkeypatch, tmp_path):
    script, _, layers = stubbed(monkeypatch, tmp_path)
    script.pdl()
    assert [(route, combine) for *_, route, combine in layers] == [(False, False), (True, True)] * 2
    rows = json.loads((tmp_path / "pdl_ab.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["off"] * 3 + ["on"] * 3 + ["off"] * 3 + ["on"] * 3
    case = SimpleNamespace(tokens=1, experts=4, hidden=64)
    assert MoeRoute().default_config(case, None).pdl and MoeCombine().default_config(case, None).pdl
