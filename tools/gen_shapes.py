"""A seeded shape suite to tune against: linear projections of public LLM configurations at many token counts, plus
random odd sizes. The same seed always writes the same suite.

    python tools/gen_shapes.py --seed 2026 --count 48 > suite.txt
    python tools/gen_shapes.py --seed 7 --count 32 --epilogues > fused.txt

Each line is `M_N_K  # where it comes from` (the shapes-file format `run --shapes` reads): M tokens, N output
features, K input features, as an nn.Linear computes them (`--b-layout nk`) or a matmul by K x N weights (`kn`).
With --epilogues each problem also gets a fused epilogue, every one in turn (core/epilogue.py's, gated ones with N
rounded up to whole 16-column blocks), and a random layout, dtype and bias: `M_N_K:layout:dtype[:bias]:epilogue`, a
suite for a run that looks for false rejections (every candidate that fails there is a kernel or a check to look at).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.epilogue import EPILOGUES, GATE_BLOCK, Epilogue  # noqa: E402
from core.records import Problem  # noqa: E402


@dataclass(frozen=True)
class LlmConfig:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    fused_qkv: bool = False  # GPT-2 and Phi-3 compute q, k and v in one projection


# Public configurations (config.json of each model); GPT-2's vocabulary padded to 50304 as nanoGPT does, since N must
# be a multiple of 8.
MODELS = {
    "gpt2": LlmConfig(768, 3072, 12, 12, 64, 50304, fused_qkv=True),
    "gpt2-medium": LlmConfig(1024, 4096, 16, 16, 64, 50304, fused_qkv=True),
    "gpt2-xl": LlmConfig(1600, 6400, 25, 25, 64, 50304, fused_qkv=True),
    "llama-2-7b": LlmConfig(4096, 11008, 32, 32, 128, 32000),
    "llama-2-13b": LlmConfig(5120, 13824, 40, 40, 128, 32000),
    "llama-2-70b": LlmConfig(8192, 28672, 64, 8, 128, 32000),
    "llama-3-8b": LlmConfig(4096, 14336, 32, 8, 128, 128256),
    "llama-3-70b": LlmConfig(8192, 28672, 64, 8, 128, 128256),
    "mistral-7b": LlmConfig(4096, 14336, 32, 8, 128, 32000),
    "qwen2-0.5b": LlmConfig(896, 4864, 14, 2, 64, 151936),
    "qwen2-1.5b": LlmConfig(1536, 8960, 12, 2, 128, 151936),
    "qwen2-7b": LlmConfig(3584, 18944, 28, 4, 128, 152064),
    "phi-3-mini": LlmConfig(3072, 8192, 32, 32, 96, 32064, fused_qkv=True),
    "gemma-2b": LlmConfig(2048, 16384, 8, 1, 256, 256000),
    "gemma-7b": LlmConfig(3072, 24576, 16, 16, 256, 256000),
}
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 1024, 2048, 3072, 4096, 8192)
# Work cap (M*N*K): keeps a search of the suite within minutes; 2^39 is 8192 tokens through a 8192 x 8192 projection.
MAX_MNK = 2**39
ODD_FRACTION = 0.25


def projections(cfg: LlmConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear layer of one transformer block, and the LM head."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = [("qkv", q + 2 * kv, cfg.hidden)] if cfg.fused_qkv else [("q", q, cfg.hidden), ("kv", kv, cfg.hidden)]
    return attention + [("o", cfg.hidden, q), ("gate_up fused", 2 * cfg.intermediate, cfg.hidden),
                        ("gate/up", cfg.intermediate, cfg.hidden), ("down", cfg.hidden, cfg.intermediate),
                        ("lm_head", cfg.vocab, cfg.hidden)]


def _tokens(rng: random.Random, decode: bool) -> int:
    """Half the draws from the usual batch sizes, half anywhere in the range (real token counts are arbitrary)."""
    if decode:
        return rng.choice(DECODE_TOKENS) if rng.random() < 0.5 else rng.randint(1, 256)
    return rng.choice(PREFILL_TOKENS) if rng.random() < 0.5 else rng.randint(512, 8192)


def _llm_shape(rng: random.Random) -> tuple[int, int, int, str]:
    name = rng.choice(sorted(MODELS))
    proj, n, k = rng.choice(projections(MODELS[name]))
    decode = proj == "lm_head" or rng.random() < 0.4  # logits are computed for the last tokens only
    m = _tokens(rng, decode)
    return m, n, k, f"{name} {proj}, {m} tokens ({'decode' if decode else 'prefill'})"


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _odd_shape(rng: random.Random) -> tuple[int, int, int, str]:
    m = _log_uniform(rng, 1, 16384)
    n, k = (8 * _log_uniform(rng, 1, 2048) for _ in range(2))
    return m, n, k, "random odd size"


def generate(seed: int, count: int) -> list[tuple[Problem, str]]:
    """`count` distinct valid problems (kn layout; the suite holds M, N, K only) with a note on each."""
    rng = random.Random(seed)
    suite: dict[tuple[int, int, int], str] = {}
    for _ in range(1000 * count):
        if len(suite) == count:
            break
        m, n, k, note = _odd_shape(rng) if rng.random() < ODD_FRACTION else _llm_shape(rng)
        if m * n * k > MAX_MNK or (m, n, k) in suite:
            continue
        try:
            Problem(m, n, k)
        except ValueError:  # operands past 32-bit element counts
            continue
        suite[(m, n, k)] = note
    return [(Problem(m, n, k), note) for (m, n, k), note in suite.items()]


def with_epilogues(suite: list[tuple[Problem, str]], seed: int) -> list[tuple[Problem, str]]:
    """The suite's problems, each with a fused epilogue (every one of EPILOGUES but "none" in turn, the order shuffled
    each round), a layout (nk two times in three), a dtype and a bias drawn from `seed`; a gated epilogue's N rounded
    up to whole blocks of gate and up columns. Problems that come out equal are kept once; one too large once rounded
    is dropped."""
    rng = random.Random(f"epilogues {seed}")
    names = [e for e in EPILOGUES if e != "none"]
    order: list[str] = []
    out: dict[Problem, str] = {}
    for problem, note in suite:
        if not order:
            order = rng.sample(names, len(names))
        epilogue = order.pop()
        block = 2 * GATE_BLOCK if Epilogue(epilogue).gated else 1
        n = -(-problem.n // block) * block
        layout, dtype, bias = "nk" if rng.random() < 2 / 3 else "kn", rng.choice(("f16", "bf16")), rng.random() < 0.5
        try:
            out.setdefault(Problem(problem.m, n, problem.k, layout, dtype, bias, epilogue), note)
        except ValueError:  # N rounded up past 32-bit element counts
            continue
    return list(out.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--epilogues", action="store_true",
                    help="give each problem a fused epilogue (every one in turn), a layout, a dtype and a bias")
    args = ap.parse_args(argv)
    if not 1 <= args.count <= 10000:
        print("error: --count must be between 1 and 10000", file=sys.stderr)
        return 2
    suite = generate(args.seed, args.count)
    if args.epilogues:
        suite = with_epilogues(suite, args.seed)
        print(f"# tools/gen_shapes.py --seed {args.seed} --count {args.count} --epilogues: "
              "M_N_K:layout:dtype[:bias]:epilogue a line")
    else:
        print(f"# tools/gen_shapes.py --seed {args.seed} --count {args.count}: M_N_K a line (M tokens, N out, K in)")
    for problem, note in suite:
        print(f"{problem.key:<40} # {note}" if args.epilogues else f"{problem.mnk:<22} # {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
