"""Where the pipeline cuts the encoder-decoder: which layers each stage runs.

The model's flat layer list (model/t5.py) is

    embed_encoder, encoder block 0 .. E-1, finish_encoder, embed_decoder,
    decoder block 0 .. D-1, finish_decoder, head (with the loss)

and a stage is a contiguous run of it holding at least one block. The small layers go with the
blocks beside them: the embedding with the first encoder block, finish_encoder with the last
encoder block, embed_decoder with the first decoder block, finish_decoder and the head with the
last decoder block.

- With Megatron's `--pipeline-model-parallel-split-rank R`, stages 0 .. R-1 hold the encoder and
  stages R .. P-1 the decoder, each side's blocks spread as evenly as their count allows.
- Without it, the cut minimises the largest stage cost, a stage's cost being the forward FLOPs
  of its layers (model/flops.py): a decoder block costs more than an encoder block
  (cross-attention, and its own K/V projections of the encoder output), and the LM head weighs
  on the last stage. A stage may then hold the end of the encoder and the start of the decoder.

No process group is needed: `--dry-run` and the planner print the same cut the run uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron.model.config import T5Config


@dataclass(frozen=True)
class Cut:
    """Stage s runs blocks `blocks[s]` .. `blocks[s + 1] - 1` of the flat block order (encoder
    blocks 0 .. E-1, then decoder blocks as E .. E+D-1)."""

    encoder_layers: int
    decoder_layers: int
    blocks: Tuple[int, ...]
    split_rank: Optional[int]
    stage_costs: Tuple[float, ...]
    """Forward FLOPs per sample of each stage (embeddings, blocks, norms, head)."""

    @property
    def stages(self) -> int:
        return len(self.blocks) - 1

    def stage_blocks(self, stage: int) -> Tuple[range, range]:
        """(encoder block indices, decoder block indices) that `stage` runs."""
        start, stop = self.blocks[stage], self.blocks[stage + 1]
        e = self.encoder_layers
        return range(min(start, e), min(stop, e)), range(max(start, e) - e, max(stop, e) - e)

    def describe(self) -> List[str]:
        """One line per stage, for the start of a run and --dry-run."""
        total = sum(self.stage_costs) or 1.0
        how = (f"--pipeline-model-parallel-split-rank {self.split_rank}"
               if self.split_rank is not None else "cut by layer cost")
        lines = [f"pipeline: {self.stages} stages, {how}"]
        for s in range(self.stages):
            enc, dec = self.stage_blocks(s)
            parts = []
            if s == 0:
                parts.append("embedding")
            if len(enc):
                parts.append(f"encoder blocks {enc.start}-{enc.stop - 1}")
            if len(enc) and enc.stop == self.encoder_layers:
                parts.append("encoder final norm")
            if len(dec):
                if dec.start == 0:
                    parts.append("decoder embedding")
                parts.append(f"decoder blocks {dec.start}-{dec.stop - 1}")
            if s == self.stages - 1:
                parts.append("decoder final norm, LM head, loss")
            lines.append(f"  stage {s}: {', '.join(parts)} "
                         f"({100 * self.stage_costs[s] / total:.0f}% of the forward FLOPs)")
        return lines


def cut_problems(config: T5Config, pipeline_size: int, split_rank: Optional[int]) -> List[str]:
    """Why the model cannot be cut into `pipeline_size` stages (flags named)."""
    problems = []
    e, d = config.num_layers, config.num_decoder_layers
    p = pipeline_size
    if split_rank is not None:
        if p == 1:
            problems.append(f"--pipeline-model-parallel-split-rank {split_rank} needs "
                            f"--pipeline-model-parallel-size > 1")
        elif not 1 <= split_rank <= p - 1:
            problems.append(f"--pipeline-model-parallel-split-rank {split_rank} is out of range: "
                            f"with --pipeline-model-parallel-size {p} it must be 1 .. {p - 1} "
                            f"(encoder on stages below it, decoder on the others)")
        else:
            if split_rank > e:
                problems.append(f"--pipeline-model-parallel-split-rank {split_rank}: the encoder "
                                f"has {e} blocks, too few for {split_rank} stages")
            if p - split_rank > d:
                problems.append(f"--pipeline-model-parallel-split-rank {split_rank}: the decoder "
                                f"has {d} blocks, too few for {p - split_rank} stages")
    if p > e + d:
        problems.append(f"--pipeline-model-parallel-size {p} is larger than the model's {e + d} "
                        f"blocks ({e} encoder + {d} decoder): every stage needs a block")
    return problems


def layer_costs(config: T5Config, enc_len: int, dec_len: int, vocab_size: int
                ) -> Tuple[List[float], float, float]:
    """(forward FLOPs per sample of each block in flat order, of the first stage's extras, of
    the last stage's extras)."""
    from megatron.model.flops import forward_flops_per_sample

    parts = forward_flops_per_sample(config, enc_len, dec_len, vocab_size)
    e, d = config.num_layers, config.num_decoder_layers
    encoder_block = parts["encoder"] / max(e, 1)
    decoder_block = (parts["decoder"] + parts["cross_kv"]) / max(d, 1)
    embed = (enc_len + dec_len) * config.d_model  # lookups: memory-bound, counted lightly
    return [encoder_block] * e + [decoder_block] * d, embed, parts["lm_head"]


def _balanced(costs: Sequence[float], parts: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> List[int]:
    """Boundaries of `parts` contiguous non-empty runs of `costs` minimising the largest run
    (the first run also pays first_extra, the last last_extra); ties go to the earlier cut."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run(i: int, j: int) -> float:
        cost = prefix[j] - prefix[i]
        if i == 0:
            cost += first_extra
        if j == n:
            cost += last_extra
        return cost

    inf = float("inf")
    # best[k][j]: the smallest largest run cutting costs[:j] into k runs; back[k][j] the cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], run(i, j))
                if value < best[k][j] - 1e-9 * max(value, 1.0):
                    best[k][j], back[k][j] = value, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]


def cut_model(config: T5Config, pipeline_size: int, split_rank: Optional[int] = None,
              enc_len: int = 512, dec_len: int = 128, vocab_size: Optional[int] = None) -> Cut:
    """The stages of `config` on `pipeline_size` stages (see the module docstring).

    Raises:
        ValueError: cut_problems has something to say.
    """
    problems = cut_problems(config, pipeline_size, split_rank)
    if problems:
        raise ValueError("; ".join(problems))
    vocab = vocab_size or config.vocab_size
    costs, first, last = layer_costs(config, enc_len, dec_len, vocab)
    e = config.num_layers
    if split_rank is None:
        blocks = _balanced(costs, pipeline_size, first, last)
    else:
        encoder = _balanced(costs[:e], split_rank)
        decoder = _balanced(costs[e:], pipeline_size - split_rank)
        blocks = encoder[:-1] + [e + b for b in decoder]
    stage_costs = []
    for s in range(pipeline_size):
        cost = sum(costs[blocks[s]:blocks[s + 1]])
        cost += first if s == 0 else 0.0
        cost += last if s == pipeline_size - 1 else 0.0
        stage_costs.append(cost)
    return Cut(e, config.num_decoder_layers, tuple(blocks), split_rank, tuple(stage_costs))


def bubble_fraction(pipeline_size: int, micro_batches: int) -> float:
    """The idle share of a 1F1B (or GPipe) step: (P - 1) / (m + P - 1)."""
    return (pipeline_size - 1) / (micro_batches + pipeline_size - 1)
