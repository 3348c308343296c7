"""Device script (issue 27, round 32 of docs/performance.md): where a static-cache ``generate`` token's time goes.
The Llama-3-8B-shaped model of ``generate_tokens.py`` (random weights, NVFP4 weight-only, lm_head bf16), its
static-cache compiled ms a token, then one profiled ``generate`` of 17 tokens: the wall time against the device's
busy time (the sum of every kernel's duration) and the kernels that take it.  Where busy is well under the wall,
the token waits on the host (generate's own loop), which no kernel change shortens.

    PYTHONPATH=src python benchmarks/generate_profile.py        (GPU machine, repo root; ~100 s)
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
import generate_tokens as G  # noqa: E402
from fp4gemv.nn import quantize_model  # noqa: E402


def main() -> None:
    t0 = time.perf_counter()
    model = G.build("llama3-8b", "cuda")
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    quantize_model(model, "nvfp4", skip=["lm_head"])
    torch.cuda.empty_cache()
    print(f"built and quantized in {time.perf_counter() - t0:.0f} s", flush=True)
    ms = G.ms_per_token(model, prompt, 24, True)
    print(f"static cache (compiled): {ms:.2f} ms a token", flush=True)
    kwargs = dict(max_new_tokens=17, min_new_tokens=17, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(prompt, **kwargs)
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"profiled generate, 17 tokens: wall {wall * 1e3:.1f} ms, {len(kernels)} kernels, device busy "
          f"{busy:.1f} ms", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
