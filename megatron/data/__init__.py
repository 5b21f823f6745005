"""The data path, from text to training batches (docs/data.md).

- `tokenizers/`: T5's SentencePiece tokenizer, CPM-2's word-piece tokenizer (with its jieba
  segmenter), and the names every other module reads from either.
- `preprocess/`: the offline tools' input side: streaming JSONL, sentence splitting.
- `storage/`: Megatron's `.bin/.idx` format (reader, writer, the `.meta.json` sidecar), index
  caches, and data on S3-compatible object storage (ranged GETs, read-ahead).
- `datasets/`: the training objectives over stored tokens (T5 span corruption, Megatron's T5,
  CPM-2's offline-corrupted data, UL2), blends and splits (`builder.py`), and the resumable
  data-parallel samplers.
- `data_args.py`: the data flags, shared by training and `data_tools/`.
- `_helpers`: the C++ index builders (csrc/, built by setup.py).
"""
