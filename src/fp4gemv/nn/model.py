"""Whole models: quantize a float model's ``nn.Linear`` modules, load and save quantized checkpoints.

A checkpoint directory holds ``*.safetensors`` files and a quantization config, read from
``hf_quant_config.json`` (NVIDIA ModelOpt's nested form) or else ``config.json``'s ``quantization_config``
with ``quant_method``:

* ``"compressed-tensors"``: ``config_groups`` (``targets``: module names, ``"re:"`` regexes matched from the
  start of the name, or class names such as ``"Linear"``), ``weights`` (4-bit float, group size 16),
  ``input_activations`` (None: weight-only; 4-bit float: W4A4), ``format`` ``"nvfp4-pack-quantized"``, and
  ``ignore`` with the same matching (vllm-project/compressed-tensors, ``src/compressed_tensors/utils/match.py``,
  ``match_name``, ``is_match``);
* ``"modelopt"``: ``quant_algo`` ``"NVFP4"`` (W4A4) or ``"W4A16_NVFP4"``, ``group_size`` 16, and
  ``exclude_modules`` (or ``ignore``) of wildcard patterns (``*`` matches anything) matched against the
  whole module name, as vllm-project/vllm's ``vllm/model_executor/layers/quantization/modelopt.py`` does;
* ``"mxfp4"`` (gpt-oss): ``modules_to_not_convert``, each a regex matched from the start of the name, a
  dotted prefix of it, or a suffix of it (huggingface/transformers,
  ``src/transformers/quantizers/quantizers_utils.py``, ``should_convert_module``), its FP4 linear layers in
  the gpt-oss names (``weight_blocks``, ``weight_scales``);
* ``"fp4gemv-mxfp4"`` (:data:`MXFP4_METHOD`, what :func:`save_mxfp4` writes): ``"mxfp4"``'s rules, its
  layers in FP4Linear's own names (``weight``, ``weight_scale`` in e8m0), a method transformers does not
  know, so that plain transformers refuses the checkpoint (docs/checkpoints.md).

Which layers are FP4 is read from the tensors' key names (``checkpoints.detect_convention``) and checked
against the config: a disagreement is an error, never a silent float layer.

MoE experts modules (transformers' ``GptOssExperts``, ``Qwen3MoeExperts``: ``moe.expert_kind``) held in FP4
become ``FP4Experts`` (:func:`fp4_experts`, :func:`read_experts`): gpt-oss's fused ``<experts>.gate_up_proj_blocks``
... (``"mxfp4"``; the config's rules apply to the experts module's name, as transformers' ``mxfp4`` quantizer
applies them), or one NVFP4 linear layer per expert, ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``
(compressed-tensors or ModelOpt; the rules apply to each layer's name, a ``Linear`` for compressed-tensors'
class targets).  Experts run weight-only: a stored input scale is read and dropped.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoints import (LAYER_KEYS, SafetensorsDirectory, detect_convention, layer_keys, layer_tensors,
                          write_safetensors)
from .linear import ACTIVATIONS, FP4Linear, per_tensor_scale
from .moe import (EXPERT_SCALE_LAYOUT, GPT_OSS_ALPHA, GPT_OSS_LIMIT, FP4Experts, expert_kind, gpt_oss_experts,
                  nvfp4_experts, quantize_experts)

__all__ = [
    "QuantizationConfig",
    "read_quantization_config",
    "quantize_model",
    "calibrate_input_scales",
    "load_quantized",
    "fp4_modules",
    "check_replacement",
    "fp4_experts",
    "expert_convention",
    "expert_keys",
    "read_experts",
    "check_expert_activations",
    "check_agreement",
    "save_compressed_tensors",
    "save_modelopt",
    "save_mxfp4",
    "MXFP4_METHOD",
    "FP4GEMV_ONLY_METHODS",
]

# The tensor naming conventions (checkpoints.CONVENTIONS) a quant_method's linear layers may use, and its format.
MXFP4_METHOD = "fp4gemv-mxfp4"
_CONVENTIONS_OF_METHOD = {"compressed-tensors": ("compressed-tensors",), "modelopt": ("modelopt",),
                          "mxfp4": ("gpt-oss",), MXFP4_METHOD: ("modelopt",)}
_FORMAT_OF_METHOD = {"compressed-tensors": "nvfp4", "modelopt": "nvfp4", "mxfp4": "mxfp4", MXFP4_METHOD: "mxfp4"}
# The quant_methods read here that transformers 5.17 does not know (it would skip their config with a warning).
FP4GEMV_ONLY_METHODS = ("modelopt", MXFP4_METHOD)


# --- from a float model -----------------------------------------------------------------------------------


def _skipped(name: str, patterns: Iterable[str]) -> bool:
    """A module name equal to a pattern, matching it as a glob (``*``, ``?``), or under a listed module."""
    return any(name == p or fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _float_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise TypeError("model: expected a module containing nn.Linear modules, got an nn.Linear itself "
                        "(FP4Linear.from_linear converts one)")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(
    model: nn.Module,
    fmt: str = "nvfp4",
    *,
    activations: str = "weight-only",
    skip: Iterable[str] = (),
    scale_layout: str = "swizzled",
    per_tensor: str = "pow2",
) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by ``FP4Linear.from_linear``, and every MoE experts
    module (transformers' ``GptOssExperts``, ``Qwen3MoeExperts`` and look-alikes: ``moe.expert_kind``) by
    ``moe.quantize_experts``' ``FP4Experts``; returns their names.

    skip: module names or glob patterns (``"*.lm_head"``, ``"*.experts"``) left in float, with everything
    under them.  scale_layout: the FP4Linear layers' block scales; experts get ``moe.EXPERT_SCALE_LAYOUT``.
    Raises ValueError naming a module whose in_features (an expert's hidden or intermediate size) is not a
    multiple of the block size, or experts with ``activations="w4a4"`` (FP4Experts run weight-only): skip it.
    W4A4 modules pick their activation scale per call until ``calibrate_input_scales`` gives them one.
    """
    skip = [skip] if isinstance(skip, str) else list(skip)
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected 'weight-only' or 'w4a4', got {activations!r}")
    todo = [(n, m) for n, m in _float_linears(model) if not _skipped(n, skip)]
    experts = [(n, m) for n, m in model.named_modules() if expert_kind(m) is not None and not _skipped(n, skip)]
    block = 16 if fmt == "nvfp4" else 32
    for name, linear in todo:
        if linear.in_features % block:
            raise ValueError(f"{name}: in_features {linear.in_features} is not a multiple of the {fmt} block size "
                             f"{block}; pass skip=[{name!r}]")
    for name, module in experts:
        if activations == "w4a4":
            raise ValueError(f"{name}: MoE experts run weight-only (FP4Experts), got activations='w4a4'; pass "
                             f"skip=[{name!r}] or activations='weight-only'")
        # down_proj holds both sizes: the K of gate_up (hidden) and of down (intermediate).
        sizes = {d for d in module.down_proj.shape[1:]}
        if any(size % block for size in sizes):
            raise ValueError(f"{name}: hidden and intermediate sizes {sorted(sizes)} are not multiples of the {fmt} "
                             f"block size {block}; pass skip=[{name!r}]")
    for name, linear in todo:
        _replace(model, name, FP4Linear.from_linear(linear, fmt, activations=activations, scale_layout=scale_layout,
                                                    per_tensor=per_tensor))
    for name, module in experts:
        _replace(model, name, quantize_experts(module, fmt, EXPERT_SCALE_LAYOUT, per_tensor=per_tensor))
    return [name for name, _ in todo] + [name for name, _ in experts]


