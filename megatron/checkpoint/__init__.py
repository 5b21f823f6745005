"""Checkpoint formats and conversion, without process groups (data_tools/convert_checkpoint.py).

One intermediate: full, unpadded tensors under our names (Hugging Face T5's), one at a time.
- deepspeed.py reads any checkpoint the trainer writes (any TP, PP, DP, ZeRO 0-3).
- hf.py writes and reads Hugging Face folders (weights, config, tokenizer).
- weights.py writes a weights-only checkpoint the trainer starts from with --finetune in any
  layout, and loads it into a training step's model.
"""
