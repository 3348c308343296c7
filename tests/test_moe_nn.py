"""fp4gemv.nn.FP4Experts against transformers 5's expert modules holding the exactly dequantized weights, the MoE
checkpoint readers, and a tiny GptOssForCausalLM generating with FP4 experts.

Bound for the modules: the reference runs transformers' own expert code in float64 on the dequantized weights
(exact up to 2^-53 per operation); FP4Experts computes gate_up within moe_gemv's fp32 bound (tests/test_moe.py),
the activation in fp32, rounds it once to the fp32 hidden dtype, and sums in fp32: every step is a few fp32
roundings on values of the magnitude of |W| |x|, so relative to the output's magnitude scale
(``max |reference|``) the difference stays below ``(K/16 + 30) * 2^-24`` per GEMV, times a small factor for the
two GEMVs and the activation's slope (<= 1.1 for the clamped SwiGLU on |gate| <= 7, times |up + 1| <= 8):
``2e-4`` relative covers K = 64 with margin and fails for a wrong expert, row or bias (O(1) relative)."""

import copy

import pytest
import torch

import fp4gemv
from fp4gemv import FP4Tensor
from fp4gemv.nn import ExpertWeights, FP4Experts, gpt_oss_experts, nvfp4_experts, quantize_experts
from fp4gemv.nn.moe import EXPERT_CODE_ORDER, _gpt_oss_projection
from fp4gemv.nn.checkpoints import layer_tensors
from fp4gemv.nn.linear import FP4Linear
from operands import random_fp4

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

RELATIVE = 2e-4


def tiny_gpt_oss_config(**kw):
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
               max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"])
    cfg.update(kw)
    return transformers.GptOssConfig(**cfg)


