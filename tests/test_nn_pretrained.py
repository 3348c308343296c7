"""Tiny Llama checkpoints written by fp4gemv's own writers in each convention load through
``fp4gemv.nn.from_pretrained`` and through transformers' ``AutoModelForCausalLM.from_pretrained`` with
``FP4GemvConfig``: FP4 layers become FP4Linear holding the stored bytes, logits equal those of the same model
with exactly dequantized weights (weight-only) or of ``load_quantized`` into the float model (W4A4), and greedy
``generate`` gives the same tokens."""

import copy

import pytest
import torch

import fp4gemv
from torch import nn

transformers = pytest.importorskip("transformers")

from fp4gemv.nn import (  # noqa: E402
    FP4Linear,
    SafetensorsDirectory,
    calibrate_input_scales,
    from_pretrained,
    load_quantized,
    quantize_model,
    save_compressed_tensors,
    save_modelopt,
    save_mxfp4,
)
from fp4gemv.nn.hf_quantizer import FP4GemvConfig  # noqa: E402

VOCAB, PROMPT = 96, 20  # 20 tokens: the prefill path (> DECODE_MAX_TOKENS); generate then decodes one at a time
WRITERS = {"compressed-tensors": save_compressed_tensors, "modelopt": save_modelopt, "gpt-oss": save_mxfp4}
CASES = [("compressed-tensors", "weight-only"), ("compressed-tensors", "w4a4"), ("modelopt", "weight-only"),
         ("modelopt", "w4a4"), ("gpt-oss", "weight-only")]


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, tie_word_embeddings=False, dtype="float32")


def _float_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():  # weights over a wide range of magnitudes, so block scales differ
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.mul_(torch.logspace(-3, 1, module.in_features))
    return model


@pytest.fixture(scope="module", params=CASES, ids=[f"{c}-{a}" for c, a in CASES])
def checkpoint(request, tmp_path_factory):
    """(directory, the float model, the FP4 model that was written, activations)."""
    convention, activations = request.param
    float_model = _float_model()
    fp4_model = copy.deepcopy(float_model)
    fmt = "mxfp4" if convention == "gpt-oss" else "nvfp4"
    quantize_model(fp4_model, fmt, activations=activations, skip=["lm_head"], scale_layout="linear")
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    if activations == "w4a4":
        calibrate_input_scales(fp4_model, lambda: fp4_model(prompt))
    directory = tmp_path_factory.mktemp(f"{convention}-{activations}")
    WRITERS[convention](fp4_model, directory, config=float_model.config.to_dict())
    return directory, float_model, fp4_model, activations


def _dequantized(float_model, fp4_model):
    """The float model with each Linear's weight replaced by its FP4 value, exact in float32."""
    model = copy.deepcopy(float_model)
    with torch.no_grad():
        for name, module in fp4_model.named_modules():
            if isinstance(module, FP4Linear):
                exact = fp4gemv.dequantize(module.quantized_weight(), torch.float64)
                assert torch.equal(exact.to(torch.float32).to(torch.float64), exact)
                model.get_submodule(name).weight.copy_(exact)
    return model


def _entry_points(directory):
    return {"fp4gemv.nn.from_pretrained": from_pretrained(directory, scale_layout="linear"),
            "AutoModelForCausalLM.from_pretrained": transformers.AutoModelForCausalLM.from_pretrained(
                str(directory), quantization_config=FP4GemvConfig(scale_layout="linear"))}


def _prompt():
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))


def _greedy(model, prompt):
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0, PROMPT:].tolist()


