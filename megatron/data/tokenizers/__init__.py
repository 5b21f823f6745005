"""T5's SentencePiece and CPM-2's word-piece tokenizers (docs/data.md)."""
