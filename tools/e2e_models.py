"""The models tools/e2e_llama.py runs: Hugging Face decoders with public models' dimensions and random weights, the
forward passes it times (a prefill, or a decode step over a static KV cache) and how it times them (`timed`). Needs
`transformers`."""

from __future__ import annotations

import inspect
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIGS = {
    # Llama-3-8B: hidden 4096, intermediate 14336, 32 heads, 8 KV heads
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)),
    # Qwen2-7B: hidden 3584, intermediate 18944, 28 heads, 4 KV heads, q/k/v with biases
    "qwen2-7b": ("Qwen2Config", "Qwen2ForCausalLM",
                 dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                      vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0)),
    # StarCoder2-7B: hidden 4608, intermediate 18432, 36 heads, 4 KV heads, biases, LayerNorm, an MLP without a gate
    # (c_fc, tanh GELU, c_proj)
    "starcoder2-7b": ("Starcoder2Config", "Starcoder2ForCausalLM",
                      dict(hidden_size=4608, intermediate_size=18432, num_attention_heads=36, num_key_value_heads=4,
                           vocab_size=49152, max_position_embeddings=16384, rope_theta=1000000.0, use_bias=True,
                           hidden_act="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)),
    # Gemma-2-9B: hidden 3584, intermediate 14336, 16 heads of 256, 8 KV heads, tanh-GELU gated MLP, Gemma's norms
    # (1 + weight) before and after the attention and the MLP
    "gemma2-9b": ("Gemma2Config", "Gemma2ForCausalLM",
                  dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, vocab_size=256000, max_position_embeddings=8192)),
    # GLM-4-9B: hidden 4096, intermediate 13696, 32 heads, 2 KV heads, q/k/v with biases, RMSNorms before and after
    # the attention and the MLP (the adds after them in the norm kernel), rotary on half of each head
    "glm4-9b": ("Glm4Config", "Glm4ForCausalLM",
                dict(hidden_size=4096, intermediate_size=13696, num_attention_heads=32, num_key_value_heads=2,
                     head_dim=128, vocab_size=151552, max_position_embeddings=32768, attention_bias=True)),
    # Phi-2: hidden 2560, intermediate 10240, 32 heads, biases, LayerNorm, the attention and a gateless MLP (fc1, tanh
    # GELU, fc2) both on the layer's normed input, rotary on 40% of each head
    "phi-2": ("PhiConfig", "PhiForCausalLM",
              dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_key_value_heads=32,
                   vocab_size=51200, max_position_embeddings=2048, partial_rotary_factor=0.4, hidden_act="gelu_new")),
    # Mixtral-8x7B: Llama's attention (hidden 4096, 32 heads, 8 KV heads), an MoE block of 8 experts of 14336, top 2
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM",
                     dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                          rope_theta=1000000.0)),
    # OPT-6.7B: hidden 4096, fc1/fc2 of 16384 with ReLU inline in the layer, 32 heads, biases, LayerNorm, learned
    # positions
    "opt-6.7b": ("OPTConfig", "OPTForCausalLM",
                 dict(hidden_size=4096, ffn_dim=16384, num_attention_heads=32, word_embed_proj_dim=4096,
                      vocab_size=50272, max_position_embeddings=2048)),
    "tiny": ("LlamaConfig", "LlamaForCausalLM",
             dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=1024, max_position_embeddings=4096)),
}
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(frozen=True)
class Phase:
    name: str
    batch: int
    tokens: int  # new tokens per sequence in the timed forward
    context: int  # tokens already in the KV cache (0: a prefill without a cache)



def counts(text: str) -> list[int]:
    """'1,8,32' or '1-64' (every count from 1 to 64) or a mix: the counts, sorted, each once."""
    out: set[int] = set()
    for item in filter(None, text.split(",")):
        lo, _, hi = item.partition("-")
        if not (lo.isdigit() and (hi or lo).isdigit()) or not 1 <= int(lo) <= int(hi or lo):
            raise ValueError(f"{text!r}: expected counts >= 1 such as 1,8,32 or 1-64")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"{text!r}: expected counts >= 1 such as 1,8,32 or 1-64")
    return sorted(out)