def random_gpt_oss_experts(config, seed):
    torch.manual_seed(seed)
    module = modeling_gpt_oss.GptOssExperts(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module


def dequantized_into(float_module: torch.nn.Module, fp4: FP4Experts) -> torch.nn.Module:
    """A copy of transformers' expert module holding fp4's exactly dequantized weights (float64)."""
    ref = copy.deepcopy(float_module).to(torch.float64)

    def values(name):
        p = fp4.projection(name)
        v = fp4gemv.dequantize(p.weight, torch.float64)
        return v if p.global_scales is None else v * p.global_scales.to(torch.float64)[:, None, None]

    with torch.no_grad():
        if hasattr(ref, "gate_up_proj_bias"):
            ref.gate_up_proj.copy_(values("gate_up").transpose(1, 2))
            ref.down_proj.copy_(values("down").transpose(1, 2))
        else:
            ref.gate_up_proj.copy_(values("gate_up"))
            ref.down_proj.copy_(values("down"))
    return ref


def assert_close_relative(got, ref, relative=RELATIVE):
    scale = ref.abs().max().item()
    err = (got.to(torch.float64) - ref.to(torch.float64)).abs().max().item()
    assert err <= relative * scale, f"max |got - ref| = {err:g} above {relative} * {scale:g}"


def routing(tokens, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpt_oss_experts_match_dequantized(fmt):
    config = tiny_gpt_oss_config()
    module = random_gpt_oss_experts(config, seed=1)
    fp4 = quantize_experts(module, fmt, backend="triton")
    ref = dequantized_into(module, fp4)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    ids, weights = routing(5, 8, 2, seed=3)
    ids[1] = ids[0]  # two tokens on the same experts
    got = fp4(x, ids, weights)
    want = ref(x.to(torch.float64), ids, weights.to(torch.float64))
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_close_relative(got, want)
    # The bound rejects a wrong activation: gpt-oss's clamp and (up + 1) against plain SiLU.
    plain = FP4Experts(fp4.projection("gate_up"), fp4.projection("down"), activation="gpt-oss", limit=1e9,
                       alpha=1.0, backend="triton")
    with pytest.raises(AssertionError):
        assert_close_relative(plain(x * 8, ids, weights), ref(x.to(torch.float64) * 8, ids,
                                                              weights.to(torch.float64)))


def test_qwen3_experts_match_dequantized():
    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=4, hidden_act="silu")
    torch.manual_seed(4)
    module = modeling_qwen3_moe.Qwen3MoeExperts(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    fp4 = quantize_experts(module, "nvfp4", backend="triton")
    assert fp4.activation == "silu"
    ref = dequantized_into(module, fp4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids, weights = routing(3, 8, 4, seed=6)
    got = fp4(x, ids, weights)
    assert got.dtype == torch.bfloat16
    want = ref(x.to(torch.float64), ids, weights.to(torch.float64))
    assert_close_relative(got, want, relative=2**-7)  # the bf16 result's own rounding dominates


def gpt_oss_checkpoint(fp4: FP4Experts, prefix: str) -> dict:
    """The layer in gpt-oss's checkpoint layout (blocks [E, rows, K/32, 16], scales [E, rows, K/32])."""
    out = {}
    for name, key in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        p = fp4.projection(name)
        e, rows, k = p.weight.shape
        data = p.weight.with_code_order("checkpoint").data
        out[f"{prefix}.{key}_blocks"] = data.reshape(e, rows, k // 32, 16).clone()
        out[f"{prefix}.{key}_scales"] = p.weight.linear_scales().clone()
        out[f"{prefix}.{key}_bias"] = p.bias.clone()
    return out


def test_linear_scale_rows_are_kept_16_bytes_apart():
    """FP4Experts stores linear scales with rows 16 bytes apart (the routed engine copies them in bulk): rows of 1
    or 2 MXFP4 bytes (K = 32, 64) are padded with zeros in memory and viewed back, rows of 16 bytes (K = 512) are
    kept without a copy, swizzled scales as they are; the values are unchanged."""
    for hidden, layout in ((64, "linear"), (512, "linear"), (512, "swizzled")):
        gu = random_fp4((4, 64, hidden), "mxfp4", "linear", seed=hidden, device="cpu")
        down = random_fp4((4, hidden, 32), "mxfp4", layout, seed=hidden + 1, device="cpu")
        layer = FP4Experts(ExpertWeights(gu), ExpertWeights(down), activation="silu")
        for name, w in (("gate_up", gu), ("down", down)):
            stored, got = getattr(layer, f"{name}_scales"), layer.projection(name).weight.scales
            assert torch.equal(got, w.scales), (hidden, name)
            if w.scale_layout == "swizzled" or w.scales.shape[-1] % 16 == 0:
                assert stored is w.scales, (hidden, name)
            else:
                assert stored.shape == (*w.scales.shape[:-1], 16) and got.stride(-2) == 16, (hidden, name)
                assert not stored[..., w.scales.shape[-1]:].any(), (hidden, name)


def test_gpt_oss_checkpoint_loads_with_one_copy_of_the_data():
    """The blocks are viewed as they are, then kept in the experts' code order (``EXPERT_CODE_ORDER``, native: one
    copy; the checkpoint order keeps the view); the scales are viewed where their rows are 16 bytes apart, else (K =
    64: 2 bytes a row, as gpt-oss's 90) copied once into rows 16 bytes apart (``layouts.aligned_scale_rows``)."""
    module = random_gpt_oss_experts(tiny_gpt_oss_config(), seed=7)
    fp4 = quantize_experts(module, "mxfp4", backend="triton")
    prefix = "model.layers.0.mlp.experts"
    tensors = gpt_oss_checkpoint(fp4, prefix)
    loaded = gpt_oss_experts(tensors, prefix, backend="triton")
    assert EXPERT_CODE_ORDER == "native" and loaded.code_order == "native"
    views = FP4Experts(_gpt_oss_projection(tensors, prefix, "gate_up_proj", None),
                       _gpt_oss_projection(tensors, prefix, "down_proj", None), code_order="checkpoint",
                       backend="triton")
    for name, key in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        blocks = tensors[f"{prefix}.{key}_blocks"]
        w = loaded.projection(name).weight
        assert w.code_order == "native" and w.data.data_ptr() != blocks.data_ptr()
        assert torch.equal(w.with_code_order("checkpoint").data, blocks.reshape(w.data.shape))
        assert views.projection(name).weight.data.data_ptr() == blocks.data_ptr()
        assert torch.equal(w.scales, tensors[f"{prefix}.{key}_scales"]) and w.scales.stride(-2) == 16
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    ids, weights = routing(2, 8, 2, seed=9)
    assert torch.equal(loaded(x, ids, weights), fp4(x, ids, weights))
    assert torch.equal(views(x, ids, weights), fp4(x, ids, weights))
    with pytest.raises(ValueError, match=r"code_order: expected one of \('checkpoint', 'native'\) \(the routed "
                                         r"kernels' orders\), got 'paired'"):
        FP4Experts(_gpt_oss_projection(tensors, prefix, "gate_up_proj", None),
                   _gpt_oss_projection(tensors, prefix, "down_proj", None), code_order="paired")
    # The state dict holds the checkpoint order whatever the module keeps, and load_state_dict takes it.
    state = loaded.state_dict()
    for key in ("gate_up", "down"):
        data = state[f"{key}_data"]
        assert torch.equal(data, views.state_dict()[f"{key}_data"])
        assert torch.equal(data, tensors[f"{prefix}.{key}_proj_blocks"].reshape(data.shape))
    views.load_state_dict(state)
    native = gpt_oss_experts(tensors, prefix, backend="triton")
    native.load_state_dict(views.state_dict())
    assert torch.equal(native.gate_up_data, loaded.gate_up_data)
    assert torch.equal(native(x, ids, weights), fp4(x, ids, weights))
    bad = dict(tensors)
    bad[f"{prefix}.down_proj_scales"] = bad[f"{prefix}.down_proj_scales"][:, :, :1]
    with pytest.raises(ValueError, match=rf"{prefix}.down_proj_scales: expected uint8 e8m0"):
        gpt_oss_experts(bad, prefix)


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
def test_nvfp4_per_expert_checkpoint(convention):
    """Per-expert gate/up/down NVFP4 layers with different per-tensor scales: read, stacked, run as SiLU experts,
    against float64 SiLU experts on each layer's exactly dequantized weight."""
    experts, hidden, inter = 4, 64, 32
    g = torch.Generator().manual_seed(10)
    prefix = "model.layers.3.mlp.experts"
    tensors, values = {}, {}
    for e in range(experts):
        for name, (rows, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
            linear = torch.nn.Linear(k, rows, bias=False)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(rows, k, generator=g) * 4.0 ** (e - 1))
            layer = FP4Linear.from_linear(linear, "nvfp4", scale_layout="linear")
            tensors.update(layer_tensors(layer, convention, f"{prefix}.{e}.{name}"))
            values[e, name] = fp4gemv.dequantize(layer.quantized_weight(), torch.float64)
    fp4 = nvfp4_experts(tensors, prefix, experts, backend="triton")
    assert fp4.projection("gate_up").global_scales is not None
    x = torch.randn(3, hidden, generator=g)
    ids, weights = routing(3, experts, 2, seed=11)
    got = fp4(x, ids, weights)
    want = torch.zeros(3, hidden, dtype=torch.float64)
    for t in range(3):
        for j in range(2):
            e = int(ids[t, j])
            x64 = x[t].to(torch.float64)
            h = torch.nn.functional.silu(values[e, "gate_proj"] @ x64) * (values[e, "up_proj"] @ x64)
            h = h.to(torch.float32).to(torch.float64)  # rounded once to the hidden dtype, as FP4Experts does
            want[t] += weights[t, j].double() * (values[e, "down_proj"] @ h)
    assert_close_relative(got, want)


def test_tiny_gpt_oss_generates_with_fp4_experts():
    """A GptOssForCausalLM (random weights, small config, float32) with FP4Experts in every layer generates the
    same tokens as the same model whose experts hold the exactly dequantized weights, and its logits agree
    within 2e-4 of their largest magnitude (the module bound above through two layers)."""
    config = tiny_gpt_oss_config()
    torch.manual_seed(12)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    fp4_model = copy.deepcopy(model)
    ref_model = copy.deepcopy(model)
    for layer, fp4_layer, ref_layer in zip(model.model.layers, fp4_model.model.layers, ref_model.model.layers):
        fp4 = quantize_experts(layer.mlp.experts, "mxfp4", backend="triton")
        fp4_layer.mlp.experts = fp4
        ref = dequantized_into(layer.mlp.experts, fp4).to(torch.float32)
        ref_layer.mlp.experts = ref
    prompt = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        want = ref_model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        got = fp4_model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for g_logits, w_logits in zip(got.logits, want.logits):
        assert_close_relative(g_logits, w_logits)
    assert isinstance(fp4_model.model.layers[0].mlp.experts, FP4Experts)


def test_fp4_experts_under_torch_compile_fullgraph():
    """The module compiles as one graph (moe_gemv is a custom op); inductor's fused activation may round
    differently from eager in fp32, so the two agree to a few fp32 ulps of the output scale."""
    module = random_gpt_oss_experts(tiny_gpt_oss_config(), seed=13)
    fp4 = quantize_experts(module, "mxfp4", backend="triton")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(14))
    ids, weights = routing(3, 8, 2, seed=15)
    compiled = torch.compile(fp4, fullgraph=True)
    assert_close_relative(compiled(x, ids, weights), fp4(x, ids, weights), relative=2.0**-20)


def _tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(16)
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3-moe"])
def test_quantize_model_converts_experts_with_skip(family, tmp_path):
    """quantize_model turns every experts module into the FP4Experts quantize_experts makes of it (same
    outputs), and leaves the skipped ones in float; W4A4 refuses experts (they run weight-only); the
    checkpoint writers refuse FP4Experts rather than write buffers no loader reads."""
    from fp4gemv.nn import quantize_model, save_compressed_tensors, save_mxfp4

    if family == "gpt-oss":
        torch.manual_seed(17)
        model = transformers.GptOssForCausalLM(tiny_gpt_oss_config()).eval()
        fmt = "mxfp4"
    else:
        model = _tiny_qwen3_moe()
        fmt = "nvfp4"
    float_model = copy.deepcopy(model)
    names = quantize_model(model, fmt, skip=["lm_head", "*.self_attn", "model.layers.1.mlp.experts"],
                           scale_layout="linear")
    assert "model.layers.0.mlp.experts" in names and "model.layers.1.mlp.experts" not in names
    assert isinstance(model.model.layers[0].mlp.experts, FP4Experts)
    assert type(model.model.layers[1].mlp.experts) is type(float_model.model.layers[1].mlp.experts)
    by_hand = quantize_experts(float_model.model.layers[0].mlp.experts, fmt, "linear")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(18))
    ids, weights = routing(3, by_hand.num_experts, 2, seed=19)
    assert torch.equal(model.model.layers[0].mlp.experts(x, ids, weights), by_hand(x, ids, weights))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the whole model runs with FP4 experts
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: MoE experts run weight-only \(FP4Experts\), "
                                         r"got activations='w4a4'"):
        quantize_model(copy.deepcopy(float_model), "nvfp4", activations="w4a4", skip=["lm_head", "*.self_attn"])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: FP4Experts are not written to checkpoints"):
        (save_mxfp4 if fmt == "mxfp4" else save_compressed_tensors)(model, tmp_path)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_fp4_experts_refuse_bad_per_expert_global_scales_when_built(bad):
    """moe_gemv reads per-expert global scales only when asked (a sync per call); FP4Experts checks them once."""
    def projection(rows, k):
        w = fp4gemv.quantize(torch.randn(4, rows, k), "nvfp4")
        scales = torch.ones(4)
        return w, scales

    (gu, gu_scales), (down, down_scales) = projection(128, 64), projection(64, 64)
    down_scales[2] = bad
    good = ExpertWeights(gu, global_scales=gu_scales)
    with pytest.raises(ValueError, match=r"down.global_scales: expected a positive normal float32 .* at \(2,\)"):
        FP4Experts(good, ExpertWeights(down, global_scales=down_scales), activation="silu")
    FP4Experts(good, ExpertWeights(down, global_scales=torch.ones(4)), activation="silu")


def test_a_forward_in_grad_mode_runs_and_a_backward_says_the_experts_have_none():
    """Outside torch.no_grad() a transformers model's hidden states require grad (its embeddings are trainable):
    the forward runs as under no_grad, and a backward through the FP4 experts raises the message of their last op
    (moe_combine; its inputs come from moe_gemv, which has none either)."""
    from fp4gemv.nn import quantize_model

    torch.manual_seed(17)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss_config()).eval()
    quantize_model(model, "mxfp4", skip=["lm_head"])
    prompt = torch.tensor([[1, 2, 3]])
    logits = model(prompt).logits
    assert logits.requires_grad
    with torch.no_grad():
        assert torch.equal(logits, model(prompt).logits)
    with pytest.raises(RuntimeError, match=r"moe_combine has no backward \(inference only\)"):
        logits.sum().backward()