@torch.no_grad()
def calibrate_input_scales(model: nn.Module, run: Callable[[], Any], per_tensor: str = "pow2") -> dict[str, float]:
    """Give every NVFP4 W4A4 ``FP4Linear`` a static activation scale from the inputs seen while ``run()`` runs.

    The scale is :func:`per_tensor_scale` of the largest input magnitude over all calls (ModelOpt's
    ``amax / (6 * 448)``, rounded up to a power of two by default), stored as ``input_scale`` (a
    multiplier; it replaces any stored scale).  While ``run()`` runs, these modules take their activations
    unquantized (the weights stay FP4), as ModelOpt's max calibration collects statistics with quantization
    disabled (NVIDIA/Model-Optimizer, ``modelopt/torch/quantization/model_calib.py``,
    ``enable_stats_collection``).  Returns the
    scales by module name; a module ``run()`` never calls is an error (ValueError).
    """
    targets = {n: m for n, m in model.named_modules()
               if isinstance(m, FP4Linear) and m.activations == "w4a4" and m.fmt == "nvfp4"}
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            seen = args[0].detach().abs().amax().to(torch.float32)
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets.items()]
    for module in targets.values():
        module.activations = "weight-only"
    try:
        run()
    finally:
        for module in targets.values():
            module.activations = "w4a4"
        for h in handles:
            h.remove()
    scales = {}
    for name, module in targets.items():
        if name not in amax:
            raise ValueError(f"{name}: run() did not call this W4A4 module, so it has no activation range")
        module.set_input_scale(per_tensor_scale(amax[name], per_tensor))
        scales[name] = float(module.input_scale)
    return scales


