"""MoE checkpoints through ``fp4gemv.nn.from_pretrained``, ``AutoModelForCausalLM.from_pretrained`` with
``FP4GemvConfig`` and ``load_quantized``: a tiny gpt-oss checkpoint in the published layout (``quant_method``
``"mxfp4"``, experts as ``*_proj_blocks`` / ``*_proj_scales`` uint8 and bf16 biases, every other tensor bf16) and
tiny Qwen3-MoE checkpoints with one NVFP4 linear layer per expert (compressed-tensors, ModelOpt).  The experts
become FP4Experts holding the written bytes; logits agree with the float model whose experts hold the exactly
dequantized weights within tests/test_moe_nn.py's bound for its tiny gpt-oss generate test (``RELATIVE`` of the
largest logit), and greedy ``generate`` gives the same tokens.  The reference for the gpt-oss layout is
transformers' own conversion (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``)."""

import copy
import json

import pytest
import torch
from torch import nn

import fp4gemv

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from fp4gemv.nn import (FP4Experts, FP4Linear, from_pretrained, load_quantized, quantize_experts,  # noqa: E402
                        quantize_model)
from fp4gemv.nn.checkpoints import layer_tensors, write_safetensors  # noqa: E402
from fp4gemv.nn.hf_quantizer import FP4GemvConfig  # noqa: E402
from test_moe_nn import assert_close_relative  # noqa: E402  (its RELATIVE bound by default)

EXPERTS, PROMPT = 4, [3, 17, 42, 99, 5, 64, 7, 21]
GPT_OSS_SKIP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _prompt(device="cpu"):
    return torch.tensor([PROMPT], device=device)


def _greedy(model, prompt):
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _entry_points(directory, **kwargs):
    """The model from each entry point (float32, linear scales unless kwargs say otherwise)."""
    kwargs = {"dtype": torch.float32, **kwargs}
    layout = kwargs.pop("scale_layout", "linear")
    return {"fp4gemv.nn.from_pretrained": from_pretrained(directory, scale_layout=layout, **kwargs),
            "AutoModelForCausalLM.from_pretrained": transformers.AutoModelForCausalLM.from_pretrained(
                str(directory), quantization_config=FP4GemvConfig(scale_layout=layout), **kwargs)}


def _write(directory, tensors, config, quantization, aligned=False):
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if aligned:
        write_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": quantization}))
    return directory


def _refused(directory, pattern, float_model):
    """Both entry points and load_quantized refuse the directory with a message matching ``pattern``."""
    for load in (lambda: from_pretrained(directory), lambda: transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), quantization_config=FP4GemvConfig()), lambda: load_quantized(float_model, directory)):
        with pytest.raises(ValueError, match=pattern):
            load()


# --- gpt-oss ----------------------------------------------------------------------------------------------------


def _gpt_oss_config():
    return transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=16,
                                     max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                                     dtype="bfloat16")


def _gpt_oss_float_model():
    """Random weights (std 0.2, as tests/test_moe_nn.py's generate test), each exactly a bf16 value (the
    checkpoint stores bf16), in float32."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_gpt_oss_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
            p.copy_(p.bfloat16())
    return model


def _gpt_oss_expert_tensors(fp4: FP4Experts, prefix: str) -> dict[str, torch.Tensor]:
    """The published layout: blocks uint8 [E, rows, K/32, 16], scales uint8 [E, rows, K/32], biases bf16."""
    out = {}
    for name in ("gate_up", "down"):
        p = fp4.projection(name)
        experts, rows, k = p.weight.shape
        # The checkpoint's code order, whichever one the module keeps.
        out[f"{prefix}.{name}_proj_blocks"] = p.weight.with_code_order("checkpoint").data.reshape(experts, rows,
                                                                                                  k // 32, 16)
        out[f"{prefix}.{name}_proj_scales"] = p.weight.linear_scales().view(torch.uint8)
        out[f"{prefix}.{name}_proj_bias"] = p.bias.to(torch.bfloat16)
    return out


def _gpt_oss_reference(float_model, tensors):
    """The float model with each layer's experts holding transformers' own dequantization of the checkpoint."""
    model = copy.deepcopy(float_model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                key = f"model.layers.{i}.mlp.experts.{name}"
                values = convert_moe_packed_tensors(tensors[f"{key}_blocks"], tensors[f"{key}_scales"],
                                                    dtype=torch.float32)
                getattr(layer.mlp.experts, name).copy_(values)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(directory, the float model, the checkpoint's tensors, the reference model)."""
    float_model = _gpt_oss_float_model()
    tensors = {k: v.to(torch.bfloat16) for k, v in float_model.state_dict().items() if ".mlp.experts." not in k}
    for i, layer in enumerate(float_model.model.layers):
        fp4 = quantize_experts(layer.mlp.experts, "mxfp4", "linear")
        tensors.update(_gpt_oss_expert_tensors(fp4, f"model.layers.{i}.mlp.experts"))
    directory = _write(tmp_path_factory.mktemp("gpt-oss"), tensors, float_model.config,
                       {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_SKIP})
    return directory, float_model, tensors, _gpt_oss_reference(float_model, tensors)


