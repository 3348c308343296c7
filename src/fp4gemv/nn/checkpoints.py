"""One FP4 linear layer in the checkpoint conventions people download, read and written without repacking.

Every convention below stores the packed weight as uint8 ``[N, K/2]`` (N = out_features, K = in_features)
with element 2j in the low nibble and 2j+1 in the high nibble, exactly ``FP4Tensor.data``, so loading views
the bytes as they are.  Keys are ``<prefix>.<name>``:

* compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4 / NVFP4A16 exports):
  ``weight_packed`` uint8 ``[N, K/2]`` (vllm-project/compressed-tensors,
  ``src/compressed_tensors/compressors/quantized_compressors/fp4_quantized.py``, ``pack_fp4_to_uint8``:
  ``indices[:, 0] | indices[:, 1] << 4``), ``weight_scale``
  float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` fp32 ``[1]``, **a divisor**: value =
  ``e2m1 * weight_scale / weight_global_scale`` (same repository,
  ``src/compressed_tensors/quantization/lifecycle/forward.py``: ``scale = scale / global_scale``; the recipe's
  ``generate_gparam`` in ``src/compressed_tensors/quantization/utils/helpers.py`` picks ``448 * 6 / amax``,
  and its block scales are ``e4m3(global_scale * amax_block / 6)``).  W4A4 adds
  ``input_global_scale`` fp32 ``[1]``, also a divisor: activations are quantized as ``x * g`` with dynamic
  e4m3 block scales (vllm-project/vllm, ``vllm/model_executor/layers/quantization/compressed_tensors/
  schemes/compressed_tensors_w4a4_nvfp4.py``: ``input_global_scale`` goes to the activation quantizer as
  the factor it multiplies x by, and the output is multiplied by ``1/input_global_scale *
  1/weight_global_scale``, each reciprocal in fp32).
* NVIDIA ModelOpt NVFP4 (``hf_quant_config.json`` ``quant_algo`` ``"NVFP4"`` or ``"W4A16_NVFP4"``):
  ``weight`` uint8 ``[N, K/2]`` (NVIDIA/Model-Optimizer, ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``:
  ``(q[..., 1::2] << 4) | q[..., 0::2]``), ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2``
  fp32 scalar, **a multiplier** (``amax / (6 * 448)``; value = ``e2m1 * weight_scale * weight_scale_2``),
  and for W4A4 ``input_scale`` fp32 scalar, a multiplier too (``amax / (6 * 448)``, same file,
  ``get_activation_scaling_factor``; vllm-project/vllm ``vllm/model_executor/layers/quantization/modelopt.py``
  quantizes x times ``1 / input_scale`` and multiplies the output by ``input_scale * weight_scale_2``).
  Here x's elements are divided in fp32 by the fp32 product of their block scale and ``input_scale``
  (``fp4gemv.quantize``, ModelOpt's ``NVFP4QTensor`` rule).
* gpt-oss MXFP4, one matrix (openai/gpt-oss, ``gpt_oss/torch/weights.py``, ``_get_mxfp4_tensor``): ``weight_blocks`` uint8
  ``[N, K/32, 16]`` (32 elements per 16 bytes, low nibble first: ``sub[:, 0::2] = lut[blk & 0x0F]``) and
  ``weight_scales`` uint8 ``[N, K/32]``, e8m0 with bias 127 (``ldexp(value, scales - 127)``).
* ``FP4Linear``'s own state dict: the ModelOpt names, with ``weight_scale`` in its float8 dtype (e4m3:
  NVFP4; e8m0: MXFP4) and linear ``[N, K/bs]`` or swizzled ``[R_p * C_p]``, and a divisor stored under the
  compressed-tensors names (``weight_global_scale``, ``input_global_scale``) when it came from one.

A divisor g becomes the fp32 multiplier ``fl32(1/g)`` (see ``fp4gemv.nn.linear``).  Writing a multiplier m
as a compressed-tensors divisor needs ``1/m`` exact in fp32 (m a power of two, as ``quantize_model``
picks by default); the writer refuses otherwise rather than change the values.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from .. import formats
from ..formats import dtype_name as _dtype_name

__all__ = [
    "CONVENTIONS",
    "LAYER_KEYS",
    "CheckpointLayer",
    "SAFETENSORS_DTYPES",
    "SafetensorsDirectory",
    "checkpoint_key",
    "detect_convention",
    "layer_keys",
    "read_layer",
    "layer_tensors",
    "write_safetensors",
]

CONVENTIONS: tuple[str, ...] = ("compressed-tensors", "modelopt", "gpt-oss")
LAYER_KEYS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                           "weight_zero_point", "weight_shape", "bias"),
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "weight_global_scale", "input_scale",
                 "input_global_scale", "bias"),
    "gpt-oss": ("weight_blocks", "weight_scales", "bias"),
}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# safetensors header dtype names (huggingface/safetensors, the format's "dtype" field) and their torch dtypes.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64,
}
# Where a tensor starts in a file fp4gemv writes: loaders (transformers, safe_open) map the file and use CPU
# tensors in place, and MKL's sgemm rounds differently on data that is not 16-byte aligned (measured with
# torch 2.13: F.linear of one token by a [96, 64] fp32 weight differs in the last bit at offsets 4..12 mod 16),
# so a model would compute differently from the same weights loaded into its own (aligned) memory.
ALIGNMENT = 64


def checkpoint_key(prefix: str, name: str) -> str:
    """The key of tensor ``name`` of the layer at ``prefix`` (``"<prefix>.<name>"``, ``name`` for no prefix)."""
    prefix = prefix.rstrip(".")
    return f"{prefix}.{name}" if prefix else name


def detect_convention(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> str | None:
    """``"compressed-tensors"``, ``"modelopt"`` (also FP4Linear's own state dict), ``"gpt-oss"`` or None
    (no FP4 layer at ``prefix``: a float ``weight`` alone is not one), by the key names alone."""
    if checkpoint_key(prefix, "weight_packed") in tensors:
        return "compressed-tensors"
    if checkpoint_key(prefix, "weight_blocks") in tensors:
        return "gpt-oss"
    if checkpoint_key(prefix, "weight") in tensors and checkpoint_key(prefix, "weight_scale") in tensors:
        return "modelopt"
    return None


def layer_keys(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> list[str]:
    """The keys the layer at ``prefix`` is made of (those present), for a loader to know what is left."""
    convention = detect_convention(tensors, prefix)
    if convention is None:
        return []
    return [checkpoint_key(prefix, name) for name in LAYER_KEYS[convention] if checkpoint_key(prefix, name) in tensors]


def _get(tensors: Mapping[str, torch.Tensor], prefix: str, name: str, required: bool = True) -> torch.Tensor | None:
    key = checkpoint_key(prefix, name)
    if key not in tensors:
        if required:
            raise KeyError(f"{key}: missing (the layer's other keys name its convention, which needs it)")
        return None
    t = tensors[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{key}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_dtype(key: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{key}: expected dtype {' or '.join(_dtype_name(d) for d in dtypes)}, got {_dtype_name(t.dtype)}")


def _per_tensor(tensors, prefix: str, name: str) -> torch.Tensor | None:
    """A per-tensor scale as a positive finite fp32 0-d tensor (bf16 / fp16 widen exactly), or None."""
    t = _get(tensors, prefix, name, required=False)
    if t is None:
        return None
    key = checkpoint_key(prefix, name)
    _check_dtype(key, t, _SCALE_DTYPES)
    if t.numel() != 1:
        raise ValueError(f"{key}: expected one value (a per-tensor scale), got shape {tuple(t.shape)}")
    t = t.reshape(()).to(torch.float32)
    value = float(t)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{key}: expected a positive finite scale, got {value}")
    return t


class CheckpointLayer(NamedTuple):
    """One FP4 layer as a checkpoint stores it, validated: the packed bytes and block scales (views, linear
    ``[N, K/bs]`` or swizzled), the format, the per-tensor scales by kind (None where absent) and the bias."""

    data: torch.Tensor
    scales: torch.Tensor
    fmt: str
    scale_layout: str
    weight_multiplier: torch.Tensor | None
    weight_divisor: torch.Tensor | None
    input_multiplier: torch.Tensor | None
    input_divisor: torch.Tensor | None
    bias: torch.Tensor | None


class _Stored(NamedTuple):
    """What one convention's reader found: the data (``[N, K/2]`` uint8) under ``data_key``, the scales under
    ``scale_key``, the format, and the per-tensor scales (multiplier / divisor, weight / input)."""

    data_key: str
    data: torch.Tensor
    scale_key: str
    scales: torch.Tensor
    fmt: str
    weight_multiplier: torch.Tensor | None = None
    weight_divisor: torch.Tensor | None = None
    input_multiplier: torch.Tensor | None = None
    input_divisor: torch.Tensor | None = None


def _read_compressed_tensors(tensors, prefix: str) -> _Stored:
    scale_key = checkpoint_key(prefix, "weight_scale")
    scales = _get(tensors, prefix, "weight_scale")
    _check_dtype(scale_key, scales, (torch.float8_e4m3fn, torch.uint8))
    weight_divisor = _per_tensor(tensors, prefix, "weight_global_scale")
    if weight_divisor is None:
        raise KeyError(f"{checkpoint_key(prefix, 'weight_global_scale')}: missing (compressed-tensors NVFP4 has one)")
    zero_point = _get(tensors, prefix, "weight_zero_point", required=False)
    if zero_point is not None and bool((zero_point != 0).any()):
        raise ValueError(f"{checkpoint_key(prefix, 'weight_zero_point')}: expected zeros (symmetric FP4), got nonzero "
                         f"values")
    return _Stored(checkpoint_key(prefix, "weight_packed"), _get(tensors, prefix, "weight_packed"), scale_key, scales,
                   "nvfp4", weight_divisor=weight_divisor,
                   input_divisor=_per_tensor(tensors, prefix, "input_global_scale"))


def _read_modelopt(tensors, prefix: str) -> _Stored:
    scale_key = checkpoint_key(prefix, "weight_scale")
    scales = _get(tensors, prefix, "weight_scale")
    _check_dtype(scale_key, scales, (torch.float8_e4m3fn, torch.float8_e8m0fnu))
    for multiplier, divisor in (("weight_scale_2", "weight_global_scale"), ("input_scale", "input_global_scale")):
        if checkpoint_key(prefix, multiplier) in tensors and checkpoint_key(prefix, divisor) in tensors:
            raise ValueError(f"{checkpoint_key(prefix, divisor)}: expected either {multiplier} (a multiplier) or "
                             f"{divisor} (a divisor), got both")
    return _Stored(checkpoint_key(prefix, "weight"), _get(tensors, prefix, "weight"), scale_key, scales,
                   "nvfp4" if scales.dtype == torch.float8_e4m3fn else "mxfp4",
                   weight_multiplier=_per_tensor(tensors, prefix, "weight_scale_2"),
                   weight_divisor=_per_tensor(tensors, prefix, "weight_global_scale"),
                   input_multiplier=_per_tensor(tensors, prefix, "input_scale"),
                   input_divisor=_per_tensor(tensors, prefix, "input_global_scale"))


def _read_gpt_oss(tensors, prefix: str) -> _Stored:
    blocks_key, scale_key = checkpoint_key(prefix, "weight_blocks"), checkpoint_key(prefix, "weight_scales")
    blocks = _get(tensors, prefix, "weight_blocks")
    scales = _get(tensors, prefix, "weight_scales")
    _check_dtype(blocks_key, blocks, (torch.uint8,))
    _check_dtype(scale_key, scales, (torch.uint8,))
    if blocks.dim() != 3 or blocks.shape[-1] != 16:
        raise ValueError(f"{blocks_key}: expected shape [N, K/32, 16] (16 bytes per 32-element block), "
                         f"got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ValueError(f"{scale_key}: expected shape {tuple(blocks.shape[:2])} (one e8m0 byte per block of "
                         f"{blocks_key}), got {tuple(scales.shape)}")
    return _Stored(blocks_key, blocks.reshape(blocks.shape[0], -1), scale_key, scales.view(torch.float8_e8m0fnu),
                   "mxfp4")


_READERS = {"compressed-tensors": _read_compressed_tensors, "modelopt": _read_modelopt, "gpt-oss": _read_gpt_oss}


def _checked_layer(stored: _Stored, tensors, prefix: str) -> CheckpointLayer:
    """The convention-independent checks (data, scale shape, weight_shape, bias) of what a reader found."""
    data_key, data, scales = stored.data_key, stored.data, stored.scales
    _check_dtype(data_key, data, (torch.uint8,))
    if data.dim() != 2 or min(data.shape) < 1:
        raise ValueError(f"{data_key}: expected shape [N, K/2] (uint8, two e2m1 codes per byte), got {tuple(data.shape)}")
    out_features, in_features = data.shape[0], 2 * data.shape[1]
    fmt = formats.FORMATS[stored.fmt]
    cols = in_features // fmt.block_size
    if in_features % fmt.block_size:
        raise ValueError(f"{data_key}: expected K = {in_features} a multiple of the {stored.fmt} block size "
                         f"{fmt.block_size}")
    if scales.dtype == torch.uint8:
        scales = scales.view(fmt.scale_dtype)
    scale_layout = "linear" if scales.dim() == 2 else "swizzled"
    if scale_layout == "linear" and tuple(scales.shape) != (out_features, cols):
        raise ValueError(f"{stored.scale_key}: expected shape ({out_features}, {cols}) = [N, K/{fmt.block_size}] "
                         f"for {data_key} of shape {tuple(data.shape)}, got {tuple(scales.shape)}")
    weight_shape = _get(tensors, prefix, "weight_shape", required=False)
    if weight_shape is not None and [int(v) for v in weight_shape.reshape(-1)] != [out_features, in_features]:
        raise ValueError(f"{checkpoint_key(prefix, 'weight_shape')}: expected [{out_features}, {in_features}] from "
                         f"{data_key}, got {[int(v) for v in weight_shape.reshape(-1)]}")
    bias = _get(tensors, prefix, "bias", required=False)
    if bias is not None:
        _check_dtype(checkpoint_key(prefix, "bias"), bias, (torch.float32, torch.bfloat16, torch.float16))
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"{checkpoint_key(prefix, 'bias')}: expected shape ({out_features},), got "
                             f"{tuple(bias.shape)}")
    return CheckpointLayer(data, scales, stored.fmt, scale_layout, stored.weight_multiplier, stored.weight_divisor,
                           stored.input_multiplier, stored.input_divisor, bias)


def read_layer(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> CheckpointLayer:
    """The FP4 layer at ``prefix`` in any of the conventions of this module (see its docstring), validated.

    The packed bytes and scales are the stored tensors (views, nothing repacked).  Raises KeyError (a missing
    key), TypeError / ValueError naming the key, the expected and the actual.
    """
    convention = detect_convention(tensors, prefix)
    if convention is None:
        near = (sorted(k for k in tensors if k.startswith(checkpoint_key(prefix, "")))[:8] if prefix
                else sorted(tensors)[:8])
        raise KeyError(
            f"{prefix or '<state dict>'}: no FP4 layer: expected {checkpoint_key(prefix, 'weight_packed')!r} "
            f"(compressed-tensors), {checkpoint_key(prefix, 'weight')!r} with "
            f"{checkpoint_key(prefix, 'weight_scale')!r} (ModelOpt / FP4Linear) or "
            f"{checkpoint_key(prefix, 'weight_blocks')!r} (gpt-oss MXFP4); found {near}"
        )
    return _checked_layer(_READERS[convention](tensors, prefix), tensors, prefix)


def _exact_reciprocal(value: torch.Tensor, what: str) -> torch.Tensor:
    """``1 / value`` in fp32 when it is exact (the product of two fp32 numbers is exact in float64)."""
    inverse = torch.reciprocal(value.to(torch.float32))
    if float(inverse.double() * value.double()) != 1.0:
        raise ValueError(
            f"{what}: {float(value)!r} has no exact fp32 reciprocal, so the other convention cannot hold the same "
            f"values (quantize with per_tensor='pow2' for scales exact in every convention)"
        )
    return inverse


def layer_tensors(module, convention: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The layer's tensors under ``convention``'s key names (see this module's docstring), linear scales.

    ``"compressed-tensors"`` holds NVFP4, ``"gpt-oss"`` MXFP4 without a per-tensor scale, ``"modelopt"`` (the
    ModelOpt names, FP4Linear's own) either: NVFP4 always with ``weight_scale_2``, MXFP4 with one where the
    module has a per-tensor scale.
    A static input scale is written for W4A4; W4A4 with a per-call scale has none to write (ValueError: run
    ``fp4gemv.nn.calibrate_input_scales`` first).  Values are kept exactly (ValueError otherwise).
    """
    if not callable(getattr(module, "quantized_weight", None)):
        raise TypeError(f"module: expected an FP4Linear, got {type(module).__name__}")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: expected one of {CONVENTIONS}, got {convention!r}")
    name = prefix or "<module>"
    want_fmts = {"gpt-oss": ("mxfp4",), "compressed-tensors": ("nvfp4",), "modelopt": ("nvfp4", "mxfp4")}[convention]
    if module.fmt not in want_fmts:
        raise ValueError(f"{name}: expected {' or '.join(want_fmts)} for a {convention} checkpoint, got {module.fmt}")
    if module.fmt == "mxfp4" and module.activations == "w4a4":
        # Such a module quantizes its activations with no static scale: nothing in a checkpoint says so.
        raise ValueError(f"{name}: MXFP4 checkpoints are weight-only, got activations='w4a4'")
    if module.activations == "w4a4" and module.input_scale_kind() is None:
        raise ValueError(f"{name}: W4A4 with a per-call activation scale has no static input scale to write; "
                         f"run fp4gemv.nn.calibrate_input_scales first")
    scales = module.quantized_weight().linear_scales()
    out: dict[str, torch.Tensor] = {}
    if convention == "gpt-oss":
        if module.weight_scale_kind() is not None and float(module.weight_multiplier()) != 1.0:
            raise ValueError(f"{name}: gpt-oss MXFP4 has no per-tensor scale, got {float(module.weight_multiplier())}")
        out["weight_blocks"] = module.checkpoint_weight().reshape(module.out_features, -1, 16)
        out["weight_scales"] = scales.view(torch.uint8)
    elif convention == "modelopt":
        out["weight"] = module.checkpoint_weight()
        out["weight_scale"] = scales.view(formats.FORMATS[module.fmt].scale_dtype)
        multiplier = module.weight_multiplier()
        if multiplier is not None or module.fmt == "nvfp4":
            out["weight_scale_2"] = torch.ones(()) if multiplier is None else multiplier.reshape(())
        if module.activations == "w4a4":
            out["input_scale"] = module.input_multiplier().reshape(())
    else:
        out["weight_packed"] = module.checkpoint_weight()
        out["weight_scale"] = scales.view(torch.float8_e4m3fn)
        kind = module.weight_scale_kind()
        if kind is None:
            divisor = torch.ones(())
        elif kind == "divisor":
            divisor = module.weight_global_scale
        else:
            divisor = _exact_reciprocal(module.weight_scale_2, f"{name}.weight_scale_2")
        out["weight_global_scale"] = divisor.reshape(1)
        if module.activations == "w4a4":
            if module.input_scale_kind() == "divisor":
                out["input_global_scale"] = module.input_global_scale.reshape(1)
            else:
                out["input_global_scale"] = _exact_reciprocal(module.input_scale, f"{name}.input_scale").reshape(1)
    if module.bias is not None:
        out["bias"] = module.bias.detach()
    return {checkpoint_key(prefix, k): v.detach().to(torch.float32) if v.dtype == torch.float64 else v.detach()
            for k, v in out.items()}


def _alignment_of(nbytes: int) -> int:
    """The largest power of two up to ALIGNMENT dividing ``nbytes`` (ALIGNMENT for 0)."""
    return ALIGNMENT if nbytes % ALIGNMENT == 0 else nbytes & -nbytes


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | Path,
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` as one safetensors file with every tensor at a file offset that is a multiple of
    ``ALIGNMENT`` (64 bytes) or of the largest power of two dividing its size, whichever is smaller.

    The format allows no gaps between tensors, so alignment comes from the order alone: the header is padded
    with spaces (as the format allows) to end on a 64-byte boundary, and tensors are laid out by decreasing
    alignment of their size (then by key), so that every tensor whose size is a multiple of 64 bytes, which
    includes every weight of a real model, starts on a 64-byte boundary.  Tensors sharing memory are written
    as separate copies.
    """
    if sys.byteorder != "little":
        raise RuntimeError(f"write_safetensors: safetensors stores little-endian data, this machine is "
                           f"{sys.byteorder}-endian")
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    data = {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{key}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in names:
            raise TypeError(f"{key}: expected a dtype among {sorted(_dtype_name(d) for d in names)}, got "
                            f"{_dtype_name(t.dtype)}")
        data[key] = t.detach().to("cpu").contiguous()
    order = sorted(data, key=lambda k: (-_alignment_of(data[k].numel() * data[k].element_size()), k))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = data[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGNMENT)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for key in order:
            t = data[key]
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return path


class SafetensorsDirectory(Mapping):
    """Every tensor of a directory's ``*.safetensors`` files as one read-only mapping, read on access.

    Uses ``safetensors.safe_open`` (the files are memory-mapped; a tensor is read when it is looked up, a slice
    of it by :meth:`get_slice`).
    Raises ValueError when there is no file, or a key is in two files.  ``close()`` releases the files.
    """

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"directory: expected *.safetensors files in {directory}, found none")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(f"{key}: in both {files[self._where[key]].name} and {files[i].name}")
                self._where[key] = i

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def get_slice(self, key: str):
        """safetensors' lazy slice of ``key``: ``.get_shape()``, ``.get_dtype()``, and ``[...]`` reads only the
        bytes of the requested ranges (how ``fp4gemv.nn.parallel`` loads one rank's shard)."""
        return self._handles[self._where[key]].get_slice(key)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._handles = []
        self._where = {}