# --- quantization configs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizationConfig:
    """What a checkpoint's config says: its ``method`` (``"compressed-tensors"``, ``"modelopt"``,
    ``"mxfp4"``, ``"fp4gemv-mxfp4"``) and, per module, its activations (:meth:`scheme`)."""

    method: str
    raw: dict

    @property
    def conventions(self) -> tuple[str, ...]:
        """The tensor naming conventions (``checkpoints.CONVENTIONS``) its FP4 layers may use."""
        return _CONVENTIONS_OF_METHOD[self.method]

    @property
    def fmt(self) -> str:
        """The FP4 format of its layers: ``"nvfp4"`` or ``"mxfp4"``."""
        return _FORMAT_OF_METHOD[self.method]

    def scheme(self, name: str, module: nn.Module) -> str | None:
        """``"weight-only"`` or ``"w4a4"`` for a quantized module, None for one the config leaves in float."""
        if self.method == "modelopt":
            q = self.raw
            excluded = list(q.get("exclude_modules") or []) + list(q.get("ignore") or [])
            if any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), name) for p in excluded):
                return None
            return "w4a4" if q["quant_algo"] == "NVFP4" else "weight-only"
        if self.method in ("mxfp4", MXFP4_METHOD):
            for p in self.raw.get("modules_to_not_convert") or []:
                if re.match(f"{p}\\.", name) or re.match(p, name) or name.endswith(p):
                    return None
            return "weight-only"
        if _ct_match(name, module, self.raw.get("ignore") or []):
            return None
        for group_name, group in (self.raw.get("config_groups") or {}).items():
            if _ct_match(name, module, group.get("targets") or []):
                _check_ct_group(group_name, group, self.raw.get("format"))
                return "weight-only" if group.get("input_activations") is None else "w4a4"
        return None


def _ct_match(name: str, module: nn.Module, targets: Iterable[str]) -> bool:
    for target in targets:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target == name or target == type(module).__name__:
            return True
    return False


def _check_ct_group(group_name: str, group: dict, top_format: str | None) -> None:
    fmt = group.get("format") or top_format
    if fmt != "nvfp4-pack-quantized":
        raise ValueError(f"config_groups.{group_name}.format: expected 'nvfp4-pack-quantized', got {fmt!r}")
    for part in ("weights", "input_activations"):
        args = group.get(part)
        if args is None:
            if part == "weights":
                raise ValueError(f"config_groups.{group_name}.weights: expected NVFP4 weight arguments, got None")
            continue
        got = (args.get("num_bits"), args.get("type"), args.get("group_size"))
        if got != (4, "float", 16):
            raise ValueError(f"config_groups.{group_name}.{part}: expected num_bits 4, type 'float', group_size 16 "
                             f"(NVFP4), got {got}")


