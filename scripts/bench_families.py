"""One decode step of 64 requests per model family, at Llama's parameter count, relative to Llama.

Every family is built at SmolLM2-135M's shape (hidden 576, 30 layers, 9
heads over 3 KV heads of 64, vocabulary 49,152) with random weights and its
own switches: Mistral and Phi-3 are Llama's step, Qwen2 adds q/k/v biases,
Qwen3 per-head q/k norms, Gemma its norms, scale and GeGLU (Gemma 2 with
soft-caps on a sliding window, Gemma 3 with q/k norms), and the MoE
families 8 experts of an eighth of the MLP each, 2 per token (the same
parameters, a quarter of the MLP's work). A step is the metadata build, the
forward over 64 decode rows at ``--context`` tokens and the LM head over
them; each family's median CPU time is printed with its ratio to Llama's,
families interleaved round by round so that they share the machine's state.

    python scripts/bench_families.py --threads 1 --repeat 5
    python scripts/bench_families.py --context 1000 --window 256   # sliding layers that cut the context
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.common.model_config import ModelConfig
from pipeline.gpu_worker.models.loader import build_model

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1536 // 8, norm_topk_prob=True)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama", {}),
    "mistral": ("MistralForCausalLM", "mistral", {}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe", MOE),
    "mixtral": ("MixtralForCausalLM", "mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "phi3": ("Phi3ForCausalLM", "phi3", {}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", {"sliding_window_pattern": 6}),
}


def family_model(name: str, window: int, dtype: torch.dtype, backend: str):
    """A random model of family ``name`` at SHAPE (Mixtral's experts: intermediate_size / 8 each)."""
    architecture, model_type, fields = FAMILIES[name]
    cfg = {**SHAPE, "architectures": [architecture], "model_type": model_type, "sliding_window": window, **fields}
    if model_type == "mixtral":
        cfg["intermediate_size"] //= 8
    config = ModelConfig.from_hf(cfg)
    model = build_model(config, dtype, torch.device("cpu"), backend)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.pack_weights()  # as load_model does
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300, help="tokens each request has in the cache")
    parser.add_argument("--window", type=int, default=4096, help="sliding window of the layers that have one")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, bs = getattr(torch, args.dtype), 16
    models = {f: family_model(f, args.window, dtype, args.attention_backend) for f in args.families}
    per_row = -(-(args.context + 1) // bs)
    table = torch.randperm(args.batch * per_row, generator=torch.Generator().manual_seed(1)).view(args.batch, per_row)
    query_lens, starts = torch.ones(args.batch, dtype=torch.int64), torch.full((args.batch,), args.context)
    caches = {f: m.allocate_kv_caches(args.batch * per_row, bs, dtype, torch.device("cpu")) for f, m in models.items()}
    times: dict[str, list[float]] = {f: [] for f in models}
    with torch.inference_mode():
        for r in range(args.repeat + 1):  # round 0 warms up
            for f, model in models.items():
                t0 = time.process_time()
                meta = model.attn_backend.build_from_rows(query_lens, starts, table, bs)
                ids = torch.randint(0, SHAPE["vocab_size"], (args.batch,))
                model.compute_logits(model(ids, meta.positions, meta, caches[f]))
                if r:
                    times[f].append((time.process_time() - t0) * 1e3)
    base = statistics.median(times[args.families[0]])
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype} batch={args.batch} context={args.context} "
        f"window={args.window} repeat={args.repeat} (CPU ms per decode step, median)"
    )
    print(f"{'family':>12} {'params M':>9} {'backend':>15} {'ms':>9} {'/ ' + args.families[0]:>9}")
    for f, model in models.items():
        ms = statistics.median(times[f])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{f:>12} {params:9.1f} {model.attn_backend.name:>15} {ms:9.1f} {ms / base:9.2f}")


if __name__ == "__main__":
    main()