def _check_gpt_oss_experts(model, tensors, where, dtype=torch.float32, layout="linear"):
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, FP4Experts) and experts.activation == "gpt-oss", where
        for name in ("gate_up", "down"):
            key = f"model.layers.{i}.mlp.experts.{name}_proj"
            p = experts.projection(name)
            assert p.weight.scale_layout == layout and p.global_scales is None and p.weight.global_scale is None
            stored = p.weight.with_code_order("checkpoint").data
            assert torch.equal(stored, tensors[f"{key}_blocks"].reshape(stored.shape)), (where, key)
            assert torch.equal(p.weight.linear_scales().view(torch.uint8), tensors[f"{key}_scales"]), (where, key)
            assert p.bias.dtype == dtype and torch.equal(p.bias, tensors[f"{key}_bias"].to(dtype)), (where, key)
    # No float tensor of an expert projection's shape exists anywhere in the loaded model.
    config = model.config
    shapes = {(EXPERTS, config.hidden_size, 2 * config.intermediate_size), (EXPERTS, config.intermediate_size,
                                                                            config.hidden_size)}
    assert not any(tuple(t.shape) in shapes for t in model.state_dict().values() if t.is_floating_point()), where


@torch.no_grad()
def test_gpt_oss_experts_load_as_fp4_experts_holding_the_stored_bytes(gpt_oss):
    directory, float_model, tensors, reference = gpt_oss
    loaded = _entry_points(directory)
    loaded["load_quantized"] = copy.deepcopy(float_model)
    assert load_quantized(loaded["load_quantized"], directory) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for where, model in loaded.items():
        _check_gpt_oss_experts(model, tensors, where)
        assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # the float layers stay float
    # The checkpoint is in the layout transformers reads: its dequantization is fp4gemv's exact one.
    values = fp4gemv.dequantize(loaded["load_quantized"].model.layers[1].mlp.experts.projection("down").weight,
                                torch.float32)
    assert torch.equal(values.transpose(1, 2), reference.model.layers[1].mlp.experts.down_proj)


@torch.no_grad()
def test_gpt_oss_logits_and_greedy_tokens_match_the_dequantized_model(gpt_oss):
    directory, float_model, _, reference = gpt_oss
    prompt = _prompt()
    want_logits, want_tokens = reference(prompt).logits, _greedy(reference, prompt)
    by_load_quantized = copy.deepcopy(float_model)
    load_quantized(by_load_quantized, directory)
    for where, model in _entry_points(directory).items():
        got = model(prompt).logits
        assert_close_relative(got, want_logits)
        assert torch.equal(got, by_load_quantized(prompt).logits), where
        assert _greedy(model, prompt) == want_tokens, where


@torch.no_grad()
def test_gpt_oss_in_the_checkpoint_dtype_with_linear_expert_scales(gpt_oss):
    """The defaults: the checkpoint's dtype (bf16: biases in bf16, as stored) and the experts' block scales
    linear, rows 16 bytes apart (``EXPERT_SCALE_LAYOUT``: the routed engine's), even with ``scale_layout=
    "swizzled"`` for the FP4Linear layers; the bf16 model's logits are the float32 model's to bf16's precision."""
    directory, _, tensors, reference = gpt_oss
    model = from_pretrained(directory)
    assert model.dtype == torch.bfloat16
    _check_gpt_oss_experts(model, tensors, "default", dtype=torch.bfloat16, layout="linear")
    assert model.model.layers[0].mlp.experts.projection("down").weight.scales.stride(-2) % 16 == 0
    logits = model(_prompt()).logits
    assert_close_relative(logits.float(), reference(_prompt()).logits, relative=2.0**-6)