@torch.no_grad()
def test_both_entry_points_hold_the_stored_bytes(checkpoint):
    directory, float_model, _, activations = checkpoint
    linears = sorted(n for n, m in float_model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")
    stored = SafetensorsDirectory(directory)
    for where, model in _entry_points(directory).items():
        fp4 = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
        assert sorted(fp4) == linears, where
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
        for name, module in fp4.items():
            assert module.activations == activations and module.scale_layout == "linear"
            key = f"{name}.weight_packed" if f"{name}.weight_packed" in stored else f"{name}.weight"
            if f"{name}.weight_blocks" in stored:
                key = f"{name}.weight_blocks"
            assert torch.equal(module.checkpoint_weight(), stored[key].reshape(module.weight.shape)), (where, name)
        # No float tensor of an FP4 layer's shape exists anywhere in the loaded model.
        fp4_shapes = {(m.out_features, m.in_features) for m in fp4.values()}
        assert not any(tuple(t.shape) in fp4_shapes for t in model.state_dict().values() if t.is_floating_point())
    stored.close()


@torch.no_grad()
def test_logits_and_greedy_tokens_match_the_dequantized_model(checkpoint):
    directory, float_model, fp4_model, activations = checkpoint
    if activations == "weight-only":
        expected_model = _dequantized(float_model, fp4_model)
    else:  # the activations are quantized too: the float model with the checkpoint loaded by load_quantized
        expected_model = copy.deepcopy(float_model)
        load_quantized(expected_model, directory)
    prompt = _prompt()
    expected_logits = expected_model(prompt).logits
    expected_tokens = _greedy(expected_model, prompt)
    for where, model in _entry_points(directory).items():
        assert torch.equal(model(prompt).logits, expected_logits), where
        assert _greedy(model, prompt) == expected_tokens, where


@torch.no_grad()
def test_decode_step_is_the_exact_product(checkpoint):
    """A one-token step runs fp4gemv.gemv (the float64 product rounded once): equal to load_quantized's, and
    within float32 rounding of the dequantized model's."""
    directory, float_model, fp4_model, activations = checkpoint
    reference = copy.deepcopy(float_model)
    load_quantized(reference, directory)
    token = torch.tensor([[5]])
    model = from_pretrained(directory, scale_layout="swizzled")
    assert all(m.scale_layout == "swizzled" for m in model.modules() if isinstance(m, FP4Linear))
    got = model(token).logits
    assert torch.equal(got, reference(token).logits)
    if activations == "weight-only":
        torch.testing.assert_close(got, _dequantized(float_model, fp4_model)(token).logits, rtol=1e-4, atol=1e-4)


def test_from_pretrained_errors(tmp_path):
    model = _float_model()
    quantize_model(model, skip=["lm_head"], scale_layout="linear")
    save_modelopt(model, tmp_path, config=model.config.to_dict())
    with pytest.raises(TypeError, match="quantization_config: expected none"):
        from_pretrained(tmp_path, quantization_config=FP4GemvConfig())
    with pytest.raises(ValueError, match="activations: expected None, 'weight-only' or 'w4a4', got 'w8a8'"):
        FP4GemvConfig(activations="w8a8")
    # The config says the MLP is quantized but its tensors are float: refused, never a silent float layer.
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj"
    for name in ("weight", "weight_scale", "weight_scale_2"):
        tensors.pop(f"{key}.{name}")
    tensors[f"{key}.weight"] = torch.zeros(128, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"{key}: the modelopt config quantizes this module but the checkpoint has "
                                         f"no FP4 tensors for it"):
        from_pretrained(tmp_path)


def test_a_static_cache_decode_step_compiles_in_one_graph_without_recompiling(tmp_path):
    """transformers' static-cache decode (what generate compiles) traces FP4 layers without a graph break and
    does not recompile from one token to the next; its logits are the eager model's."""
    import torch._dynamo

    float_model = _float_model()
    quantize_model(float_model, skip=["lm_head"])
    save_compressed_tensors(float_model, tmp_path, config=float_model.config.to_dict())
    model = from_pretrained(tmp_path)
    prompt = _prompt()
    caches = [transformers.StaticCache(config=model.config, max_cache_len=PROMPT + 4) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(prompt, past_key_values=cache, cache_position=torch.arange(PROMPT))
        torch._dynamo.reset()
        step = torch.compile(model, backend="eager", fullgraph=True)
        token = torch.tensor([[int(prompt[0, -1])]])  # the strides of the argmax tokens that follow
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(3):
                position = torch.tensor([PROMPT + i])
                compiled = step(token, past_key_values=caches[0], cache_position=position).logits
                eager = model(token, past_key_values=caches[1], cache_position=position).logits
                assert torch.equal(compiled, eager)
                token = eager[:, -1:].argmax(-1)


# Loads a directory with transformers alone (fp4gemv's registration is never imported in that process).
_PLAIN_LOAD = """
import sys, torch, transformers
try:  # bf16: compressed-tensors (when installed) dequantizes to bf16 whatever the model's dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
except Exception as error:
    print("REFUSED", type(error).__name__, error)
else:
    with torch.no_grad():
        torch.save(model(torch.tensor([[5, 7, 9]])).logits.float(), sys.argv[2])
    print("LOADED")
assert "fp4gemv" not in sys.modules
"""


@pytest.mark.parametrize("convention", list(WRITERS))
def test_plain_transformers_refuses_or_loads_correctly(tmp_path, convention):
    """A checkpoint fp4gemv writes, given to AutoModelForCausalLM.from_pretrained without fp4gemv, is refused
    (compressed-tensors: the package is needed; ModelOpt and MXFP4: the packed weight's size) or gives the
    logits of the exactly dequantized model to bf16 rounding (compressed-tensors 0.20 installed: measured 0.0056
    off for logits up to 1.1)."""
    import subprocess
    import sys

    float_model = _float_model()
    fp4_model = copy.deepcopy(float_model)
    quantize_model(fp4_model, "mxfp4" if convention == "gpt-oss" else "nvfp4", skip=["lm_head"])
    WRITERS[convention](fp4_model, tmp_path / "ckpt", config=float_model.config.to_dict())
    result = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(tmp_path / "ckpt"), str(tmp_path / "logits.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    if result.stdout.startswith("REFUSED"):
        assert ("compressed-tensors" in result.stdout if convention == "compressed-tensors"
                else "ignore_mismatched_sizes" in result.stdout), result.stdout
        return
    assert result.stdout.startswith("LOADED"), result.stdout
    with torch.no_grad():
        want = _dequantized(float_model, fp4_model)(torch.tensor([[5, 7, 9]])).logits
    got = torch.load(tmp_path / "logits.pt")
    assert (got - want).abs().max() <= 2.0**-6 * want.abs().max()


@pytest.mark.parametrize("convention", ["modelopt", "gpt-oss"])
def test_loads_through_fp4gemv_print_no_skipped_quantization(tmp_path, capfd, caplog, convention):
    """transformers does not know "modelopt" nor "fp4gemv-mxfp4": a load through fp4gemv says nothing about
    skipping an unknown quantization type; without FP4GemvConfig the load is refused, saying what to call."""
    model = _float_model()
    quantize_model(model, "mxfp4" if convention == "gpt-oss" else "nvfp4", skip=["lm_head"])
    WRITERS[convention](model, tmp_path, config=model.config.to_dict())
    capfd.readouterr()
    loaded = [from_pretrained(tmp_path), transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), quantization_config=FP4GemvConfig())]
    assert all(isinstance(m.model.layers[0].mlp.up_proj, FP4Linear) for m in loaded)
    printed = "".join(capfd.readouterr()) + caplog.text
    assert "Unknown quantization type" not in printed and "skip the quantization" not in printed, printed
    with pytest.raises(ValueError, match=r"quantization_config: quant_method '(modelopt|fp4gemv-mxfp4)' is read by "
                                         r"fp4gemv, not by transformers .*fp4gemv.nn.from_pretrained\(path\)"):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))


