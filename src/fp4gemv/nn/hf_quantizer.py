"""fp4gemv as a Hugging Face transformers quantizer (``quant_method`` ``"fp4gemv"``).

Importing this module registers :class:`FP4GemvConfig` and :class:`FP4GemvHfQuantizer` with transformers'
quantizer registry (``transformers.quantizers.register_quantization_config`` / ``register_quantizer``), so::

    from transformers import AutoModelForCausalLM
    from fp4gemv.nn.hf_quantizer import FP4GemvConfig

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=FP4GemvConfig(), device_map="cuda")

loads a checkpoint in any convention ``fp4gemv.nn.load_quantized`` reads (compressed-tensors
``nvfp4-pack-quantized``, NVIDIA ModelOpt NVFP4, gpt-oss MXFP4) with its FP4 layers as ``FP4Linear`` and its
FP4 MoE experts (gpt-oss's ``*_proj_blocks``, or one NVFP4 layer per expert as Qwen3-MoE exports store them)
as ``FP4Experts``.  ``fp4gemv.nn.from_pretrained`` is the same call.

How: transformers builds the model on the meta device; before weights load, every ``nn.Linear`` the
checkpoint holds in FP4 (``fp4gemv.nn.model.fp4_modules``: key names checked against the quantization
config), and every MoE experts module it holds in FP4 (``fp4_experts``), becomes a placeholder whose buffers
carry the checkpoint's own names (per-expert layers as nested submodules ``<e>.gate_proj``), shapes and
dtypes (read from the safetensors headers), so transformers' loader reads those tensors as they are stored
straight onto the target device; float tensors load as usual.  The experts' biases are the exception: their
buffers take the dtype of the float module's biases (the requested dtype), so transformers casts them as it
casts every float tensor.  An experts module's keys are complete or the load is refused before anything is
read, naming the missing and the unknown tensors under its name.  After loading, each placeholder becomes an
``FP4Linear`` made of views of those buffers (``FP4Linear.from_state_dict``; a weight-only layer's packed codes
repacked once, on the device, into ``LINEAR_CODE_ORDER``'s paired order) or an ``FP4Experts``
(``fp4gemv.nn.model.read_experts``: gpt-oss's blocks reordered once into the experts' code order; per-expert
layers stacked into ``[E, rows, K/2]``; one experts module at a time, their linear scale rows kept 16 bytes apart);
``scale_layout="swizzled"`` re-lays the FP4Linear layers' block scales, one module at a time.  No float copy of an
FP4 layer is ever made.  Per-expert checkpoint keys reach the placeholder under their own names: transformers'
per-expert converters (``experts.*.gate_proj.weight`` into the fused ``gate_up_proj``) rename such a key to one the
model lacks, and its loader then keeps the original name, which the placeholder has.

A checkpoint whose ``quant_method`` transformers already knows (``"compressed-tensors"``, ``"mxfp4"``)
would make transformers refuse a second config ("The model is quantized with ... but you are passing ...",
``AutoHfQuantizer.merge_quantization_configs``, which compares the two classes); registration therefore
wraps that classmethod so that an :class:`FP4GemvConfig` passed by the caller is kept (fp4gemv reads the
checkpoint's own config itself).  Every other combination goes to transformers' own method unchanged.
The methods only fp4gemv reads (``fp4gemv.nn.model.FP4GEMV_ONLY_METHODS``: ``"modelopt"``,
``"fp4gemv-mxfp4"``) would make transformers print that it skips an unknown quantization type, even on a
load through fp4gemv: each is registered as a config that transformers can find, whose ``from_dict``
refuses the load, with what to call instead, when no FP4GemvConfig is passed.
Tested with transformers 5.17 (``TESTED_TRANSFORMERS``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
import transformers
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, AutoHfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .checkpoints import SAFETENSORS_DTYPES, layer_keys
from .linear import ACTIVATIONS, FP4Linear
from .moe import EXPERT_SCALE_LAYOUT
from .model import (FP4GEMV_ONLY_METHODS, check_agreement, check_expert_activations, check_replacement,
                    expert_bias_dtypes, expert_keys, fp4_experts, fp4_modules, read_experts,
                    read_quantization_config)

__all__ = ["FP4GemvConfig", "FP4GemvHfQuantizer", "QUANT_METHOD", "TESTED_TRANSFORMERS"]

QUANT_METHOD = "fp4gemv"
# The transformers releases the tests ran with (pyproject's ``transformers`` extra pins the same range).
TESTED_TRANSFORMERS = ("5.17", "5.18")

class FP4GemvConfig(QuantizationConfigMixin):
    """What ``from_pretrained`` does with a checkpoint's FP4 layers.

    activations: None follows the checkpoint (W4A4 where it has a static input scale or its config says
        so, else weight-only); ``"weight-only"`` or ``"w4a4"`` overrides it.  MoE experts (``FP4Experts``) run
        weight-only: ``"w4a4"`` with FP4 experts in the checkpoint is refused.
    scale_layout: the FP4Linear layers' block scales: ``"swizzled"`` (the layout the dense kernels are tuned on;
        re-lays the stored block scales) or None / ``"linear"`` (keeps them as stored: no copy).  MoE experts get
        ``moe.EXPERT_SCALE_LAYOUT`` (linear, rows 16 bytes apart: the routed engine's).
    """

    def __init__(self, activations: str | None = None, scale_layout: str | None = "swizzled", *,
                 quant_method: str = QUANT_METHOD, **unknown) -> None:
        # quant_method: what to_dict writes and transformers' from_dict passes back (cls(**to_dict())).
        if unknown:
            raise TypeError(f"FP4GemvConfig: unknown keyword {', '.join(map(repr, unknown))}; expected "
                            f"'activations', 'scale_layout' (and 'quant_method' {QUANT_METHOD!r})")
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method: expected {QUANT_METHOD!r}, got {quant_method!r}")
        if activations is not None and activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected None, 'weight-only' or 'w4a4', got {activations!r}")
        if scale_layout not in (None, "linear", "swizzled"):
            raise ValueError(f"scale_layout: expected None, 'linear' or 'swizzled', got {scale_layout!r}")
        self.quant_method = QUANT_METHOD
        self.activations = activations
        self.scale_layout = scale_layout


class _ReadByFP4Gemv(QuantizationConfigMixin):
    """Stands for a quant_method only fp4gemv reads (module docstring): never built."""

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        method = config_dict.get("quant_method")
        raise ValueError(f"quantization_config: quant_method {method!r} is read by fp4gemv, not by transformers "
                         f"{transformers.__version__}: load it with fp4gemv.nn.from_pretrained(path), or pass "
                         f"quantization_config=fp4gemv.nn.hf_quantizer.FP4GemvConfig()")


class _Placeholder(nn.Module):
    """Stands for one FP4 module while transformers loads: meta buffers named (nested submodules for dotted
    names, such as per-expert layers), shaped and typed as the checkpoint stores them (``dtypes`` overrides a
    float tensor's: transformers casts it while loading), filled by the loader; never called.  ``replaced``:
    the meta module it stands for (not a submodule), for the checks after loading."""

    def __init__(self, replaced: nn.Module, key: str, headers: dict[str, tuple[list[int], str]], keys: list[str],
                 dtypes: dict[str, torch.dtype] | None = None) -> None:
        super().__init__()
        self.__dict__["replaced"] = replaced
        self.key = key
        for full_key in keys:
            shape, dtype_name = headers[full_key]
            if dtype_name not in SAFETENSORS_DTYPES:
                raise TypeError(f"{full_key}: expected a dtype among {sorted(SAFETENSORS_DTYPES)}, got {dtype_name}")
            *path, name = full_key[len(key) + 1:].split(".")
            owner = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            dtype = (dtypes or {}).get(full_key, SAFETENSORS_DTYPES[dtype_name])
            owner.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))

    def loaded(self) -> dict[str, torch.Tensor]:
        """The tensors the loader filled, by checkpoint key; ValueError naming any it left unloaded."""
        meta = [n for n, b in self.named_buffers() if b.is_meta]
        if meta:
            raise ValueError(f"{self.key}: checkpoint tensors {meta} were not loaded")
        return {f"{self.key}.{n}": b for n, b in self.named_buffers()}

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.key}: FP4 module still a loading placeholder (the quantizer's postprocess did "
                           f"not run)")


def _headers(checkpoint_files: list[str]) -> dict[str, tuple[list[int], str]]:
    """Every tensor's (shape, safetensors dtype name) from the files' headers (no tensor is read)."""
    headers = {}
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            raise ValueError(f"checkpoint_files: expected *.safetensors files, got {file}")
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                headers[key] = (list(piece.get_shape()), piece.get_dtype())
    return headers


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class FP4GemvHfQuantizer(HfQuantizer):
    """Loads pre-quantized FP4 checkpoints into ``FP4Linear`` modules (this module's docstring says how)."""

    requires_calibration = False
    quantization_config: FP4GemvConfig

    def validate_environment(self, device_map=None, **kwargs) -> None:
        devices = set(device_map.values()) if isinstance(device_map, dict) else set()
        if "disk" in devices:
            raise ValueError("device_map: expected devices for every module, got 'disk' (FP4 layers cannot be "
                             "offloaded to disk)")

    def update_dtype(self, dtype):
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ValueError("checkpoint_files: expected the checkpoint's *.safetensors files, got none")
        directory = Path(checkpoint_files[0]).parent
        config = read_quantization_config(directory)
        headers = _headers(checkpoint_files)
        found = fp4_modules(model, headers, config)
        experts = fp4_experts(model, headers, config)
        check_expert_activations(experts, self.quantization_config.activations)
        if not found and not experts and any(k.endswith((".weight_packed", "_blocks", ".weight_scale"))
                                             for k in headers):
            raise ValueError(f"{directory}: FP4 tensors in the checkpoint match no nn.Linear or MoE experts of "
                             f"{type(model).__name__} (are its key names those of the model's modules?)")
        placeholders = {}
        for name, key, scheme in found:
            placeholders[name] = _Placeholder(model.get_submodule(name), key, headers, layer_keys(headers, key))
            placeholders[name].scheme = scheme
        for name, key, convention in experts:
            module = model.get_submodule(name)
            used, missing = expert_keys(headers, key, convention, module)
            # Refused before anything is read, under the checkpoint's names: transformers would report an unknown
            # one after reading everything, a per-expert one under its converter's name for it
            # ("experts.4.gate_proj.weight_packed" as "experts.gate_up_proj_packed").
            taken = set(used)
            extra = [k for k in headers if k.startswith(key + ".") and k not in taken]
            if missing or extra:
                check_agreement(missing, extra, f"the {convention} experts at {key}")
            placeholders[name] = _Placeholder(module, key, headers, used, expert_bias_dtypes(key, convention, module))
            placeholders[name].convention = convention
        for name, placeholder in placeholders.items():
            _replace(model, name, placeholder)
        self.fp4_module_names = [name for name, _, _ in found]
        self.fp4_expert_names = [name for name, _, _ in experts]
        self.checkpoint_fmt = config.fmt
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        activations = self.quantization_config.activations
        layout = self.quantization_config.scale_layout
        for name in self.fp4_module_names + self.fp4_expert_names:
            placeholder = model.get_submodule(name)
            if not isinstance(placeholder, _Placeholder):
                raise TypeError(f"{name}: expected the loading placeholder, got {type(placeholder).__name__}")
            tensors, key = placeholder.loaded(), placeholder.key
            if name in self.fp4_expert_names:
                new = read_experts(tensors, key, placeholder.convention, placeholder.replaced, self.checkpoint_fmt,
                                   scale_layout=EXPERT_SCALE_LAYOUT)
            else:
                new = FP4Linear.from_state_dict(tensors, key, activations=activations or placeholder.scheme,
                                                scale_layout=layout)
                check_replacement(key, placeholder.replaced, new, self.checkpoint_fmt)
            _replace(model, name, new)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # the FP4 tensors are loaded as stored; nothing is quantized while loading

    def is_serializable(self, *args, **kwargs) -> bool:
        # transformers asks only in save_pretrained, which would write FP4Linear's state dict under this
        # quantizer's config: neither records the format nor each layer's activation mode.  Refusing here
        # gives the reason and what to call instead (transformers' own message sends the user to the logs).
        raise ValueError("save_pretrained: a model loaded by fp4gemv is written with fp4gemv.nn.save_compressed_tensors "
                         "(NVFP4), save_modelopt (NVFP4) or save_mxfp4 (MXFP4), each passed config=model.config; "
                         "transformers' save_pretrained would write a checkpoint no loader reads back")

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True  # FP4Linear traces without graph breaks (torch.library ops)


def _register() -> None:
    """Register the config and the quantizer once (importing this module twice changes nothing)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not FP4GemvConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(FP4GemvConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not FP4GemvHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(FP4GemvHfQuantizer)
    for method in FP4GEMV_ONLY_METHODS:
        if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:  # a transformers that knows it keeps its own
            register_quantization_config(method)(_ReadByFP4Gemv)
    merge = AutoHfQuantizer.merge_quantization_configs
    if getattr(merge, "_fp4gemv_keeps_its_config", False):
        return
    transformers_merge = merge.__func__

    def merge_quantization_configs(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, FP4GemvConfig):
            return quantization_config_from_args  # fp4gemv reads the checkpoint's own config itself
        return transformers_merge(cls, quantization_config, quantization_config_from_args)

    merge_quantization_configs._fp4gemv_keeps_its_config = True
    AutoHfQuantizer.merge_quantization_configs = classmethod(merge_quantization_configs)


_register()
