"""Evaluation on held-out prompts during training: pass@k and the eval pass."""