def test_fp4gemv_config_refuses_unknown_keywords_and_round_trips():
    with pytest.raises(TypeError, match=r"FP4GemvConfig: unknown keyword 'activation'; expected 'activations', "
                                        r"'scale_layout'"):
        FP4GemvConfig(activation="w4a4")
    with pytest.raises(TypeError, match=r"unknown keyword 'scale_layot'"):
        FP4GemvConfig.from_dict({"quant_method": "fp4gemv", "scale_layot": "linear"})
    with pytest.raises(ValueError, match="quant_method: expected 'fp4gemv', got 'mxfp4'"):
        FP4GemvConfig(quant_method="mxfp4")
    config = FP4GemvConfig(activations="w4a4", scale_layout="linear")
    again = FP4GemvConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict() == {"quant_method": "fp4gemv", "activations": "w4a4",
                                                   "scale_layout": "linear"}


def test_save_pretrained_refuses_and_the_writers_round_trip(tmp_path):
    float_model = _float_model()
    quantize_model(float_model, skip=["lm_head"])
    save_modelopt(float_model, tmp_path / "ckpt", config=float_model.config.to_dict())
    model = from_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="save_pretrained: a model loaded by fp4gemv is written with "
                                         "fp4gemv.nn.save_compressed_tensors"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())
    save_compressed_tensors(model, tmp_path / "again", config=model.config.to_dict())
    again = from_pretrained(tmp_path / "again")
    prompt = _prompt()
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, model(prompt).logits)


@pytest.mark.parametrize("convention", list(WRITERS))
def test_writers_take_the_model_config_or_refuse(tmp_path, convention):
    model = _float_model()
    quantize_model(model, "mxfp4" if convention == "gpt-oss" else "nvfp4", skip=["lm_head"])
    WRITERS[convention](model, tmp_path / "own")  # no config=: the model's
    WRITERS[convention](model, tmp_path / "object", config=model.config)  # a PretrainedConfig as well as a dict
    prompt = _prompt()
    with torch.no_grad():
        want = model(prompt).logits
        for name in ("own", "object"):
            assert torch.equal(from_pretrained(tmp_path / name)(prompt).logits, want), name
    bare = nn.Sequential(nn.Linear(64, 64))
    quantize_model(bare, "mxfp4" if convention == "gpt-oss" else "nvfp4")
    with pytest.raises(ValueError, match="config: expected the model's config for config.json .* got none and model "
                                         "has no .config"):
        WRITERS[convention](bare, tmp_path / "bare")
    assert not (tmp_path / "bare").exists()
    with pytest.raises(TypeError, match="config: expected a dict or a transformers PretrainedConfig, got str"):
        WRITERS[convention](model, tmp_path / "bad", config="llama")


def test_from_pretrained_refuses_unknown_and_missing_tensors_as_load_quantized_does(tmp_path):
    from safetensors.torch import load_file, save_file

    float_model = _float_model()
    quantize_model(float_model, skip=["lm_head"])
    save_compressed_tensors(float_model, tmp_path, config=float_model.config.to_dict())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(4)
    save_file(tensors, tmp_path / "model.safetensors")
    pattern = r"directory: checkpoint and model disagree: missing \[\], unexpected \['model.layers.0.mlp.extra.weight'\]"
    with pytest.raises(ValueError, match=pattern):
        load_quantized(_float_model(), tmp_path)
    with pytest.raises(ValueError, match=pattern):
        from_pretrained(tmp_path)
    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    pattern = r"directory: checkpoint and model disagree: missing \['model.norm.weight'\], unexpected \[\]"
    with pytest.raises(ValueError, match=pattern):
        load_quantized(_float_model(), tmp_path)
    with pytest.raises(ValueError, match=pattern):
        from_pretrained(tmp_path)
