"""Tensor-parallel FP4Linear (fp4gemv.nn.parallel).

In this process, without a process group: shards of a whole layer reassemble it byte for byte (data, scales
in both layouts, per-tensor scales, bias), impossible splits raise errors naming the sizes, and sharded
loading reads only this rank's slices of a checkpoint in each convention.  Then two processes in a gloo
group (tests/parallel_worker.py, started here) run the layers with their collectives against the whole
layer: column-parallel outputs bit for bit, row-parallel within the fp32 summation-order bound of
``fp4gemv.nn.parallel``'s docstring, the bias once.
"""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

import parallel_worker
from fp4gemv import dequantize, layouts
from fp4gemv.nn import ColumnParallelFP4Linear, FP4Linear, RowParallelFP4Linear, layer_tensors
from fp4gemv.nn.checkpoints import SafetensorsDirectory

N, K = 384, 512  # N / 2 = 192 rows per rank: not on a 128-row tile boundary (the re-swizzle path)
PREFIX = parallel_worker.PREFIX


def _layer(fmt, scale_layout="linear", n=N, k=K, seed=0, bias=True):
    torch.manual_seed(seed)
    return FP4Linear.from_linear(torch.nn.Linear(k, n, bias=bias), fmt, scale_layout=scale_layout)


def _values(layer):
    return dequantize(layer.quantized_weight(), torch.float64)


# --- shards of a whole layer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("scale_layout", ["linear", "swizzled"])
@pytest.mark.parametrize("n,world", [(384, 2), (512, 2), (512, 4)])
def test_column_shards_reassemble_the_layer(fmt, scale_layout, n, world):
    whole = _layer(fmt, scale_layout, n=n)
    shards = [ColumnParallelFP4Linear.from_fp4linear(whole, rank=r, world_size=world) for r in range(world)]
    assert torch.equal(torch.cat([_values(s.shard) for s in shards]), _values(whole))
    assert torch.equal(torch.cat([s.shard.weight for s in shards]), whole.weight)
    assert torch.equal(torch.cat([s.bias for s in shards]), whole.bias)
    for s in shards:
        assert s.shard.scale_layout == scale_layout and s.out_features == n and s.shard.out_features == n // world
        assert torch.equal(s.shard.weight_multiplier(), whole.weight_multiplier()) if fmt == "nvfp4" else True
        if scale_layout == "swizzled":  # exactly the swizzle of the shard's rows, zero padding included
            rows = s.shard.quantized_weight().linear_scales()
            assert torch.equal(s.shard.weight_scale.view(torch.uint8), layouts.swizzle_scales(rows.view(torch.uint8)))
    # Copies: the whole layer can be freed.
    assert shards[0].shard.weight.untyped_storage().data_ptr() != whole.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("scale_layout", ["linear", "swizzled"])
@pytest.mark.parametrize("world", [2, 4])
def test_row_shards_reassemble_the_layer(fmt, scale_layout, world):
    whole = _layer(fmt, scale_layout)
    shards = [RowParallelFP4Linear.from_fp4linear(whole, rank=r, world_size=world) for r in range(world)]
    assert torch.equal(torch.cat([_values(s.shard) for s in shards], dim=1), _values(whole))
    for s in shards:
        assert s.shard.bias is None and torch.equal(s.bias, whole.bias)  # whole, added once after the sum
        assert s.in_features == K and s.shard.in_features == K // world and s.out_features == N
        if fmt == "nvfp4":
            assert torch.equal(s.shard.weight_multiplier(), whole.weight_multiplier())


def test_impossible_splits_name_the_sizes():
    with pytest.raises(ValueError, match=r"out_features: .*tensor-parallel size 5.*got 384"):
        ColumnParallelFP4Linear.from_fp4linear(_layer("nvfp4"), rank=0, world_size=5)
    with pytest.raises(ValueError, match=r"in_features: .*tensor-parallel size 3.*got 512"):
        RowParallelFP4Linear.from_fp4linear(_layer("nvfp4"), rank=0, world_size=3)
    # K = 512 over 32 ranks: 16 per rank, half an MXFP4 block.
    with pytest.raises(ValueError, match=r"512 / 32 = 16 per rank is not a multiple of the mxfp4 block size 32"):
        RowParallelFP4Linear.from_fp4linear(_layer("mxfp4"), rank=0, world_size=32)
    # K = 128 over 4 ranks: 32 per rank = 2 NVFP4 scale blocks, half a 128x4 tile: only linear scales can split.
    with pytest.raises(ValueError, match=r"K / P = 32 per rank has 2 scale blocks, not a multiple of 4"):
        RowParallelFP4Linear.from_fp4linear(_layer("nvfp4", "swizzled", k=128), rank=0, world_size=4)
    shard = RowParallelFP4Linear.from_fp4linear(_layer("nvfp4", "linear", k=128), rank=3, world_size=4)
    assert shard.shard.in_features == 32


def test_rank_and_group_arguments():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ColumnParallelFP4Linear.from_fp4linear(_layer("nvfp4"))
    with pytest.raises(ValueError, match="rank, world_size: expected both or neither"):
        ColumnParallelFP4Linear.from_fp4linear(_layer("nvfp4"), rank=0)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size, got rank=2, world_size=2"):
        ColumnParallelFP4Linear.from_fp4linear(_layer("nvfp4"), rank=2, world_size=2)
    with pytest.raises(ValueError, match="collective: expected one of"):
        RowParallelFP4Linear.from_fp4linear(_layer("nvfp4"), rank=0, world_size=2, collective="nvls")