def read_quantization_config(directory: str | Path) -> QuantizationConfig:
    """The quantization config of a checkpoint directory (see this module's docstring for the forms read)."""
    directory = Path(directory)
    hf_quant = directory / "hf_quant_config.json"
    if hf_quant.exists():
        raw = json.loads(hf_quant.read_text())
        if "quantization" not in raw or "quant_algo" not in raw["quantization"]:
            raise ValueError(f"{hf_quant}: expected a 'quantization' object with 'quant_algo'")
        return _modelopt_config(hf_quant, raw["quantization"])
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ValueError(f"directory: expected hf_quant_config.json or config.json in {directory}, found neither")
    q = json.loads(config_path.read_text()).get("quantization_config")
    if not isinstance(q, dict):
        raise ValueError(f"{config_path}: expected a 'quantization_config' object")
    method = q.get("quant_method")
    if method == "modelopt":
        return _modelopt_config(config_path, q)
    if method in ("compressed-tensors", "mxfp4", MXFP4_METHOD):
        return QuantizationConfig(method, q)
    raise ValueError(f"{config_path}: quantization_config.quant_method: expected 'compressed-tensors', 'modelopt', "
                     f"'mxfp4' or {MXFP4_METHOD!r}, got {method!r}")


def _modelopt_config(path: Path, q: dict) -> QuantizationConfig:
    algo = q.get("quant_algo")
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise ValueError(f"{path}: quant_algo: expected 'NVFP4' or 'W4A16_NVFP4', got {algo!r}")
    if q.get("group_size", 16) != 16:
        raise ValueError(f"{path}: group_size: expected 16 (NVFP4), got {q.get('group_size')!r}")
    return QuantizationConfig("modelopt", q)


# --- loading ----------------------------------------------------------------------------------------------


def fp4_modules(model: nn.Module, keys: Container[str], config: QuantizationConfig,
                prefix: str = "") -> list[tuple[str, str, str]]:
    """The ``nn.Linear`` modules of ``model`` that the checkpoint holds in FP4: (module name, checkpoint key,
    scheme) with scheme ``"weight-only"`` or ``"w4a4"`` as the config says.  ``keys``: the checkpoint's
    tensor names (a mapping or a set); ``prefix`` is prepended to module names to form them.  Raises
    ValueError where the tensors and the config disagree (never a silent float layer)."""
    found = []
    for name, module in _float_linears(model):
        key = prefix + name
        convention = detect_convention(keys, key)
        scheme = config.scheme(key, module)  # the config names modules as the checkpoint does
        if convention is None:
            if scheme is not None:
                raise ValueError(f"{key}: the {config.method} config quantizes this module but the checkpoint "
                                 f"has no FP4 tensors for it")
            continue
        if scheme is None:
            raise ValueError(f"{key}: the checkpoint has {convention} FP4 tensors but the {config.method} config "
                             f"leaves this module in float")
        if convention not in config.conventions:
            raise ValueError(f"{key}: expected {' or '.join(config.conventions)} tensors for quant_method "
                             f"{config.method!r}, got {convention} key names")
        found.append((name, key, scheme))
    return found


def check_replacement(key: str, linear: nn.Linear, new: FP4Linear, fmt: str) -> None:
    """Raise ValueError unless the FP4 layer read at ``key`` has the shape and bias of the Linear it replaces
    and the format ``fmt`` its config declares."""
    if new.fmt != fmt:
        raise ValueError(f"{key}.weight_scale: expected {fmt} block scales as the quantization config says, got "
                         f"{new.fmt}")
    if (new.in_features, new.out_features) != (linear.in_features, linear.out_features):
        raise ValueError(f"{key}: expected [out, in] = [{linear.out_features}, {linear.in_features}] like the "
                         f"model's Linear, got [{new.out_features}, {new.in_features}]")
    if (new.bias is None) != (linear.bias is None):
        raise ValueError(f"{key}.bias: expected {'a' if linear.bias is not None else 'no'} bias like the "
                         f"model's Linear")


# gpt-oss's fused expert tensors (moe.gpt_oss_experts), and the layers of per-expert checkpoints
# (moe.nvfp4_experts) with the keys each of their conventions needs (the rest of checkpoints.LAYER_KEYS may be there).
GPT_OSS_EXPERT_KEYS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                       "down_proj_scales", "down_proj_bias")
PER_EXPERT_LAYERS = ("gate_proj", "up_proj", "down_proj")
_REQUIRED_LAYER_KEYS = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
                        "modelopt": ("weight", "weight_scale")}


