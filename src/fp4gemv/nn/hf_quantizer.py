"""fp4gemv as a Hugging Face transformers quantizer (``quant_method`` ``"fp4gemv"``).

Importing this module registers :class:`FP4GemvConfig` and :class:`FP4GemvHfQuantizer` with transformers'
quantizer registry (``transformers.quantizers.register_quantization_config`` / ``register_quantizer``), so::

    from transformers import AutoModelForCausalLM
    from fp4gemv.nn.hf_quantizer import FP4GemvConfig

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=FP4GemvConfig(), device_map="cuda")

loads a checkpoint in any convention ``fp4gemv.nn.load_quantized`` reads (compressed-tensors
``nvfp4-pack-quantized``, NVIDIA ModelOpt NVFP4, gpt-oss MXFP4) with its FP4 layers as ``FP4Linear``.
``fp4gemv.nn.from_pretrained`` is the same call.

How: transformers builds the model on the meta device; before weights load, every ``nn.Linear`` the
checkpoint holds in FP4 (``fp4gemv.nn.model.fp4_modules``: key names checked against the quantization
config) becomes a placeholder whose buffers carry the checkpoint's own names, shapes and dtypes (read from
the safetensors headers), so transformers' loader reads those tensors as they are stored straight onto the
target device; float tensors load as usual.  After loading, each placeholder becomes an ``FP4Linear`` made
of views of those buffers (``FP4Linear.from_state_dict``; ``scale_layout="swizzled"`` re-lays the block scales,
one layer at a time).  No float copy of an FP4 layer is ever made.

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
from .model import FP4GEMV_ONLY_METHODS, check_replacement, fp4_modules, read_quantization_config

__all__ = ["FP4GemvConfig", "FP4GemvHfQuantizer", "QUANT_METHOD", "TESTED_TRANSFORMERS"]

QUANT_METHOD = "fp4gemv"
# The transformers releases the tests ran with (pyproject's ``transformers`` extra pins the same range).
TESTED_TRANSFORMERS = ("5.17", "5.18")

class FP4GemvConfig(QuantizationConfigMixin):
    """What ``from_pretrained`` does with a checkpoint's FP4 layers.

    activations: None follows the checkpoint (W4A4 where it has a static input scale or its config says
        so, else weight-only); ``"weight-only"`` or ``"w4a4"`` overrides it.
    scale_layout: ``"swizzled"`` (the layout the kernels are tuned on; re-lays the stored block scales) or
        None / ``"linear"`` (keeps them as stored: no copy).
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


class _CheckpointLayer(nn.Module):
    """Stands for one FP4 layer while transformers loads: meta buffers named, shaped and typed as the
    checkpoint stores them, filled by the loader; never called."""

    def __init__(self, linear: nn.Linear, key: str, scheme: str, headers: dict[str, tuple[list[int], str]],
                 keys: list[str]) -> None:
        super().__init__()
        self.__dict__["linear"] = linear  # the meta nn.Linear it replaces, for the shape check; not a submodule
        self.key, self.scheme = key, scheme
        for full_key in keys:
            shape, dtype_name = headers[full_key]
            if dtype_name not in SAFETENSORS_DTYPES:
                raise TypeError(f"{full_key}: expected a dtype among {sorted(SAFETENSORS_DTYPES)}, got {dtype_name}")
            self.register_buffer(full_key[len(key) + 1:], torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype_name],
                                                                      device="meta"))

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.key}: FP4 layer still a loading placeholder (the quantizer's postprocess did "
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
        if not found and any(k.endswith((".weight_packed", ".weight_blocks", ".weight_scale")) for k in headers):
            raise ValueError(f"{directory}: FP4 tensors in the checkpoint match no nn.Linear of "
                             f"{type(model).__name__} (are its key names those of the model's modules?)")
        for name, key, scheme in found:
            linear = model.get_submodule(name)
            _replace(model, name, _CheckpointLayer(linear, key, scheme, headers, layer_keys(headers, key)))
        self.fp4_module_names = [name for name, _, _ in found]
        self.checkpoint_fmt = config.fmt
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        activations = self.quantization_config.activations
        layout = self.quantization_config.scale_layout
        for name in self.fp4_module_names:
            placeholder = model.get_submodule(name)
            if not isinstance(placeholder, _CheckpointLayer):
                raise TypeError(f"{name}: expected the loading placeholder, got {type(placeholder).__name__}")
            meta = [n for n, b in placeholder.named_buffers() if b.is_meta]
            if meta:
                raise ValueError(f"{placeholder.key}: checkpoint tensors {meta} were not loaded")
            tensors = {f"{placeholder.key}.{n}": b for n, b in placeholder.named_buffers()}
            new = FP4Linear.from_state_dict(tensors, placeholder.key, activations=activations or placeholder.scheme,
                                            scale_layout=layout)
            check_replacement(placeholder.key, placeholder.linear, new, self.checkpoint_fmt)
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
