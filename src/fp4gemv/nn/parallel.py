"""Tensor-parallel ``FP4Linear`` over a ``torch.distributed`` process group, with Megatron-LM's and vLLM's names.

* :class:`ColumnParallelFP4Linear` splits the weight ``W [N, K]`` by rows (out_features): rank r of P holds
  rows ``[r N/P, (r+1) N/P)`` and computes that slice of ``y``; ``gather_output=True`` all-gathers the slices
  into every rank's ``[..., N]``, ``False`` leaves ``[..., N/P]`` (the input of a row-parallel layer).  Each
  rank adds its slice of the bias.
* :class:`RowParallelFP4Linear` splits W along K (in_features): rank r holds columns ``[r K/P, (r+1) K/P)``
  and multiplies them with that slice of x (``input_is_parallel=True``: x arrives split, ``[..., K/P]``;
  ``False``: x is whole and each rank takes its slice); the partial products are summed by an all-reduce,
  then the bias is added once, after the sum, on every rank.

Packed data, block scales and per-tensor scales shard together; a per-tensor (global) scale is the same
value on every rank.  Splits must be equal (N or K a multiple of P).  A K split must fall on scale-block
boundaries (K/P a multiple of the block size, 16 for NVFP4, 32 for MXFP4), and with swizzled scales on the
128x4 tiles' column boundaries (K/P/block a multiple of 4): a tile holds scales of four consecutive blocks,
and a shard made of whole tiles is exactly the tiles of the full tensor.  A row split of swizzled scales
keeps the bytes when it falls on 128-row tile boundaries and otherwise re-swizzles the shard's rows (once,
when the shard is made; the scales are 1/8 of the data's bytes for NVFP4).  An impossible split raises
ValueError naming the sizes.

Shards are made from a whole ``FP4Linear`` (``from_fp4linear``: copies, so the whole layer can be freed), or
read from a safetensors checkpoint in any convention of ``fp4gemv.nn.checkpoints`` (``from_safetensors``):
each rank reads only the bytes of its slice of the data and scales (safetensors ``get_slice``), never the
whole weight.

Numerics.  Column-parallel outputs are the single layer's, bit for bit, wherever a row's sum does not depend
on how many rows the layer has: always on the CPU path (the float64 reference); on GPUs the kernel's
configuration is chosen per shape, and a shard's rows may be summed in another fp32 order.  Row-parallel: each rank computes its partial sum ``S_r`` rounded once to
``reduce_dtype`` (float32 by default), the group sums the partials in that dtype (in an order of the
collective's choosing), the sum is rounded to x's dtype and the bias added.  With u = 2^-24 and
gamma_n = n u / (1 - n u), the float32 sum s of P partials satisfies
``|s - S| <= (u + (1 + u) gamma_(P-1)) * sum_r |S_r|`` (S the exact sum; about 2u sum_r |S_r| for P = 2),
so a float32 output is within that plus ``u |S|`` of the single layer's, and a float16 / bfloat16 output
equals the single layer's or is its neighbour, the latter only where S lies within that distance of a
rounding boundary of the output dtype.  ``reduce_dtype=None`` sums in x's dtype (half the bytes on the
wire; each partial then carries its own rounding to x's dtype).  The statement holds for decode (<= 16
tokens, ``fp4gemv.gemv``); prefill multiplies dequantized weights with ``F.linear`` in ``reduce_dtype``.

W4A4 with a per-call activation scale (NVFP4: the scale of the whole activation's amax): a row-parallel
layer whose input arrives split agrees on it by an all-reduce (max) of the slices' amax, so every rank
quantizes with the single layer's scale.

Collectives (``collective``): ``"default"``: ``torch.distributed``'s all-gather / all-reduce on the group's
backend (NCCL on GPUs, gloo on CPUs).  ``"symm_mem"``: torch's symmetric-memory one-shot all-reduce
(``torch.ops.symm_mem.one_shot_all_reduce``, CUDA only, float32 and bfloat16, decode sizes; its kernel
synchronises the ranks on entry and exit, so a buffer is reused safely), for the small messages of decode
where NCCL's latency dominates.  The shard's kernel writes straight into a symmetric buffer kept per token
count.  The all-gather is the same one-shot sum over a zero buffer where each rank owns one slice (x + 0
is exact; only a -0.0 comes back as +0.0).  Prefill sizes (> 16 tokens) use the default collective.  No
NVLink multicast (``multimem``) op is used; set ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NCCL_NVLS_ENABLE=0`` where multicast must stay off (``fp4gemv bench --tp`` does).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from .. import formats, layouts
from ..formats import dtype_name as _dtype_name
from ..library import quantize
from ..tensor import FP4Tensor
from .checkpoints import LAYER_KEYS, SafetensorsDirectory, checkpoint_key, detect_convention
from .linear import DECODE_MAX_TOKENS, X_DTYPES, FP4Linear, per_tensor_scale

__all__ = ["ColumnParallelFP4Linear", "RowParallelFP4Linear", "COLLECTIVES", "column_split", "row_split"]

Collective = Literal["default", "symm_mem"]
COLLECTIVES: tuple[str, ...] = ("default", "symm_mem")
# The dtypes of torch's one-shot all-reduce kernel (AT_DISPATCH_FLOAT_AND_BFLOAT16 in CUDASymmetricMemoryOps.cu).
_SYMM_MEM_DTYPES = (torch.float32, torch.bfloat16)
# all_gather_single is all_gather_into_tensor's newer name (the old one warns from torch 2.13 on).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- splits --------------------------------------------------------------------------------------------------


def column_split(out_features: int, world_size: int) -> int:
    """Rows per rank of a column-parallel split; ValueError naming the sizes when N is not a multiple of P."""
    if out_features % world_size:
        raise ValueError(f"out_features: expected a multiple of the tensor-parallel size {world_size} (equal "
                         f"shards of rows), got {out_features}")
    return out_features // world_size


def row_split(in_features: int, world_size: int, fmt: str, scale_layout: str) -> int:
    """K per rank of a row-parallel split: on scale-block boundaries, and on 128x4 tile boundaries for swizzled
    scales; ValueError naming the sizes otherwise."""
    block = formats.FORMATS[fmt].block_size
    if in_features % world_size:
        raise ValueError(f"in_features: expected a multiple of the tensor-parallel size {world_size} (equal "
                         f"shards of K), got {in_features}")
    k_local = in_features // world_size
    if k_local % block:
        raise ValueError(f"in_features: K / P = {in_features} / {world_size} = {k_local} per rank is not a multiple "
                         f"of the {fmt} block size {block}: a scale block would be split across ranks")
    if scale_layout == "swizzled" and (k_local // block) % layouts.COLS_PER_ATOM:
        raise ValueError(f"in_features: K / P = {k_local} per rank has {k_local // block} scale blocks, not a "
                         f"multiple of {layouts.COLS_PER_ATOM}: the split would cut the swizzled scales' 128x4 tiles "
                         f"(use scale_layout='linear' or another tensor-parallel size)")
    return k_local


def _rank_and_size(group, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the group's size, from the process group unless both are given."""
    if rank is None and world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "first (or pass rank and world_size to make a shard without a process group)")
        return dist.get_rank(group), dist.get_world_size(group)
    if rank is None or world_size is None:
        raise ValueError(f"rank, world_size: expected both or neither, got rank={rank!r}, world_size={world_size!r}")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank: expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) != world_size:
        raise ValueError(f"world_size: expected the process group's size {dist.get_world_size(group)}, "
                         f"got {world_size}")
    return rank, world_size


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective: expected one of {COLLECTIVES}, got {collective!r}")