def expert_convention(keys: Container[str], key: str) -> str | None:
    """How the checkpoint (tensor names ``keys``) holds the experts at ``key`` in FP4, by the names alone:
    ``"gpt-oss"`` (fused ``<key>.gate_up_proj_blocks`` ...), ``"compressed-tensors"`` or ``"modelopt"`` (one NVFP4
    linear layer per expert: the convention of ``<key>.0.gate_proj``, ``up_proj`` or ``down_proj``), or None (no
    FP4 tensors there)."""
    if any(f"{key}.{name}" in keys for name in GPT_OSS_EXPERT_KEYS if not name.endswith("_bias")):
        return "gpt-oss"
    for name in PER_EXPERT_LAYERS:
        convention = detect_convention(keys, f"{key}.0.{name}")
        if convention in _REQUIRED_LAYER_KEYS:
            return convention
    return None


def _expert_layers(key: str, module: nn.Module) -> list[str]:
    """The per-expert linear layers' names of the experts ``module`` at ``key``."""
    return [f"{key}.{e}.{name}" for e in range(module.down_proj.shape[0]) for name in PER_EXPERT_LAYERS]


def fp4_experts(model: nn.Module, keys: Container[str], config: QuantizationConfig,
                prefix: str = "") -> list[tuple[str, str, str]]:
    """The MoE experts modules of ``model`` (``moe.expert_kind``) that the checkpoint holds in FP4: (module name,
    checkpoint key, :func:`expert_convention`).  Experts without FP4 tensors are left to load as float tensors.
    Raises ValueError where the tensors, the module and the config disagree (never a silent float layer)."""
    found, linear = [], None
    for name, module in model.named_modules():
        kind = expert_kind(module)
        key = prefix + name
        convention = None if kind is None else expert_convention(keys, key)
        if convention is None:
            continue
        if (convention == "gpt-oss") != (kind == "gpt-oss"):
            want = "gpt-oss's fused blocks" if kind == "gpt-oss" else "one NVFP4 linear layer per expert"
            raise ValueError(f"{key}: expected {want} for {type(module).__name__}, got {convention} expert tensors")
        if convention not in config.conventions:
            raise ValueError(f"{key}: expected {' or '.join(config.conventions)} tensors for quant_method "
                             f"{config.method!r}, got {convention} key names")
        if convention == "gpt-oss":
            layers = {key: module}
        else:  # the config names the checkpoint's layers, each an nn.Linear where it was written
            if linear is None:
                linear = nn.Linear(1, 1, device="meta")
            layers = {layer: linear for layer in _expert_layers(key, module)}
        in_float = [layer for layer, m in layers.items() if config.scheme(layer, m) is None]
        if in_float:
            raise ValueError(f"{in_float[0]}: the checkpoint has {convention} FP4 tensors but the {config.method} "
                             f"config leaves this module in float")
        found.append((name, key, convention))
    return found


def expert_keys(keys: Container[str], key: str, convention: str, module: nn.Module) -> tuple[list[str], list[str]]:
    """The checkpoint keys the experts at ``key`` are read from (those present) and the ones they need that
    ``keys`` lacks.  Per-expert layers' biases are not read: SiLU experts have none (a stored one is left over)."""
    if convention == "gpt-oss":
        wanted = [f"{key}.{name}" for name in GPT_OSS_EXPERT_KEYS]
        return [k for k in wanted if k in keys], [k for k in wanted if k not in keys]
    used, missing = [], []
    for layer in _expert_layers(key, module):
        found = detect_convention(keys, layer)
        if found not in (None, convention):
            raise ValueError(f"{layer}: expected {convention} tensors like {key}.0, got {found} key names")
        missing += [f"{layer}.{name}" for name in _REQUIRED_LAYER_KEYS[convention] if f"{layer}.{name}" not in keys]
        used += [f"{layer}.{name}" for name in LAYER_KEYS[convention] if name != "bias" and f"{layer}.{name}" in keys]
    return used, missing


