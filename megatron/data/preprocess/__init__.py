"""The input side of the offline tools: streaming JSONL and sentence splitting."""