def test_gpt_oss_extra_or_missing_expert_tensors_are_refused_by_name(gpt_oss, tmp_path):
    directory, float_model, tensors, _ = gpt_oss
    key = "model.layers.0.mlp.experts"
    extra = {**tensors, f"{key}.gate_up_proj": torch.zeros(EXPERTS, 64, 128, dtype=torch.bfloat16)}
    _write(tmp_path / "extra", extra, float_model.config,
           {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_SKIP})
    _refused(tmp_path / "extra", rf"checkpoint and model disagree: missing \[\], unexpected \['{key}.gate_up_proj'\]",
             copy.deepcopy(float_model))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.down_proj_scales"}
    _write(tmp_path / "missing", missing, float_model.config,
           {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_SKIP})
    _refused(tmp_path / "missing", r"checkpoint and model disagree: missing \['model.layers.1.mlp.experts."
                                   r"down_proj_scales'\], unexpected \[\]", copy.deepcopy(float_model))


def test_gpt_oss_config_and_activations_disagreements_are_refused(gpt_oss, tmp_path):
    directory, float_model, tensors, _ = gpt_oss
    _write(tmp_path / "float", tensors, float_model.config,
           {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_SKIP + ["model.layers.*.mlp.experts"]})
    _refused(tmp_path / "float", r"model.layers.0.mlp.experts: the checkpoint has gpt-oss FP4 tensors but the mxfp4 "
                                 r"config leaves this module in float", copy.deepcopy(float_model))
    pattern = r"model.layers.0.mlp.experts: MoE experts run weight-only \(FP4Experts\), got activations='w4a4'"
    with pytest.raises(ValueError, match=pattern):
        from_pretrained(directory, activations="w4a4")
    with pytest.raises(ValueError, match=pattern):
        load_quantized(copy.deepcopy(float_model), directory, activations="w4a4")


# --- Qwen3-MoE, one NVFP4 linear layer per expert ------------------------------------------------------------------

QWEN3_CASES = [("compressed-tensors", "weight-only"), ("modelopt", "weight-only"), ("modelopt", "w4a4")]


def _qwen3_float_model():
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32, num_experts=EXPERTS,
                                         num_experts_per_tok=2, max_position_embeddings=64, decoder_sparse_step=1,
                                         mlp_only_layers=[], dtype="float32")
    torch.manual_seed(1)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
        for layer in model.model.layers:  # per-expert, per-projection magnitudes: distinct global scales
            layer.mlp.experts.gate_up_proj[:, 32:] *= 4
            layer.mlp.experts.gate_up_proj.mul_(torch.logspace(-2, 1, EXPERTS, base=2.0)[:, None, None])
    return model


def _quantization_config(convention, activations):
    if convention == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4" if activations == "w4a4" else "W4A16_NVFP4",
                "group_size": 16, "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def _qwen3_checkpoint(directory, convention, activations):
    """Write a Qwen3-MoE checkpoint with the attention's linear layers and every expert's gate, up and down layers
    in NVFP4 to ``directory``: (the float model, {layer name: the FP4Linear written})."""
    float_model = _qwen3_float_model()
    fp4_model = copy.deepcopy(float_model)
    quantize_model(fp4_model, "nvfp4", activations=activations, skip=["lm_head", "*.mlp.experts"],
                   scale_layout="linear")
    layers = {n: m for n, m in fp4_model.named_modules() if isinstance(m, FP4Linear)}
    for layer_index, layer in enumerate(float_model.model.layers):
        experts = layer.mlp.experts
        for e in range(EXPERTS):
            for name, w in (("gate_proj", experts.gate_up_proj[e, :32]), ("up_proj", experts.gate_up_proj[e, 32:]),
                            ("down_proj", experts.down_proj[e])):
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                with torch.no_grad():
                    linear.weight.copy_(w)
                fp4 = FP4Linear.from_linear(linear, "nvfp4", activations=activations, scale_layout="linear")
                layers[f"model.layers.{layer_index}.mlp.experts.{e}.{name}"] = fp4
    if activations == "w4a4":
        for module in layers.values():
            module.set_input_scale(torch.tensor(2.0**-4))
    prefixes = tuple(n + "." for n in layers)
    tensors = {k: v for k, v in fp4_model.state_dict().items() if not k.startswith(prefixes)
               and ".mlp.experts." not in k}
    for name, module in layers.items():
        tensors.update(layer_tensors(module, convention, name))
    _write(directory, tensors, float_model.config, _quantization_config(convention, activations), aligned=True)
    return float_model, layers


