"""Tokens per second of transformers ``generate`` for a Llama-3-shaped model with random weights: bf16 against
FP4 (NVFP4 weight-only, lm_head kept bf16), eager and static-cache compiled, as issue 20's table measures them.

The model is built from its configuration alone (no download), quantized with ``fp4gemv.nn.quantize_model``,
written as a compressed-tensors checkpoint and loaded back with ``fp4gemv.nn.from_pretrained`` (the FP4 run
goes through the loader users call).  Greedy decoding of a random prompt; the time of each new token is taken
from a streamer's timestamps (the streamer reads each token back, which waits for it), and the table gives the
median over the decode steps (the first two steps, which include compilation and warm-up, are left out).

    PYTHONPATH=src python benchmarks/generate_tokens.py [--model llama3-8b|llama3.2-1b] [--tokens 48]
    PYTHONPATH=src python benchmarks/generate_tokens.py --small     # a tiny model on the CPU: a smoke test

On an H200 the default run (Llama-3-8B, both modes, both models) takes about 3 minutes, most of it the two
static-cache compilations.  On the CPU transformers does not compile (its generate compiles on CUDA only), so
the "static cache" rows there are the static cache run eagerly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from fp4gemv.nn import FP4Linear, from_pretrained, quantize_model, save_compressed_tensors

CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                        rope_theta=500000.0, tie_word_embeddings=True),
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}


class _TokenTimes(BaseStreamer):
    """Records when each generated token is available on the host."""

    def __init__(self):
        self.times = []

    def put(self, value):
        value.cpu()  # waits for the token
        self.times.append(time.perf_counter())

    def end(self):
        pass


def ms_per_token(model, prompt, tokens: int, static: bool) -> float:
    """Median milliseconds between consecutive new tokens of one greedy ``generate`` (steps 3 on)."""
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up, compiles
        streamer = _TokenTimes()
        model.generate(prompt, streamer=streamer, **kwargs)
    # put() is called with the prompt first, then once per new token.
    gaps = [b - a for a, b in zip(streamer.times[1:], streamer.times[2:])]
    return statistics.median(gaps[2:] if len(gaps) > 4 else gaps) * 1e3


def build(name: str, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(**CONFIGS[name], dtype="bfloat16")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[k for k in CONFIGS if k != "small"], default="llama3-8b",
                        help="the configuration (random weights)")
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per timed generate")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--modes", default="eager,static", help="comma-separated: eager, static")
    args = parser.parse_args()
    name = "small" if args.small else args.model
    device = "cpu" if args.small else "cuda"
    modes = args.modes.split(",")
    model = build(name, device)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    rows = {}
    for mode in modes:
        rows[("bf16", mode)] = ms_per_token(model, prompt, args.tokens, mode == "static")
    t0 = time.perf_counter()
    quantize_model(model, "nvfp4", skip=["lm_head"])
    with tempfile.TemporaryDirectory() as directory:
        save_compressed_tensors(model, directory, config=model.config.to_dict())
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        fp4 = from_pretrained(directory, device=device, dtype=torch.bfloat16)
    setup_s = time.perf_counter() - t0
    layers = sum(isinstance(m, FP4Linear) for m in fp4.modules())
    for mode in modes:
        rows[("fp4", mode)] = ms_per_token(fp4, prompt, args.tokens, mode == "static")
    print(f"\n{name}: {layers} FP4Linear layers (NVFP4 weight-only, lm_head bf16); quantize + save + "
          f"from_pretrained {setup_s:.0f} s; {args.tokens} new tokens after {args.prompt}; device {device}")
    print(f"{'mode':<26} {'bf16 ms/tok':>11} {'FP4 ms/tok':>11} {'bf16 tok/s':>11} {'FP4 tok/s':>10} {'speed-up':>9}")
    for mode in modes:
        bf16, fp4_ms = rows[("bf16", mode)], rows[("fp4", mode)]
        label = "eager (dynamic cache)" if mode == "eager" else "static cache" + (" (compiled)" if device == "cuda"
                                                                                  else " (eager: CPU)")
        print(f"{label:<26} {bf16:>11.2f} {fp4_ms:>11.2f} {1e3 / bf16:>11.1f} {1e3 / fp4_ms:>10.1f} "
              f"{bf16 / fp4_ms:>8.2f}x")


if __name__ == "__main__":
    main()
