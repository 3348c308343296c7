"""Hostile inputs for the quantizer, shared by tests/test_quantize.py and benchmarks/quantize_speed.py."""

import math

import torch

from fp4gemv import formats

__all__ = ["E2M1_MAGNITUDES", "TIES", "fuzz_input"]

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# (largest finite, smallest subnormal, exponent range of the blocks' magnitudes) of each input dtype.
_LIMITS = {
    torch.float32: (torch.finfo(torch.float32).max, 2.0**-149, (-120, 110)),
    torch.bfloat16: (torch.finfo(torch.bfloat16).max, 2.0**-133, (-120, 110)),
    torch.float16: (65504.0, 2.0**-24, (-12, 11)),
}


def fuzz_input(fmt: str, dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Floats ``shape`` (last dimension a multiple of the block size), each block of one hostile kind:
    ordinary data at a random binade; zeros and -0; all equal; e2m1 values and ties of a unit the quantizer
    picks exactly (amax = 6 units, no global scale), some moved one ulp either way; many binades; the dtype's
    largest values; its subnormals; small negatives (and -0) that round to zero beside one larger value."""
    g = torch.Generator().manual_seed(seed)
    bs = formats.FORMATS[fmt].block_size
    *outer, k = shape
    n = math.prod(outer) * (k // bs)
    fmax, tiny, (e_lo, e_hi) = _LIMITS[dtype]

    def rand():
        return torch.rand(n, bs, generator=g, dtype=torch.float64)

    def sign():
        return torch.where(rand() < 0.5, -1.0, 1.0).double()

    e = torch.randint(e_lo, e_hi, (n, 1), generator=g).double()
    if fmt == "nvfp4":  # an e4m3 value from 2^-9 (2^-8 for fp16 ties to stay exact) to 448
        mantissa = 1 + torch.randint(0, 8, (n, 1), generator=g).double() / 8
        unit = (mantissa * torch.exp2(e.clamp(min=-9 if dtype != torch.float16 else -8))).clamp(max=448.0)
    else:
        unit = torch.exp2(e)
    grid = torch.tensor(TIES + E2M1_MAGNITUDES, dtype=torch.float64)
    ties = grid[torch.randint(0, len(grid), (n, bs), generator=g)] * unit * sign()
    lonely = torch.randint(0, bs, (n,), generator=g)
    ties[torch.arange(n), lonely] = 6.0 * unit[:, 0]
    small = -rand() * torch.exp2(e - 4)
    small[torch.arange(n), lonely] = (torch.exp2(e[:, 0]) * sign()[:, 0])
    kinds = torch.stack([
        torch.randn(n, bs, generator=g, dtype=torch.float64) * torch.exp2(e),
        torch.where(rand() < 0.5, -0.0, 0.0).double(),
        (sign()[:, :1] * (1 + rand()[:, :1]) * torch.exp2(e)).expand(n, bs),
        ties,
        ties,
        sign() * (1 + rand()) * torch.exp2(torch.randint(e_lo, e_hi, (n, bs), generator=g).double()),
        sign() * fmax * torch.where(rand() < 0.5, 1.0, rand()),
        sign() * tiny * torch.randint(0, 64, (n, bs), generator=g).double(),
        small,
    ])
    kind = torch.randint(0, len(kinds), (n,), generator=g)
    x = kinds[kind, torch.arange(n)].reshape(*outer, k).to(dtype)
    # Kind 4: the ties moved one ulp up or down in the input dtype, onto the rounding boundaries' sides.
    step = torch.randint(-1, 2, x.shape, generator=g)
    nudge = (kind == 4).repeat_interleave(bs).reshape(x.shape) & (step != 0) & (x != 0)
    away = torch.where(step > 0, torch.full_like(x, math.inf), torch.full_like(x, -math.inf))
    nudged = torch.nextafter(x, away)
    return torch.where(nudge & torch.isfinite(nudged), nudged, x)
