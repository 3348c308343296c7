"""Tokens/s of a transformers GptOssForCausalLM with gpt-oss-20b's configuration (random bf16 weights, no
download): bf16 experts (transformers' own expert code) against fp4gemv.nn.FP4Experts (the experts quantized
to MXFP4, as gpt-oss ships them), each eager and with a static cache and torch.compile.

    PYTHONPATH=src python benchmarks/gpt_oss_generate.py [--new-tokens 64] [--prompt 16] [--no-compile]

Greedy decoding of one sequence; tokens/s = new tokens / wall time of generate (after a warm-up generate of the
same length, so compilation and autotuning are outside the timing).  Prints a table at the end.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from fp4gemv.nn import FP4Experts, quantize_experts


def gpt_oss_20b_config() -> transformers.GptOssConfig:
    # openai/gpt-oss-20b config.json: 24 layers, 32 experts, top-4; the rest are GptOssConfig's defaults
    # (hidden 2880, intermediate 2880, 64 heads of 64, 8 KV heads, sliding window 128, YaRN RoPE).
    return transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4)


def tokens_per_s(model, prompt, new_tokens: int, static: bool) -> float:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        model.generate(prompt, **kw)  # warm-up: compilation, autotuning
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - t0)


def measure(model, prompt, new_tokens: int, compile_: bool) -> dict:
    row = {"eager tok/s": tokens_per_s(model, prompt, new_tokens, static=False)}
    if compile_:
        eager_forward = model.forward
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        try:
            row["static+compile tok/s"] = tokens_per_s(model, prompt, new_tokens, static=True)
        except Exception as exc:  # reported in the table, not hidden
            row["static+compile tok/s"] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        model.forward = eager_forward
        torch._dynamo.reset()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16, help="prompt length in tokens (random ids)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args()
    torch.manual_seed(0)
    config = gpt_oss_20b_config()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.GptOssForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p_ in model.parameters():
            p_.normal_(std=0.02)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")
    rows = {}
    rows["bf16 experts (" + str(config._experts_implementation) + ")"] = measure(model, prompt, args.new_tokens,
                                                                                 not args.no_compile)
    bf16_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    for layer in model.model.layers:
        layer.mlp.experts = quantize_experts(layer.mlp.experts, "mxfp4")
    torch.cuda.empty_cache()
    assert isinstance(model.model.layers[0].mlp.experts, FP4Experts)
    rows["fp4gemv MXFP4 experts"] = measure(model, prompt, args.new_tokens, not args.no_compile)
    fp4_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    agree = int((bf16_tokens == fp4_tokens).sum()) - args.prompt
    print(f"\ngpt-oss-20b config, random weights, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{torch.cuda.get_device_name()}; first 8 greedy tokens equal to bf16's: {agree}/8 (quantization "
          f"changes random-weight logits; not a correctness check)")
    print("| experts | eager tok/s | static+compile tok/s |")
    print("|---|---|---|")
    for name, row in rows.items():
        cells = [row.get(k, "-") for k in ("eager tok/s", "static+compile tok/s")]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
