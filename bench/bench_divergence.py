"""How far a healthy run stays from the divergence guard's thresholds (DivergenceConfig's
defaults, megatron/config/training.py).

Runs the trainer with the given flags under torchrun and records, on rank 0, the numbers every
rank agreed on at each step (divergence.StepSigns, as the guard sees them); then prints the
largest weight growth in one step, the number of exactly-zero gradient norms, and the largest
ratio of a step's loss to the mean of the previous 1, 10 and 100 steps, each beside its
threshold. The quickstart's run (launch/quickstart.sh builds demo/ first):

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/bench_divergence.py \\
        --model-config configs/model/t5-demo.json --tokenizer-model demo/spm.model \\
        --data-path demo/demo_text_document --encoder-seq-length 128 --micro-batch-size 8 \\
        --global-batch-size 16 --train-iters 300 --lr 3e-3 --min-lr 3e-4 \\
        --lr-decay-style cosine --lr-warmup-iters 20 --split 95,4,1 --log-interval 25 \\
        --eval-interval 100 --eval-iters 4 --num-workers 1

Exit status: the trainer's (1 when the guard stopped the run: a margin of less than 1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table  # noqa: E402
from megatron.training import divergence  # noqa: E402
from megatron.config.training import DivergenceConfig  # noqa: E402


def margins(seen: List[Tuple[int, divergence.StepSigns]]) -> List[str]:
    """Lines of a Markdown table: measure, largest seen, threshold."""
    config = DivergenceConfig()
    growth = max((s.weight_growth for _, s in seen if s.weight_growth is not None), default=None)
    zeros = sum(1 for _, s in seen if s.grad_norm == 0.0 and not s.skipped)
    losses = [s.loss for _, s in seen if s.loss is not None]
    rows = [["weight growth in one step", f"{growth:.4f}", f"{config.weight_growth:g}"]
            if growth is not None else ["weight growth in one step", "(not known)", None],
            ["steps with a gradient norm of exactly 0", zeros,
             f"{config.zero_grad_steps} in a row"]]
    for window in (1, 10, config.loss_window):
        ratios = [loss / (sum(losses[i - window:i]) / window)
                  for i, loss in enumerate(losses) if i >= window]
        limit = f"{config.loss_spike_factor:g}" if window == config.loss_window else ""
        rows.append([f"loss / mean of the previous {window}",
                     f"{max(ratios):.4f}" if ratios else "(fewer steps)", limit])
    return markdown_table(["measure", "largest in the run", "threshold"], rows)


def main(argv: List[str]) -> int:
    seen: List[Tuple[int, divergence.StepSigns]] = []
    observe = divergence.DivergenceGuard.observe

    def recording(self, iteration, signs):
        seen.append((iteration, signs))
        return observe(self, iteration, signs)

    divergence.DivergenceGuard.observe = recording
    from megatron.pretrain_t5 import main as pretrain_main

    code = pretrain_main(argv)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\n{len(seen)} steps seen by the divergence guard:")
        print("\n".join(margins(seen)))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