def expert_bias_dtypes(key: str, convention: str, module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each stored bias of the experts at ``key`` is loaded in: that of the float module's bias (the
    model's dtype), as transformers loads every float tensor."""
    if convention != "gpt-oss":
        return {}
    return {f"{key}.{p}_bias": getattr(module, f"{p}_bias").dtype for p in ("gate_up_proj", "down_proj")}


def read_experts(tensors, key: str, convention: str, module: nn.Module, fmt: str, *,
                 scale_layout: str | None = None, device: torch.device | str | None = None) -> FP4Experts:
    """The ``FP4Experts`` of the experts at ``key`` (:func:`fp4_experts`' convention) in place of ``module``, the
    float experts module: its biases' dtype (:func:`expert_bias_dtypes`), gpt-oss's ``alpha`` and ``limit``, its
    shapes checked, and the format ``fmt`` the config declares (ValueError).  tensors: a mapping from key to
    tensor; the FP4 bytes are used as stored (``device`` moves them); scale_layout: None keeps the stored
    (linear) scales, ``"swizzled"``."""
    used, missing = expert_keys(tensors, key, convention, module)
    if missing:
        check_agreement(missing, [], f"the {convention} experts at {key}")
    dtypes = expert_bias_dtypes(key, convention, module)
    stored = {k: tensors[k].to(dtypes[k]) if k in dtypes else tensors[k] for k in used}
    layout = scale_layout or "linear"
    if convention == "gpt-oss":
        new = gpt_oss_experts(stored, key, device=device, alpha=float(getattr(module, "alpha", GPT_OSS_ALPHA)),
                              limit=float(getattr(module, "limit", GPT_OSS_LIMIT)), scale_layout=layout)
    else:
        new = nvfp4_experts(stored, key, module.down_proj.shape[0], device=device, scale_layout=layout)
    if new.projection("down").weight.fmt.name != fmt:
        raise ValueError(f"{key}: expected {fmt} experts as the quantization config says, got "
                         f"{new.projection('down').weight.fmt.name}")
    kind = expert_kind(module)
    experts, a, b = module.down_proj.shape  # gpt-oss: [E, I, H] (transposed); Qwen3-MoE: [E, H, I]
    want = (experts, b, a) if kind == "gpt-oss" else (experts, a, b)
    got = (new.num_experts, new.hidden_size, new.intermediate_size)
    if got != want:
        raise ValueError(f"{key}: expected [E, H, I] = {list(want)} like the model's {type(module).__name__}, got "
                         f"{list(got)}")
    return new


def check_expert_activations(found: list[tuple[str, str, str]], activations: str | None) -> None:
    """Raise ValueError for ``activations="w4a4"`` when the checkpoint has FP4 experts (they run weight-only)."""
    if activations == "w4a4" and found:
        raise ValueError(f"{found[0][1]}: MoE experts run weight-only (FP4Experts), got activations='w4a4'; pass "
                         f"activations=None (W4A4 where the checkpoint says so, experts weight-only)")


def load_quantized(
    model: nn.Module,
    directory: str | Path,
    *,
    prefix: str = "",
    activations: str | None = None,
    scale_layout: str | None = None,
    strict: bool = True,
) -> list[str]:
    """Load a quantized checkpoint directory into ``model``: its FP4 ``nn.Linear`` modules become ``FP4Linear``
    and its FP4 MoE experts modules ``FP4Experts`` (:func:`fp4_experts`; on the device of the module they
    replace, biases in its dtype), every other tensor is loaded with ``load_state_dict``.

    prefix: prepended to module names to form checkpoint keys (``"model."`` when the checkpoint was saved
        from a wrapper).  activations: None follows the config (and the layer's tensors); ``"weight-only"``
        or ``"w4a4"`` overrides it (experts run weight-only: ``"w4a4"`` with FP4 experts is a ValueError).
        scale_layout: the FP4Linear layers' block scales, None keeps the stored (linear) ones, ``"swizzled"``;
        experts get ``moe.EXPERT_SCALE_LAYOUT``.
    strict: raise ValueError when checkpoint tensors are left over or model tensors are missing (tensors an FP4
        layer or experts module needs are always required).
    Returns the names of the modules made FP4.
    """
    if activations is not None and activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected None, 'weight-only' or 'w4a4', got {activations!r}")
    config = read_quantization_config(directory)
    tensors = SafetensorsDirectory(directory)
    replaced, consumed = [], set()
    try:
        linears = fp4_modules(model, tensors, config, prefix)
        experts = fp4_experts(model, tensors, config, prefix)
        check_expert_activations(experts, activations)
        for name, key, scheme in linears:
            module = model.get_submodule(name)
            new = FP4Linear.from_state_dict(tensors, key, activations=activations or scheme, scale_layout=scale_layout,
                                     device=module.weight.device)
            check_replacement(key, module, new, config.fmt)
            _replace(model, name, new)
            replaced.append(name)
            consumed.update(layer_keys(tensors, key))
        for name, key, convention in experts:
            module = model.get_submodule(name)
            _replace(model, name, read_experts(tensors, key, convention, module, config.fmt,
                                               scale_layout=EXPERT_SCALE_LAYOUT, device=module.down_proj.device))
            replaced.append(name)
            consumed.update(expert_keys(tensors, key, convention, module)[0])
        rest, unexpected = {}, []
        for key in tensors:
            if key in consumed:
                continue
            if key.startswith(prefix):
                rest[key[len(prefix):]] = tensors[key]
            else:
                unexpected.append(key)
        result = model.load_state_dict(rest, strict=False)
    finally:
        tensors.close()
    fp4_prefixes = tuple(n + "." for n in replaced)
    missing = [k for k in result.missing_keys if not k.startswith(fp4_prefixes)]
    unexpected += [prefix + k for k in result.unexpected_keys]
    if strict:
        check_agreement(missing, unexpected, "strict=False loads anyway")
    return replaced


def check_agreement(missing: Iterable[str], unexpected: Iterable[str], hint: str) -> None:
    """Raise ValueError naming the model tensors a checkpoint lacks and the checkpoint tensors no module takes."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    if missing or unexpected:
        raise ValueError(f"directory: checkpoint and model disagree: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} ({hint})")


# --- saving -------------------------------------------------------------------------------------------------


def _checkpoint_tensors(model: nn.Module, convention: str, fmt: str
                        ) -> tuple[dict[str, torch.Tensor], list[str], set[str]]:
    """All tensors of ``model`` with its FP4Linear modules (all ``fmt``) in ``convention``; the float Linear
    names; the FP4 modules' activation modes."""
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    for name, module in model.named_modules():
        if isinstance(module, FP4Experts):  # its buffers' names are its own, read by no loader
            raise ValueError(f"{name}: FP4Experts are not written to checkpoints (no writer holds them yet); "
                             f"quantize_model(..., skip=[{name!r}]) keeps the experts in float")
    if not fp4:
        raise ValueError("model: expected FP4Linear modules (quantize_model or load_quantized makes them), found none")
    for name, module in fp4.items():
        if module.fmt != fmt:
            writer = "save_mxfp4" if module.fmt == "mxfp4" else "save_compressed_tensors or save_modelopt"
            raise ValueError(f"{name}: expected {fmt} modules in this checkpoint, got {module.fmt} ({writer} writes "
                             f"those)")
    prefixes = tuple(n + "." for n in fp4)
    tensors = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    for name, module in fp4.items():
        tensors.update(layer_tensors(module, convention, name))
    float_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return tensors, float_linears, {m.activations for m in fp4.values()}


def _write(directory: str | Path, tensors: dict[str, torch.Tensor], configs: dict[str, dict]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    for file_name, content in configs.items():
        (directory / file_name).write_text(json.dumps(content, indent=2) + "\n")
    return directory


def _config_json(model: nn.Module, config) -> dict:
    """config.json's content: ``config`` (a dict or a transformers config), else ``model.config``."""
    if config is None:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("config: expected the model's config for config.json (a dict or a transformers "
                             "PretrainedConfig), got none and model has no .config; config={} writes a checkpoint "
                             "that load_quantized reads but from_pretrained cannot build a model from")
    if callable(getattr(config, "to_dict", None)):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict or a transformers PretrainedConfig, got {type(config).__name__}")
    return config


def _one_mode(modes: set[str], method: str) -> str:
    if len(modes) != 1:
        raise ValueError(f"model: a {method} checkpoint written here holds one activation mode, got {sorted(modes)}")
    return next(iter(modes))


def save_compressed_tensors(model: nn.Module, directory: str | Path, config=None) -> Path:
    """Write ``model`` as a compressed-tensors ``nvfp4-pack-quantized`` checkpoint: ``model.safetensors`` and
    ``config.json`` (``config``, a dict or a transformers config, by default ``model.config``; ValueError when
    neither is there; plus ``quantization_config``).  Float ``nn.Linear``
    modules are listed in ``ignore``.  Every FP4Linear must be NVFP4 with one activation mode, and each
    multiplier must have an exact fp32 reciprocal (ValueError otherwise)."""
    tensors, float_linears, modes = _checkpoint_tensors(model, "compressed-tensors", "nvfp4")
    mode = _one_mode(modes, "compressed-tensors")
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
            "dynamic": False, "scale_dtype": "float8_e4m3fn"}
    group = {"targets": ["Linear"], "weights": args, "format": "nvfp4-pack-quantized",
             "input_activations": {**args, "dynamic": "local"} if mode == "w4a4" else None,
             "output_activations": None}
    quantization = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                    "quantization_status": "compressed", "config_groups": {"group_0": group},
                    "ignore": float_linears}
    return _write(directory, tensors, {"config.json": {**_config_json(model, config),
                                                       "quantization_config": quantization}})


