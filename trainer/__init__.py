"""The reference async GRPO trainer: default model, warm-up, GRPO step, trajectory ingest."""