@pytest.fixture(scope="module", params=QWEN3_CASES, ids=[f"{c}-{a}" for c, a in QWEN3_CASES])
def qwen3(request, tmp_path_factory):
    """(directory, the float model, {layer name: the FP4Linear written}, the reference model, activations): the
    reference holds the FP4 layers' exactly dequantized weights (weight-only)."""
    convention, activations = request.param
    directory = tmp_path_factory.mktemp(f"qwen3-{convention}-{activations}")
    float_model, layers = _qwen3_checkpoint(directory, convention, activations)
    reference = copy.deepcopy(float_model)
    with torch.no_grad():
        for name, module in layers.items():
            values = fp4gemv.dequantize(module.quantized_weight(), torch.float32)
            experts_name, _, rest = name.partition(".mlp.experts.")
            if not rest:
                reference.get_submodule(name).weight.copy_(values)
                continue
            e, projection = rest.split(".")
            experts = reference.get_submodule(experts_name + ".mlp.experts")
            target = experts.down_proj[int(e)] if projection == "down_proj" else \
                experts.gate_up_proj[int(e), :32] if projection == "gate_proj" else experts.gate_up_proj[int(e), 32:]
            target.copy_(values)
    return directory, float_model, layers, reference, activations


@torch.no_grad()
def test_qwen3_per_expert_nvfp4_loads_as_fp4_experts(qwen3):
    """The experts of every layer become one FP4Experts: gate and up stacked in halves with their own global
    scales ([E, 2]), the written bytes; the attention's layers FP4Linear (W4A4 where the checkpoint says so, the
    experts weight-only, their input scales read and dropped)."""
    directory, float_model, layers, _, activations = qwen3
    loaded = _entry_points(directory)
    loaded["load_quantized"] = copy.deepcopy(float_model)
    load_quantized(loaded["load_quantized"], directory)
    for where, model in loaded.items():
        assert model.model.layers[0].self_attn.q_proj.activations == activations, where
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            assert isinstance(experts, FP4Experts) and experts.activation == "silu", where
            key = f"model.layers.{i}.mlp.experts"
            gate_up, down = experts.projection("gate_up"), experts.projection("down")
            gate_up_data = gate_up.weight.with_code_order("checkpoint").data  # the layers' own code order
            down_data = down.weight.with_code_order("checkpoint").data
            for e in range(EXPERTS):
                gate, up = layers[f"{key}.{e}.gate_proj"], layers[f"{key}.{e}.up_proj"]
                assert torch.equal(gate_up_data[e], torch.cat([gate.checkpoint_weight(), up.checkpoint_weight()])), \
                    (where, key, e)
                assert torch.equal(down_data[e], layers[f"{key}.{e}.down_proj"].checkpoint_weight()), (where, key, e)
                assert gate_up.global_scales[e].tolist() == [float(gate.weight_multiplier()),
                                                             float(up.weight_multiplier())]
            assert gate_up.bias is None and down.bias is None


@torch.no_grad()
def test_qwen3_logits_and_greedy_tokens_match_the_dequantized_model(qwen3):
    directory, float_model, _, reference, activations = qwen3
    prompt = _prompt()
    by_load_quantized = copy.deepcopy(float_model)
    load_quantized(by_load_quantized, directory)
    want_logits, want_tokens = reference(prompt).logits, _greedy(reference, prompt)
    for where, model in _entry_points(directory).items():
        got = model(prompt).logits
        assert torch.equal(got, by_load_quantized(prompt).logits), where
        if activations == "weight-only":  # W4A4: the attention's activations are quantized too
            assert_close_relative(got, want_logits)
            assert _greedy(model, prompt) == want_tokens, where


