"""Decoding over pipeline stages: `PipelineDecoder`, with `Decoder`'s `step` and `reorder`.

Each stage holds its part of the model (stage.py). For each micro-batch:

- the encoder runs stage by stage: each stage with encoder blocks runs them and sends the
  hidden state and the additive encoder mask to the next stage (the stage after the
  embedding receives them: a prompt may have grown the mask);
- the stage with the last encoder block sends the encoder output and its mask to every other
  stage holding decoder blocks; each computes its blocks' cross-attention keys and values once
  (repeated for the beams);
- each step the stage with decoder block 0 embeds the ids, each decoder stage runs its blocks on
  the newest position and sends the hidden state on; the last stage computes the logits
  (gathered over the tensor-parallel ranks) and broadcasts them over the pipeline group, so that
  every rank of the pipeline, with or without decoder blocks, returns the same logits and runs
  the same search (sampling draws from a seeded generator: the same ids everywhere); beam
  search's `reorder` is applied by every stage to its own caches.

Every rank of a pipeline group decodes the same micro-batch: the tensor-parallel rank t of one
stage talks to rank t of the others, through megatron/pipeline/comm.py.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron.generation.cache import Decoder, LayerCache
from megatron.generation.stage import PipelineStage
from megatron.pipeline.comm import broadcast, recv, recv_tensors, send, send_tensors
from megatron.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

class PipelineDecoder:
    """`step(ids) -> logits` and `reorder(rows)` over a pipeline (module docstring): called on
    every rank of the pipeline group, in the same order.

    Args:
        stage: this process's stage.
        encoder_input_ids, encoder_attention_mask: [batch, enc_len], the same on every stage.
        expand: rows per input (beams).
    """

    def __init__(self, stage: PipelineStage, encoder_input_ids: torch.Tensor,
                 encoder_attention_mask: torch.Tensor, expand: int = 1) -> None:
        self.stage, self.model = stage, stage.model
        self.vocab_size = self.model.config.vocab_size
        # the activations' dtype: the parameters' (of any part this stage holds)
        self.dtype = next(p.dtype for p in self.model.parameters() if not p.is_meta)
        with torch.no_grad():
            encoder_output, mask = self._encode(encoder_input_ids, encoder_attention_mask)
            if expand > 1:
                mask = mask.repeat_interleave(expand, dim=0)
            self.encoder_mask = mask  # every stage: its rows (Lockstep reads them)
            self.layers: List[LayerCache] = []
            if encoder_output is not None:
                if expand > 1:
                    encoder_output = encoder_output.repeat_interleave(expand, dim=0)
                self.layers = [LayerCache(kv) for kv in self.model.cross_key_values(
                    encoder_output, stage.decoder_blocks)]
        self.position = 0

    def _encode(self, ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(encoder output, or None on a stage without decoder blocks; additive encoder mask
        [batch, 1, 1, enc_len])."""
        stage, model = self.stage, self.model
        enc, dec = stage.encoder_blocks, stage.decoder_blocks
        carry = model.initial_carry(ids, ids[:, :1], attention_mask, test_time_routing=True)
        if len(enc):
            if enc.start == 0:
                carry = model.embed_encoder(carry)
            else:  # mid-stack: the stack's bias computed here (the relative bias is not sent)
                hidden, mask = recv_tensors((self.dtype, torch.float32),
                                            stage.ranks[stage.stage - 1], stage.device)
                bias = model.encoder_position_bias(hidden, mask)
                carry = carry._replace(hidden=hidden, encoder_mask=mask, position_bias=bias)
            carry = model.run_layers(carry, [model.encoder.block[i] for i in enc])
            if enc.stop < stage.cut.encoder_layers:
                send_tensors((carry.hidden, carry.encoder_mask), stage.ranks[stage.stage + 1])
            else:
                carry = model.finish_encoder(carry)
                for s in stage.decoder_stages():
                    if s != stage.stage:
                        send_tensors((carry.encoder_output, carry.encoder_mask),
                                     stage.ranks[s])
                return (carry.encoder_output if len(dec) else None), carry.encoder_mask
        if len(dec):
            output, mask = recv_tensors((self.dtype, torch.float32),
                                        stage.ranks[stage.finishing_stage], stage.device)
            return output, mask
        return None, carry.encoder_mask

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size] (float32, padding of the vocabulary cut) of the token
        after `ids` [rows], on every stage."""
        stage, model = self.stage, self.model
        dec = stage.decoder_blocks
        rows = ids.shape[0]
        with torch.no_grad():
            logits = None
            if len(dec):
                if dec.start == 0:
                    hidden = model.embed_step(ids[:, None])
                else:
                    hidden = recv((rows, 1, model.config.d_model), self.dtype,
                                  stage.ranks[stage.stage - 1], stage.device)
                hidden = model.decode_blocks(hidden, self.position, self.encoder_mask,
                                             self.layers, dec, test_time_routing=True)
                if stage.is_last:
                    logits = gather_from_tensor_model_parallel_region(
                        model.step_logits(hidden, self.encoder_mask), model.tensor_parallel)
                    logits = logits[:, 0, :self.vocab_size].float().contiguous()
                else:
                    send(hidden, stage.ranks[stage.stage + 1])
            if logits is None:
                logits = torch.empty(rows, self.vocab_size, dtype=torch.float32,
                                     device=stage.device)
            broadcast(logits, stage.ranks[-1], stage.group)
        self.position += 1
        return logits

    def reorder(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.reorder(rows)


def decoder_for(model, encoder_input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor,
                expand: int = 1):
    """A `Decoder` over a whole model, or a `PipelineDecoder` over a `PipelineStage`."""
    if isinstance(model, PipelineStage):
        return PipelineDecoder(model, encoder_input_ids, encoder_attention_mask, expand)
    return Decoder(model, encoder_input_ids, encoder_attention_mask, expand)
