"""The one memory model of a training rank, read by --dry-run, the planner and the benchmarks:
ZeRO's model states, DeepSpeed's buffers and the activations of a micro-batch (the per-layer
terms in model/activations.py, next to the FLOPs in model/flops.py), with and without a
pipeline."""