def save_modelopt(model: nn.Module, directory: str | Path, config=None) -> Path:
    """Write ``model`` as an NVIDIA ModelOpt NVFP4 checkpoint: ``model.safetensors``, ``hf_quant_config.json``
    (``quant_algo`` ``"NVFP4"`` for W4A4, ``"W4A16_NVFP4"`` for weight-only; float Linear modules in
    ``exclude_modules``) and ``config.json`` (``config`` as :func:`save_compressed_tensors` takes it, plus the
    same as ``quantization_config``)."""
    tensors, float_linears, modes = _checkpoint_tensors(model, "modelopt", "nvfp4")
    algo = "NVFP4" if _one_mode(modes, "modelopt") == "w4a4" else "W4A16_NVFP4"
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                    "exclude_modules": float_linears}
    configs = {"hf_quant_config.json": {"producer": {"name": "fp4gemv"}, "quantization": quantization},
               "config.json": {**_config_json(model, config),
                               "quantization_config": {"quant_method": "modelopt", **quantization}}}
    return _write(directory, tensors, configs)


def save_mxfp4(model: nn.Module, directory: str | Path, config=None) -> Path:
    """Write ``model`` with its weight-only MXFP4 FP4Linear modules and ``config.json`` (``config`` as
    :func:`save_compressed_tensors` takes it) with ``quantization_config`` ``{"quant_method": "fp4gemv-mxfp4",
    "modules_to_not_convert": [float Linear names]}`` (gpt-oss's rules).

    Each layer is stored under FP4Linear's own names: ``weight`` uint8 ``[N, K/2]`` and ``weight_scale``
    float8_e8m0fnu ``[N, K/32]``, the bytes of gpt-oss's ``weight_blocks`` / ``weight_scales``.  Under gpt-oss's
    own ``"mxfp4"`` and names, transformers (which dequantizes them for GptOss experts only) would leave every
    linear layer at its random initial weights; under a method it does not know, it checks the shapes and
    refuses the packed ``weight`` (docs/checkpoints.md)."""
    tensors, float_linears, _ = _checkpoint_tensors(model, "modelopt", "mxfp4")
    # Entries are regexes matched from the start of a name (and as dotted prefixes): anchor them.
    quantization = {"quant_method": MXFP4_METHOD,
                    "modules_to_not_convert": [re.escape(n) + "$" for n in float_linears]}
    return _write(directory, tensors, {"config.json": {**_config_json(model, config),
                                                       "quantization_config": quantization}})
