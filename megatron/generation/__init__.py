"""Text generation with the model's own layers: a KV cache (cache.py), the decoding settings
(settings.py), their logits processors (processors.py) and the search algorithms (search.py);
the command line is megatron/generate.py."""

from megatron.generation.cache import Decoder, LayerCache
from megatron.generation.search import Hypothesis, beam_search, greedy, sample, search
from megatron.generation.settings import DecodingSettings, SpecialTokens

__all__ = ["Decoder", "LayerCache", "DecodingSettings", "SpecialTokens", "Hypothesis",
           "beam_search", "greedy", "sample", "search"]