# --- shards of a whole layer ---------------------------------------------------------------------------------


def _row_scales(layer: FP4Linear, r0: int, r1: int) -> torch.Tensor:
    """Scales of rows [r0, r1) in the layer's layout (a copy)."""
    if layer.scale_layout == "linear":
        return layer.weight_scale[r0:r1].clone()
    cols = layer.in_features // layer.format.block_size
    _, cols_p = layouts.padded_scale_shape(layer.out_features, cols)
    tile = layouts.ROWS_PER_ATOM
    t0, t1 = r0 // tile, -(-r1 // tile)
    # Row tiles are outermost in the swizzle: rows [t0*128, t1*128) are one contiguous run of bytes.
    run = layer.weight_scale.reshape(-1, tile * cols_p)[t0:t1].reshape(-1)
    if r0 % tile == 0 and (r1 % tile == 0 or r1 == layer.out_features):
        return run.clone()
    linear = layouts.unswizzle_scales(run, (t1 - t0) * tile, cols)[r0 - t0 * tile: r1 - t0 * tile]
    return layouts.swizzle_scales(linear)


def _k_scales(layer: FP4Linear, c0: int, c1: int) -> torch.Tensor:
    """Scale columns [c0, c1) in the layer's layout (a copy); swizzled: c0, c1 multiples of 4 (whole tiles)."""
    if layer.scale_layout == "linear":
        return layer.weight_scale[:, c0:c1].contiguous()
    cols = layer.in_features // layer.format.block_size
    rows_p, cols_p = layouts.padded_scale_shape(layer.out_features, cols)
    atom = layouts.ROWS_PER_ATOM * layouts.COLS_PER_ATOM
    tiles = layer.weight_scale.reshape(rows_p // layouts.ROWS_PER_ATOM, cols_p // layouts.COLS_PER_ATOM, atom)
    return tiles[:, c0 // layouts.COLS_PER_ATOM: c1 // layouts.COLS_PER_ATOM].reshape(-1).contiguous()


def _shard_of(layer: FP4Linear, split: str, rank: int, world_size: int) -> tuple[FP4Linear, torch.Tensor | None]:
    """(the shard as an FP4Linear, the whole bias for a K split else None): copies of the layer's bytes."""
    if not isinstance(layer, FP4Linear):
        raise TypeError(f"layer: expected an FP4Linear, got {type(layer).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    whole_bias = None
    if split == "rows":
        n = column_split(layer.out_features, world_size)
        r0, r1 = rank * n, (rank + 1) * n
        tensors["weight"] = layer.checkpoint_weight(slice(r0, r1)).clone()
        tensors["weight_scale"] = _row_scales(layer, r0, r1)
        if layer.bias is not None:
            tensors["bias"] = layer.bias.detach()[r0:r1].clone()
    else:
        k = row_split(layer.in_features, world_size, layer.fmt, layer.scale_layout)
        k0, block = rank * k, layer.format.block_size
        # whole 32-bit words (k0 and k multiples of the block size): the slice reorders on its own
        tensors["weight"] = layer.checkpoint_weight(columns=slice(k0 // 2, (k0 + k) // 2)).contiguous()
        tensors["weight_scale"] = _k_scales(layer, k0 // block, (k0 + k) // block)
        if layer.bias is not None:
            whole_bias = layer.bias.detach().clone()
    for name, scale in layer.per_tensor_scales().items():
        tensors[name] = scale.clone()
    return FP4Linear.from_state_dict(tensors, activations=layer.activations), whole_bias


# --- shards read from a checkpoint ---------------------------------------------------------------------------


_DATA_AND_SCALES = {"compressed-tensors": ("weight_packed", "weight_scale"), "modelopt": ("weight", "weight_scale"),
                    "gpt-oss": ("weight_blocks", "weight_scales")}
_SAFETENSORS_SCALE_FORMATS = {"F8_E4M3": "nvfp4", "F8_E8M0": "mxfp4"}


def _read_checkpoint_shard(checkpoint, prefix: str, split: str, rank: int, world_size: int, scale_layout):
    """``_read_shard`` on ``checkpoint`` (a directory, opened and closed here, or an open reader)."""
    reader, opened = _open(checkpoint)
    try:
        return _read_shard(reader, prefix, split, rank, world_size, scale_layout)
    finally:
        if opened:
            reader.close()


def _read_shard(tensors, prefix: str, split: str, rank: int, world_size: int,
                scale_layout: str | None) -> dict[str, torch.Tensor]:
    """One rank's tensors of the layer at ``prefix``, under the checkpoint's own key names, shaped as a layer of
    the shard's size: data and scales read as slices (``tensors.get_slice``), per-tensor scales whole.  The
    split is checked (for ``scale_layout``, the shard's layout to be) before a byte of data is read."""
    convention = detect_convention(tensors, prefix)
    if convention is None:
        raise KeyError(f"{prefix or '<checkpoint>'}: no FP4 layer: expected {checkpoint_key(prefix, 'weight_packed')!r} "
                       f"(compressed-tensors), {checkpoint_key(prefix, 'weight')!r} with {checkpoint_key(prefix, 'weight_scale')!r} "
                       f"(ModelOpt) or {checkpoint_key(prefix, 'weight_blocks')!r} (gpt-oss MXFP4)")
    data_name, scale_name = _DATA_AND_SCALES[convention]
    data_key, scale_key = checkpoint_key(prefix, data_name), checkpoint_key(prefix, scale_name)
    data_slice, scale_slice = tensors.get_slice(data_key), tensors.get_slice(scale_key)
    data_shape, scale_shape = list(data_slice.get_shape()), list(scale_slice.get_shape())
    if convention == "compressed-tensors":
        fmt = "nvfp4"
    elif convention == "gpt-oss":
        fmt = "mxfp4"
    else:
        scale_dtype = scale_slice.get_dtype()
        if scale_dtype not in _SAFETENSORS_SCALE_FORMATS:
            raise TypeError(f"{scale_key}: expected dtype F8_E4M3 (NVFP4) or F8_E8M0 (MXFP4), got {scale_dtype}")
        fmt = _SAFETENSORS_SCALE_FORMATS[scale_dtype]
    block = formats.FORMATS[fmt].block_size
    if convention == "gpt-oss":
        if len(data_shape) != 3 or data_shape[2] != 16:
            raise ValueError(f"{data_key}: expected shape [N, K/32, 16], got {tuple(data_shape)}")
        out_features, in_features = data_shape[0], data_shape[1] * 32
    else:
        if len(data_shape) != 2:
            raise ValueError(f"{data_key}: expected shape [N, K/2], got {tuple(data_shape)}")
        out_features, in_features = data_shape[0], 2 * data_shape[1]
    if scale_shape != [out_features, in_features // block]:
        raise ValueError(f"{scale_key}: expected linear scales [N, K/{block}] = [{out_features}, "
                         f"{in_features // block}] to read a shard, got shape {tuple(scale_shape)}")

    out: dict[str, torch.Tensor] = {}
    if split == "rows":
        n = column_split(out_features, world_size)
        r0, r1 = rank * n, (rank + 1) * n
        out[data_key] = data_slice[r0:r1]
        out[scale_key] = scale_slice[r0:r1]
        shard_shape = [n, in_features]
    else:
        k = row_split(in_features, world_size, fmt, "swizzled" if scale_layout == "swizzled" else "linear")
        k0, k1 = rank * k, (rank + 1) * k
        if convention == "gpt-oss":
            out[data_key] = data_slice[:, k0 // 32: k1 // 32]
        else:
            out[data_key] = data_slice[:, k0 // 2: k1 // 2]
        out[scale_key] = scale_slice[:, k0 // block: k1 // block]
        shard_shape = [out_features, k]
    for name in LAYER_KEYS[convention]:
        key = checkpoint_key(prefix, name)
        if name in (data_name, scale_name) or key not in tensors:
            continue
        if name == "weight_shape":
            stored = [int(v) for v in tensors[key].reshape(-1)]
            if stored != [out_features, in_features]:
                raise ValueError(f"{key}: expected [{out_features}, {in_features}] from {data_key}, got {stored}")
            out[key] = torch.tensor(shard_shape, dtype=tensors[key].dtype)
        elif name == "bias" and split == "rows":
            out[key] = tensors.get_slice(key)[r0:r1]
        elif name == "weight_zero_point" and list(tensors.get_slice(key).get_shape()) == scale_shape:
            zero_slice = tensors.get_slice(key)
            out[key] = zero_slice[r0:r1] if split == "rows" else zero_slice[:, k0 // block: k1 // block]
        else:  # per-tensor scales, a K split's bias: the same whole tensor on every rank
            out[key] = tensors[key]
    return out


def _open(checkpoint):
    """(a reader with ``get_slice``, whether this call opened it) for a directory path or an open reader."""
    if isinstance(checkpoint, (str, Path)):
        return SafetensorsDirectory(checkpoint), True
    if not hasattr(checkpoint, "get_slice"):
        raise TypeError(f"checkpoint: expected a directory of *.safetensors files or a SafetensorsDirectory, got "
                        f"{type(checkpoint).__name__}")
    return checkpoint, False


# --- the layers ----------------------------------------------------------------------------------------------


class _TensorParallelFP4Linear(nn.Module):
    """What both splits share: the shard, the group, the collective and its symmetric buffers."""

    def __init__(self, shard: FP4Linear, in_features: int, out_features: int, *, group, rank: int,
                 world_size: int, collective: Collective) -> None:
        super().__init__()
        _check_collective(collective)
        self.shard = shard
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.tp_rank = rank
        self.tp_size = world_size
        self.collective = collective
        # Symmetric buffers by (token count, dtype): made on first use (a collective call: every rank makes it).
        self._symm_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def fmt(self) -> str:
        return self.shard.fmt

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp_rank={self.tp_rank}, "
                f"tp_size={self.tp_size}, collective={self.collective!r}")

    def _process_group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def _uses_symm_mem(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this call's collective runs on symmetric memory (raises where it cannot)."""
        if self.collective != "symm_mem" or self.tp_size == 1 or tokens > DECODE_MAX_TOKENS:
            return False
        if device.type != "cuda":
            raise ValueError(f"collective: 'symm_mem' needs CUDA tensors, got device {device}")
        if dtype not in _SYMM_MEM_DTYPES:
            raise TypeError(f"collective: 'symm_mem' sums float32 or bfloat16 (torch's one-shot all-reduce), got "
                            f"{_dtype_name(dtype)}")
        return True

    def _symm_buffer(self, tokens: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed symmetric buffer of ``numel`` elements for calls of ``tokens`` tokens, rendezvoused once."""
        key = (tokens, dtype)
        buffer = self._symm_buffers.get(key)
        if buffer is None:
            # Loaded on first use: torch's symmetric memory is CUDA-only and most layers never use it.
            import torch.distributed._symmetric_memory as symm_mem

            group = self._process_group()
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed by older torch, a deprecated no-op in newer
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    enable(group.group_name)
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            buffer.zero_()
            symm_mem.rendezvous(buffer, group.group_name)
            torch.cuda.synchronize(device)
            dist.barrier(group)
            self._symm_buffers[key] = buffer
        return buffer

    def _one_shot_sum(self, buffer: torch.Tensor) -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", self._process_group().group_name)


class ColumnParallelFP4Linear(_TensorParallelFP4Linear):
    """``y = x @ W^T + bias`` with W's rows (out_features) split over the group; see the module docstring.

    forward(x): x ``[..., in_features]`` (whole on every rank) in float16, bfloat16 or float32; returns
    ``[..., out_features]`` (``gather_output=True``) or this rank's ``[..., out_features / P]``.
    Build with :meth:`from_fp4linear` or :meth:`from_safetensors`.
    """

    def __init__(self, shard: FP4Linear, out_features: int, *, group=None, rank: int, world_size: int,
                 gather_output: bool = True, collective: Collective = "default") -> None:
        super().__init__(shard, shard.in_features, out_features, group=group, rank=rank, world_size=world_size,
                         collective=collective)
        if shard.out_features * world_size != out_features:
            raise ValueError(f"shard: expected out_features / P = {out_features} / {world_size} rows, got "
                             f"{shard.out_features}")
        self.gather_output = gather_output

    @property
    def bias(self) -> torch.Tensor | None:
        """This rank's slice of the bias."""
        return self.shard.bias

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``[..., out_features / P]``, no communication."""
        return self.shard(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gather_output or self.tp_size == 1:
            return self.shard(x)
        self.shard.check_input(x)
        lead, n_local, world = x.shape[:-1], self.shard.out_features, self.tp_size
        x2d = x.reshape(-1, self.in_features)
        tokens = x2d.shape[0]
        if tokens == 0:
            return x.new_zeros((*lead, self.out_features))
        if self._uses_symm_mem(tokens, x.dtype, x.device):
            bias = self.shard.bias
            if bias is not None and bias.dtype != x.dtype:
                raise TypeError(f"x: expected dtype {_dtype_name(bias.dtype)} like bias, got {_dtype_name(x.dtype)}")
            # Every rank owns one [tokens, N/P] slice of a zero buffer: the one-shot sum is the gather.
            buffer = self._symm_buffer(tokens, world * tokens * n_local, x.dtype, x.device)
            mine = buffer.view(world, tokens, n_local)[self.tp_rank]
            self.shard.product(x2d, x.dtype, bias, out=mine)
            gathered = self._one_shot_sum(buffer).view(world, tokens, n_local)
        else:
            local = self.shard(x2d)
            gathered = local.new_empty(world * tokens, n_local)
            _all_gather(gathered, local, group=self.group)
            gathered = gathered.view(world, tokens, n_local)
        # [P, T, N/P] -> [T, N]: a view for one token, one copy otherwise.
        y = gathered.reshape(1, self.out_features) if tokens == 1 else gathered.permute(1, 0, 2).reshape(tokens, -1)
        return y.reshape(*lead, self.out_features)

    @classmethod
    def from_fp4linear(cls, layer: FP4Linear, *, group=None, rank: int | None = None, world_size: int | None = None,
                       gather_output: bool = True, collective: Collective = "default") -> ColumnParallelFP4Linear:
        """This rank's shard of a whole ``FP4Linear`` (copied: the whole layer can be freed afterwards).

        rank, world_size: None reads them from ``group`` (default: the default process group); both given
        make a shard without a process group (forward then needs one only when world_size > 1).
        """
        rank, world_size = _rank_and_size(group, rank, world_size)
        _check_collective(collective)
        shard, _ = _shard_of(layer, "rows", rank, world_size)
        return cls(shard, layer.out_features, group=group, rank=rank, world_size=world_size,
                   gather_output=gather_output, collective=collective)

    @classmethod
    def from_safetensors(cls, checkpoint, prefix: str, *, group=None, rank: int | None = None,
                         world_size: int | None = None, gather_output: bool = True,
                         collective: Collective = "default", activations: str | None = None,
                         scale_layout: str | None = None, device=None) -> ColumnParallelFP4Linear:
        """This rank's shard of the layer at ``prefix`` of a safetensors checkpoint (any convention of
        ``fp4gemv.nn.checkpoints``), reading only this rank's rows of the data and scales.

        checkpoint: a directory of ``*.safetensors`` files, or an open ``SafetensorsDirectory`` (anything with
        ``get_slice``, ``__getitem__`` and ``__contains__``).  activations, scale_layout, device: as
        ``FP4Linear.from_state_dict`` (scale_layout None keeps the checkpoint's linear scales).
        """
        rank, world_size = _rank_and_size(group, rank, world_size)
        _check_collective(collective)
        tensors = _read_checkpoint_shard(checkpoint, prefix, "rows", rank, world_size, scale_layout)
        shard = FP4Linear.from_state_dict(tensors, prefix, activations=activations, scale_layout=scale_layout, device=device)
        return cls(shard, shard.out_features * world_size, group=group, rank=rank, world_size=world_size,
                   gather_output=gather_output, collective=collective)


class RowParallelFP4Linear(_TensorParallelFP4Linear):
    """``y = x @ W^T + bias`` with W split along K (in_features) over the group; see the module docstring.

    forward(x): x ``[..., in_features / P]`` (``input_is_parallel=True``, this rank's slice) or
    ``[..., in_features]`` (``False``) in float16, bfloat16 or float32; returns ``[..., out_features]`` on
    every rank, in x's dtype: the partials summed in ``reduce_dtype`` (float32; None: x's dtype), rounded
    once to x's dtype, then the bias (whole on every rank) added once.
    Build with :meth:`from_fp4linear` or :meth:`from_safetensors`.
    """

    def __init__(self, shard: FP4Linear, in_features: int, bias: torch.Tensor | None = None, *, group=None,
                 rank: int, world_size: int, input_is_parallel: bool = True,
                 collective: Collective = "default", reduce_dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__(shard, in_features, shard.out_features, group=group, rank=rank, world_size=world_size,
                         collective=collective)
        if shard.in_features * world_size != in_features:
            raise ValueError(f"shard: expected in_features / P = {in_features} / {world_size}, got "
                             f"{shard.in_features}")
        if shard.bias is not None:
            raise ValueError("shard: expected no bias (a row-parallel layer adds its bias once, after the sum)")
        if reduce_dtype is not None and reduce_dtype not in X_DTYPES:
            raise TypeError(f"reduce_dtype: expected None, float16, bfloat16 or float32, got {reduce_dtype}")
        if bias is not None and tuple(bias.shape) != (shard.out_features,):
            raise ValueError(f"bias: expected shape ({shard.out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.input_is_parallel = input_is_parallel
        self.reduce_dtype = reduce_dtype

    def _local_input(self, x: torch.Tensor) -> tuple[torch.Tensor, FP4Tensor | None, tuple]:
        """(this rank's x slice [T, K/P], its FP4 quantization when the group must agree on a scale, lead dims)."""
        k_local = self.shard.in_features
        if self.input_is_parallel:
            self.shard.check_input(x)
        else:
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"x: expected shape [..., in_features] = [..., {self.in_features}] "
                                 f"(input_is_parallel=False), got {shape}")
            self.shard.check_input(x[..., :k_local])
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        shard = self.shard
        multiplier = None
        if shard.activations == "w4a4" and shard.input_multiplier() is None and shard.fmt == "nvfp4" and x2d.numel():
            # The per-call scale is the whole activation's: every rank must quantize with the same one.
            amax = x2d.detach().abs().amax().to(torch.float32)
            if self.input_is_parallel and self.tp_size > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            multiplier = per_tensor_scale(amax)
        if not self.input_is_parallel:
            k0 = self.tp_rank * k_local
            x2d = x2d[:, k0: k0 + k_local].contiguous()
        activation = None if multiplier is None else quantize(x2d, shard.fmt, "linear", multiplier)
        return x2d, activation, lead

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``[..., out_features]`` in ``reduce_dtype`` (x's when None), no bias,
        no communication (except the agreement on a per-call W4A4 scale)."""
        x2d, activation, lead = self._local_input(x)
        dtype = self.reduce_dtype or x.dtype
        if x2d.shape[0] == 0:
            return x2d.new_zeros((*lead, self.out_features), dtype=dtype)
        return self.shard.product(x2d, dtype, None, activation=activation).reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and isinstance(x, torch.Tensor) and self.bias.dtype != x.dtype:
            raise TypeError(f"x: expected dtype {_dtype_name(self.bias.dtype)} like bias, got "
                            f"{_dtype_name(x.dtype)} (convert the module with .to(dtype))")
        x2d, activation, lead = self._local_input(x)
        dtype = self.reduce_dtype or x.dtype
        tokens = x2d.shape[0]
        if tokens == 0:
            return x.new_zeros((*lead, self.out_features))
        if self._uses_symm_mem(tokens, dtype, x2d.device):
            buffer = self._symm_buffer(tokens, tokens * self.out_features, dtype, x2d.device)
            partial = buffer.view(tokens, self.out_features)
            self.shard.product(x2d, dtype, None, out=partial, activation=activation)
            y = self._one_shot_sum(buffer).view(tokens, self.out_features)
        else:
            y = self.shard.product(x2d, dtype, None, activation=activation)
            if self.tp_size > 1:
                dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        y = y.to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)

    @classmethod
    def from_fp4linear(cls, layer: FP4Linear, *, group=None, rank: int | None = None, world_size: int | None = None,
                       input_is_parallel: bool = True, collective: Collective = "default",
                       reduce_dtype: torch.dtype | None = torch.float32) -> RowParallelFP4Linear:
        """This rank's shard of a whole ``FP4Linear`` (copied); rank and world_size as
        ``ColumnParallelFP4Linear.from_fp4linear``."""
        rank, world_size = _rank_and_size(group, rank, world_size)
        _check_collective(collective)
        shard, bias = _shard_of(layer, "k", rank, world_size)
        return cls(shard, layer.in_features, bias, group=group, rank=rank, world_size=world_size,
                   input_is_parallel=input_is_parallel, collective=collective, reduce_dtype=reduce_dtype)

    @classmethod
    def from_safetensors(cls, checkpoint, prefix: str, *, group=None, rank: int | None = None,
                         world_size: int | None = None, input_is_parallel: bool = True,
                         collective: Collective = "default", reduce_dtype: torch.dtype | None = torch.float32,
                         activations: str | None = None, scale_layout: str | None = None,
                         device=None) -> RowParallelFP4Linear:
        """This rank's shard of the layer at ``prefix``, reading only its K range of the data and scales; the
        arguments as ``ColumnParallelFP4Linear.from_safetensors``.  A swizzled ``scale_layout`` needs the
        split on tile boundaries (ValueError otherwise)."""
        rank, world_size = _rank_and_size(group, rank, world_size)
        _check_collective(collective)
        tensors = _read_checkpoint_shard(checkpoint, prefix, "k", rank, world_size, scale_layout)
        bias_key = checkpoint_key(prefix, "bias")
        bias = tensors.pop(bias_key, None)
        shard = FP4Linear.from_state_dict(tensors, prefix, activations=activations, scale_layout=scale_layout, device=device)
        if bias is not None:
            bias = bias.to(shard.weight.device)
        return cls(shard, shard.in_features * world_size, bias, group=group, rank=rank, world_size=world_size,
                   input_is_parallel=input_is_parallel, collective=collective, reduce_dtype=reduce_dtype)

