"""`python -m megatron.plan`: the best parallel layouts of a model on a cluster, before any GPU
hour is spent.

    cluster.py   the device table (memory, peak TFLOP/s, links) and cluster presets (8x8xH100-80GB)
    search.py    the candidate layouts as trainer command lines, each resolved by the trainer's
                 own flag checks and sized by the `--dry-run` memory estimate
    timing.py    the step-time model: compute, tensor-parallel communication, the pipeline
                 bubble, data-parallel / ZeRO communication, the optimizer step, offload traffic
    planner.py   ranking, what is missing when nothing fits, and the reports (text, --json,
                 --explain)
"""