def test_qwen3_extra_or_missing_expert_tensors_are_refused_by_name(qwen3, tmp_path):
    directory, float_model, _, _, activations = qwen3
    if activations == "w4a4":
        pytest.skip("the same keys as weight-only")
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    key = "model.layers.0.mlp.experts"
    data = "weight_packed" if f"{key}.0.gate_proj.weight_packed" in tensors else "weight"
    # An expert past num_experts: transformers' per-expert converter would report it as "...gate_up_proj_packed".
    extra = {**tensors, f"{key}.{EXPERTS}.gate_proj.{data}": tensors[f"{key}.0.gate_proj.{data}"]}
    _write(tmp_path / "extra", extra, float_model.config, config, aligned=True)
    _refused(tmp_path / "extra", rf"missing \[\], unexpected \['{key}.{EXPERTS}.gate_proj.{data}'\]",
             copy.deepcopy(float_model))
    gone = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    _write(tmp_path / "missing", {k: v for k, v in tensors.items() if k != gone}, float_model.config, config,
           aligned=True)
    _refused(tmp_path / "missing", rf"missing \['{gone}'\], unexpected \[\]", copy.deepcopy(float_model))
    # The config leaves one expert's layer in float while the checkpoint holds it in FP4.
    skip = "model.layers.1.mlp.experts.3.down_proj"
    if config["quant_method"] == "modelopt":
        config = {**config, "exclude_modules": config["exclude_modules"] + [skip]}
    else:
        config = {**config, "ignore": config["ignore"] + [skip]}
    _write(tmp_path / "float", tensors, float_model.config, config, aligned=True)
    _refused(tmp_path / "float", rf"{skip}: the checkpoint has .* FP4 tensors but the .* config leaves this module "
                                 rf"in float", copy.deepcopy(float_model))


# --- plain transformers, and the GPU -------------------------------------------------------------------------------

# Loads CHECKPOINT with transformers alone (fp4gemv is never imported in that process), logits to LOGITS.
_PLAIN_LOAD = """
import os, sys, torch, transformers
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(os.environ["CHECKPOINT"], dtype=torch.bfloat16)
except Exception as error:
    print("REFUSED", type(error).__name__, error)
else:
    with torch.no_grad():
        torch.save(model(torch.tensor([%s])).logits.float(), os.environ["LOGITS"])
    print("LOADED")
assert "fp4gemv" not in sys.modules
""" % PROMPT


def test_plain_transformers_loads_gpt_oss_correctly_and_refuses_per_expert_nvfp4(gpt_oss, fresh_python, tmp_path):
    """What docs/checkpoints.md says transformers 5.17 does alone: the gpt-oss checkpoint loads correctly (its
    mxfp4 quantizer dequantizes the experts to bf16 without the kernels package); per-expert ModelOpt NVFP4 is
    refused (the packed uint8 weights' shapes)."""
    directory, _, _, reference = gpt_oss
    result = fresh_python(_PLAIN_LOAD, env={"CHECKPOINT": str(directory), "LOGITS": str(tmp_path / "logits.pt")})
    assert result.returncode == 0 and result.stdout.startswith("LOADED"), result.stdout + result.stderr[-2000:]
    with torch.no_grad():
        assert_close_relative(torch.load(tmp_path / "logits.pt"), reference(_prompt()).logits, relative=2.0**-6)
    _qwen3_checkpoint(tmp_path / "qwen3", "modelopt", "weight-only")
    result = fresh_python(_PLAIN_LOAD, env={"CHECKPOINT": str(tmp_path / "qwen3"), "LOGITS": str(tmp_path / "q.pt")})
    assert result.returncode == 0 and result.stdout.startswith("REFUSED"), result.stdout + result.stderr[-2000:]
    assert "ignore_mismatched_sizes" in result.stdout, result.stdout


@pytest.mark.gpu
@torch.no_grad()
def test_gpt_oss_loads_onto_cuda_and_runs(gpt_oss):
    """device="cuda": the stored bytes straight into FP4Experts on the GPU, moe_gemv's kernels in the forward."""
    directory, _, tensors, reference = gpt_oss
    model = from_pretrained(directory, device="cuda", dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP4Experts) and experts.projection("down").weight.data.device.type == "cuda"
    assert torch.equal(experts.projection("down").weight.with_code_order("checkpoint").data.cpu(),
                       tensors["model.layers.0.mlp.experts.down_proj_blocks"].reshape(EXPERTS, 64, 32))
    prompt = _prompt("cuda")
    reference = copy.deepcopy(reference).to("cuda")
    assert_close_relative(model(prompt).logits, reference(prompt).logits)
    assert _greedy(model, prompt) == _greedy(reference, prompt)
    bf16 = from_pretrained(directory, device="cuda")
    assert torch.isfinite(bf16(prompt).logits).all()