def counts_or_none(text: str) -> list[int]:
    """counts(text), or none where text is "" (a phase kind left out)."""
    return counts(text) if text else []


def build_model(name: str, layers: int, dtype: str, device: str):
    """The model `name` (CONFIGS) with `layers` decoder layers, random weights, in `dtype`, on `device`."""
    import transformers

    config_cls, model_cls, dims = CONFIGS[name]
    config = getattr(transformers, config_cls)(num_hidden_layers=layers, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config)
    return model.to(DTYPES[dtype]).eval(), config


def forward_arguments(model) -> tuple[str, dict]:
    """The name the model's forward takes its KV cache by (past_key_values before transformers 5: cache), and the
    argument that keeps only the last position's logits, as generation does (where this version has it)."""
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return ("past_key_values" if "past_key_values" in params else "cache"), last


def static_cache(config, batch: int, length: int, device: str, dtype: torch.dtype = torch.float16):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    wanted = {"config": config, "max_cache_len": length, "max_batch_size": batch, "batch_size": batch,
              "device": device, "dtype": dtype}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # newer: shaped lazily, on the first update
        return StaticCache(config=config, max_cache_len=length)
    return StaticCache(**{k: v for k, v in wanted.items() if k in params})


def make_step(model, eager_model, config, phase: Phase, device: str):
    """A call running the phase's forward through `model` (the same one each time: a decode step writes the same
    cache slot) and returning its logits; a decode's cache is filled with its context by `eager_model` first."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(config.vocab_size, (phase.batch, phase.context + phase.tokens), generator=g).to(device)
    key, last = forward_arguments(eager_model)
    if phase.context == 0:
        return lambda: model(input_ids=ids, use_cache=False, **last).logits
    dtype = next(eager_model.parameters()).dtype
    cache = static_cache(config, phase.batch, phase.context + phase.tokens, device, dtype)
    prompt = torch.arange(phase.context, device=device)
    eager_model(input_ids=ids[:, :phase.context], use_cache=True, cache_position=prompt, **{key: cache})
    step_ids = ids[:, phase.context:]
    position = torch.arange(phase.context, phase.context + phase.tokens, device=device)
    positions = position.expand(phase.batch, -1)
    # transformers 5 counts the tokens a static layer holds on the device and writes where the count says: set it
    # back after each step (one small kernel), so that every step writes the same slot
    counts = [c for layer in getattr(cache, "layers", []) if torch.is_tensor(c := getattr(layer, "cumulative_length",
                                                                                          None))]

    def step():
        logits = model(input_ids=step_ids, use_cache=True, cache_position=position, position_ids=positions, **last,
                       **{key: cache}).logits
        if counts:
            torch._foreach_sub_(counts, phase.tokens)
        return logits

    return step


def settle() -> str:
    """Inductor's compile workers (subprocesses, and the threads that watch them) shut down, so that a host-bound
    timing loop has the CPU and the GIL to itself; what was alive before and after, for the log."""
    def alive() -> str:
        me = str(os.getpid())
        children = sum(1 for stat in Path("/proc").glob("[0-9]*/stat")
                       if _ppid(stat) == me) if Path("/proc/self").exists() else -1
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
        return f"{threading.active_count()} threads, {children} child processes, load {load:.1f}"
    from torch._inductor import async_compile

    before = alive()
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()
    return f"{before} -> {alive()}"


def _ppid(stat: Path) -> str:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def timed(fns: dict[str, callable], rounds: int, inner: int) -> dict[str, tuple[float, float]]:
    """Per function, milliseconds per call: the wall (host clock around `inner` calls and a synchronize) and the
    host's own share (until the last call returned, before the synchronize: where it is near the wall, the steps are
    host-bound), interleaved round by round, the order reversed every other round, after one round not counted; the
    median round of each."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in list(fns.items())[::1 if r % 2 else -1]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            if r:
                times[name].append(((time.perf_counter() - t0) * 1e3 / inner, (issued - t0) * 1e3 / inner))
    return {name: (statistics.median(w for w, _ in ts), statistics.median(h for _, h in ts))
            for name, ts in times.items()}
