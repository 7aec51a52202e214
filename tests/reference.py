"""Hugging Face transformers as the reference for greedy outputs."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NEAR_TIE = 1e-3


@functools.lru_cache(maxsize=2)
def load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Like the server's ignore_eos: EOS may be generated, and generation goes on after it.
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by `generate`, going on past EOS.

    Cached: the async and lock-step tests of one model ask for the same
    continuations, and on a 2-core machine the reference costs more than the server.
    """
    return list(_hf_greedy(model_dir, tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model, _ = load(model_dir)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tuple(out[0, len(prompt_ids) :].tolist())


@torch.inference_mode()
def assert_same_greedy(model_dir: str, prompt_ids: list[int], ours: list[int], ref: list[int]) -> None:
    """Token for token, except at a genuine near-tie of the reference's logits.

    Where the two first diverge, the reference logits of the two chosen
    tokens must differ by less than ``NEAR_TIE``; the position is printed
    and the rest is not compared (the contexts differ from there on).
    """
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            model, _ = load(model_dir)
            logits = model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1]
            gap = abs(float(logits[a] - logits[b]))
            print(f"near-tie check at output position {i}: ours {a}, reference {b}, logit gap {gap:.2e}")
            assert gap < NEAR_TIE, f"diverged at position {i}: ours {a} vs reference {b} (logit gap {gap:.3g})"
            return


def ours_from_hf(
    hf_model, dtype: torch.dtype = torch.float32, attention_backend: str = "auto", pack: bool = True, **kwargs
):
    """Our model built from the in-memory transformers model ``hf_model``'s config and filled with its weights,
    then packed as ``load_model`` packs it (``pack``)."""
    from pipeline.common.model_config import ModelConfig
    from pipeline.gpu_worker.models.loader import build_model

    hf_model.config.architectures = [type(hf_model).__name__]
    model = build_model(ModelConfig.from_hf(hf_model.config), dtype, torch.device("cpu"), attention_backend, **kwargs)
    model.load_weights(hf_model.state_dict().items())
    if pack:
        model.pack_weights()
    return model
