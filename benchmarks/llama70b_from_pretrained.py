"""A Llama-3-70B-shaped NVFP4 checkpoint with random weights, written with fp4gemv's own writer one decoder layer
at a time, then loaded on one GPU with ``fp4gemv.nn.from_pretrained``: peak GPU memory and decode tokens/s.

Writing (``--write DIR``): each decoder layer is made on the GPU in bf16 with random weights, quantized
(``quantize_model``, NVFP4 weight-only) and written by ``save_compressed_tensors`` as one shard; the embeddings,
final norm and bf16 lm_head make the last shard, whose ``config.json`` (the model's configuration and the
compressed-tensors quantization config, lm_head in ``ignore``) is the checkpoint's.  Host and GPU memory hold
one layer at a time (about 1.7 GB in bf16); the checkpoint takes about 42 GB of disk.  Loading (``--load
DIR``): ``from_pretrained(DIR, device="cuda")``, then greedy ``generate`` with the dynamic cache (eager).
Both together by default; on an H200 each is a few minutes.

    PYTHONPATH=src python benchmarks/llama70b_from_pretrained.py --write /tmp/llama70b-nvfp4 --load /tmp/llama70b-nvfp4
    PYTHONPATH=src python benchmarks/llama70b_from_pretrained.py --small --write /tmp/s --load /tmp/s   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import LlamaConfig
from transformers.generation.streamers import BaseStreamer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from fp4gemv.nn import FP4Linear, from_pretrained, quantize_model, save_compressed_tensors

LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


class _Named(nn.Module):
    """Holds modules under the names they have in LlamaForCausalLM, so the writer's keys are the model's."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        for path, module in modules.items():
            parent = self
            *parents, last = path.split(".")
            for part in parents:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(last, module)


def _random_(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)


def _shard(piece: nn.Module, directory: Path, file_name: str, config: dict | None = None) -> dict[str, str]:
    """Write ``piece`` with save_compressed_tensors into a scratch directory; move its file to ``file_name``."""
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        save_compressed_tensors(piece, scratch, config=config)
        os.replace(Path(scratch) / "model.safetensors", directory / file_name)
        if config is not None:
            os.replace(Path(scratch) / "config.json", directory / "config.json")
    with safe_open(str(directory / file_name), framework="pt") as handle:
        return {key: file_name for key in handle.keys()}


def write(directory: Path, shape: dict, device: str) -> float:
    """Write the checkpoint; returns its bytes."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    config = LlamaConfig(**shape, dtype="bfloat16", tie_word_embeddings=False)
    weight_map = {}
    layers = config.num_hidden_layers
    torch.manual_seed(0)
    t0 = time.perf_counter()
    for i in range(layers):
        with torch.device(device):
            layer = LlamaDecoderLayer(config, layer_idx=i).to(torch.bfloat16)
        _random_(layer)
        piece = _Named({f"model.layers.{i}": layer})
        quantize_model(piece, "nvfp4", scale_layout="linear")
        weight_map.update(_shard(piece, directory, f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"))
        del piece, layer
        if i % 10 == 0:
            print(f"layer {i + 1}/{layers} written, {time.perf_counter() - t0:.0f} s", flush=True)
    with torch.device(device):
        rest = {"model.embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size, dtype=torch.bfloat16),
                "model.norm": LlamaRMSNorm(config.hidden_size).to(torch.bfloat16),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=torch.bfloat16)}
    for module in rest.values():
        _random_(module)
    piece = _Named(rest)
    # The writer needs an FP4Linear in the piece it writes; a one-block placeholder, dropped from the map below.
    piece.add_module("placeholder", FP4Linear.from_linear(nn.Linear(16, 1, bias=False, device=device)))
    file_name = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    weight_map.update(_shard(piece, directory, file_name, config=config.to_dict()))
    config_path = directory / "config.json"
    written = json.loads(config_path.read_text())
    written["quantization_config"]["ignore"] = ["lm_head"]
    config_path.write_text(json.dumps(written, indent=2) + "\n")
    weight_map = {k: v for k, v in weight_map.items() if not k.startswith("placeholder.")}
    _drop_keys(directory / file_name, "placeholder.")
    total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    print(f"wrote {total / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s to {directory}", flush=True)
    return total


def _drop_keys(path: Path, prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith(prefix)}
    save_file(tensors, str(path), metadata={"format": "pt"})


class _TokenTimes(BaseStreamer):
    def __init__(self):
        self.times = []

    def put(self, value):
        value.cpu()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load_and_decode(directory: Path, device: str, tokens: int) -> None:
    checkpoint = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = from_pretrained(directory, device=device, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    loaded_peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    fp4 = sum(isinstance(m, FP4Linear) for m in model.modules())
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device=device)
    streamer = _TokenTimes()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                       streamer=streamer)
    gaps = [b - a for a, b in zip(streamer.times[1:], streamer.times[2:])]
    ms = statistics.median(gaps[2:] if len(gaps) > 4 else gaps) * 1e3
    decode_peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    print(f"\n{directory}: {fp4} FP4Linear layers, checkpoint {checkpoint / 1e9:.2f} GB, from_pretrained {load_s:.0f} s")
    print(f"{'peak GPU memory after loading':<34} {loaded_peak / 1e9:>8.2f} GB")
    print(f"{'peak GPU memory after decoding':<34} {decode_peak / 1e9:>8.2f} GB")
    print(f"{'eager decode (dynamic cache)':<34} {ms:>8.2f} ms/token {1e3 / ms:>8.1f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the checkpoint to this directory")
    parser.add_argument("--load", type=Path, help="load this checkpoint directory and decode")
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test)")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens timed")
    args = parser.parse_args()
    if args.write is None and args.load is None:
        parser.error("expected --write DIR, --load DIR or both")
    device = "cpu" if args.small else "cuda"
    if args.write is not None:
        write(args.write, SMALL if args.small else LLAMA3_70B, device)
    if args.load is not None:
        load_and_decode(args.load, device, args.tokens)


if __name__ == "__main__":
    main()
