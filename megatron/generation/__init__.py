"""Text generation with the model's own layers: a KV cache (cache.py) and the search
algorithms (search.py); the command line is megatron/generate.py."""

from megatron.generation.cache import Decoder, LayerCache
from megatron.generation.search import Hypothesis, beam_search, greedy

__all__ = ["Decoder", "LayerCache", "Hypothesis", "beam_search", "greedy"]