def test_one_rank_is_the_layer():
    whole = _layer("nvfp4", "swizzled")
    x = torch.randn(3, K)
    assert torch.equal(ColumnParallelFP4Linear.from_fp4linear(whole, rank=0, world_size=1)(x), whole(x))
    row = RowParallelFP4Linear.from_fp4linear(whole, rank=0, world_size=1, reduce_dtype=None)
    assert torch.equal(row(x), whole(x))


# --- sharded loading -----------------------------------------------------------------------------------------


def _write_checkpoints(root, bias=True):
    """One directory per convention holding one layer: NVFP4 (compressed-tensors, ModelOpt) and MXFP4 (gpt-oss)."""
    dirs = {}
    for convention, fmt in (("compressed-tensors", "nvfp4"), ("modelopt", "nvfp4"), ("gpt-oss", "mxfp4")):
        layer = _layer(fmt, "linear", seed=len(dirs), bias=bias)
        directory = os.path.join(root, convention)
        os.makedirs(directory)
        save_file({k: v.contiguous() for k, v in layer_tensors(layer, convention, PREFIX).items()},
                  os.path.join(directory, "model.safetensors"))
        dirs[convention] = directory
    return dirs


class _RecordingReader(SafetensorsDirectory):
    """A SafetensorsDirectory that records whole-tensor reads and the bytes of every slice read."""

    def __init__(self, directory):
        super().__init__(directory)
        self.whole_reads, self.slice_bytes = [], {}

    def __getitem__(self, key):
        self.whole_reads.append(key)
        return super().__getitem__(key)

    def get_slice(self, key):
        inner, record = super().get_slice(key), self.slice_bytes

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def get_dtype(self):
                return inner.get_dtype()

            def __getitem__(self, index):
                t = inner[index]
                record[key] = record.get(key, 0) + t.numel() * t.element_size()
                return t

        return Slice()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _write_checkpoints(str(tmp_path_factory.mktemp("tp-checkpoints")))


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt", "gpt-oss"])
@pytest.mark.parametrize("split", ["column", "row"])
def test_sharded_loading_reads_only_this_ranks_slice(checkpoints, convention, split):
    world = 2
    cls = ColumnParallelFP4Linear if split == "column" else RowParallelFP4Linear
    data_key, scale_key = (f"{PREFIX}.{n}" for n in {"compressed-tensors": ("weight_packed", "weight_scale"),
                                                      "modelopt": ("weight", "weight_scale"),
                                                      "gpt-oss": ("weight_blocks", "weight_scales")}[convention])
    whole = FP4Linear.from_state_dict(SafetensorsDirectory(checkpoints[convention]), PREFIX)
    full = SafetensorsDirectory(checkpoints[convention])
    full_bytes = {key: full[key].numel() * full[key].element_size() for key in (data_key, scale_key)}
    for rank in range(world):
        reader = _RecordingReader(checkpoints[convention])
        loaded = cls.from_safetensors(reader, PREFIX, rank=rank, world_size=world)
        assert data_key not in reader.whole_reads and scale_key not in reader.whole_reads, reader.whole_reads
        for key in (data_key, scale_key):
            assert reader.slice_bytes[key] == full_bytes[key] // world, (key, reader.slice_bytes, full_bytes)
        expected = cls.from_fp4linear(whole, rank=rank, world_size=world)
        for name, buffer in expected.shard.named_buffers():
            assert _same_bytes(loaded.shard.get_buffer(name), buffer), name
        assert torch.equal(loaded.bias, expected.bias)


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_sharded_loading_checks_the_split_before_reading(checkpoints):
    reader = _RecordingReader(checkpoints["modelopt"])
    # NVFP4 K = 512 over 8 ranks: 64 per rank = 4 blocks, one tile: fine; over 16: 2 blocks, half a tile.
    with pytest.raises(ValueError, match="not a multiple of 4"):
        RowParallelFP4Linear.from_safetensors(reader, PREFIX, rank=0, world_size=16, scale_layout="swizzled")
    with pytest.raises(ValueError, match=r"out_features: .*tensor-parallel size 5.*got 384"):
        ColumnParallelFP4Linear.from_safetensors(reader, PREFIX, rank=0, world_size=5)
    assert reader.slice_bytes == {}
    with pytest.raises(KeyError, match="no FP4 layer"):
        ColumnParallelFP4Linear.from_safetensors(reader, "other", rank=0, world_size=2)


# --- two processes, gloo -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """Run every case of tests/parallel_worker.py on two processes of a gloo group; their results per rank."""
    out = str(tmp_path_factory.mktemp("tp-results"))
    mp.spawn(parallel_worker.worker, args=(2, _free_port(), checkpoints, out), nprocs=2, join=True)
    results = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("case", sorted(parallel_worker.CASES))
def test_two_ranks(two_ranks, case):
    results = two_ranks
    for rank, result in enumerate(results):
        assert case in result, f"rank {rank} did not run {case}"
        assert result[case] is None, f"rank {rank}:\n{result[case]}"

