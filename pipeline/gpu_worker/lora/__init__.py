"""Multi-LoRA serving: PEFT adapters read and checked (``checkpoint``), and the batched low-rank update
wrapped around the base model's projections (``layers``; docs/design.md, "Multi-LoRA")."""
