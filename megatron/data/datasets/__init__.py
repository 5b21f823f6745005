"""Training samples over stored tokens: T5, Megatron T5, CPM-2 and UL2 objectives, blends, samplers."""
