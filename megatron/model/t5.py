"""The T5 encoder-decoder: shared embedding -> encoder blocks -> decoder blocks -> LM head.

The model is a flat sequence of layers (`T5Model.layers()`), each taking and returning one
`Carry`, so a pipeline stage can be cut between any two of them:

    embed_encoder, encoder.block[0..], finish_encoder, embed_decoder, decoder.block[0..],
    finish_decoder

followed by the head (`lm_logits`) and the loss. Parameter names are Hugging Face's
T5ForConditionalGeneration names (`shared`, `encoder.block.N...`, `decoder.final_layer_norm`,
`lm_head` when untied). The vocabulary is padded to a multiple of make_vocab_size_divisible_by x
TP; the padded logits are excluded from the loss and from the logits' meaning.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch
from torch import nn

from megatron.model.config import ConfigError, T5Config
from megatron.model.dropout import Dropout
from megatron.model.prompt import place_prompt
from megatron.model.transformer import ATTENTION_BACKENDS, Carry, InitMethods, T5Block, \
    T5LayerNorm, attention_dtype, relative_bias_at, stack_position_bias
from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, ExpertParallel, TensorParallel
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from megatron.tensor_parallel.random import checkpoint, init_rng



class T5Output(NamedTuple):
    """logits: [batch, dec_len, padded vocab / TP], this rank's vocabulary slice.
    loss: mean over the labelled tokens (None without labels).
    token_losses: [batch, dec_len], 0 where labels are -100 (None without labels).

    A tuple, so DeepSpeed's ZeRO-3 module hooks see the tensors it holds."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    token_losses: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None
    """The sparse blocks' weighted balancing losses (training; None in a dense model)."""

    @property
    def objective(self) -> Optional[torch.Tensor]:
        """What training minimises: the loss plus the balancing losses."""
        if self.aux_loss is None or self.loss is None:
            return self.loss
        return self.loss + self.aux_loss


def model_parallel_problems(config: T5Config, tensor_parallel_size: int,
                            expert_parallel_size: int = 1) -> List[str]:
    """What keeps `config` from being split over `tensor_parallel_size` ranks (and its experts
    over `expert_parallel_size`)."""
    out = []
    if expert_parallel_size > 1 and not config.is_moe:
        out.append(f"expert-model-parallel size {expert_parallel_size} needs a Mixture-of-"
                   "Experts model (num_experts)")
    elif config.is_moe and config.num_experts % expert_parallel_size:
        out.append(f"num_experts ({config.num_experts}) is not divisible by the "
                   f"expert-model-parallel size {expert_parallel_size}")
    for name, value in (("num_heads", config.num_heads), ("d_ff", config.d_ff)):
        if value % tensor_parallel_size:
            out.append(f"{name} ({value}) is not divisible by the tensor-model-parallel size "
                       f"{tensor_parallel_size}")
    return out


class T5Stack(nn.Module):
    def __init__(self, config: T5Config, is_decoder: bool, backend: str, tp: TensorParallel,
                 device=None, dtype=None, ep: ExpertParallel = NO_EXPERT_PARALLEL) -> None:
        super().__init__()
        num_layers = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = nn.ModuleList([build_block(config, is_decoder, i, backend, tp,
                                                device=device, dtype=dtype, ep=ep)
                                    for i in range(num_layers)])
        self.final_layer_norm = final_layer_norm(config, device, dtype)


class T5Model(nn.Module):
    """T5 / T5 v1.1 / CPM-2 for span-corruption pretraining, tensor-parallel through its layers.

    Args:
        config: the architecture.
        make_vocab_size_divisible_by: the embedding is padded to a multiple of this x TP.
        attention_backend: 'auto', 'sdpa' (torch.nn.functional.scaled_dot_product_attention) or
            'eager'.
        checkpoint_activations: recompute blocks in backward, `checkpoint_num_layers` at a time.
        label_smoothing: of the cross entropy.
        device, dtype: of the parameters ('meta' builds without memory or initialization).
        tensor_parallel: which tensor-parallel shard to build, and the group its collectives
            run on; default: this process's, read from megatron.parallel_state here and nowhere
            below. With explicit sizes on the meta device, any rank's model of any layout is
            built without process groups.
        expert_parallel: which experts to build (a Mixture-of-Experts config) and the group
            their all-to-all runs on; default: this process's, as for tensor_parallel.

    Raises:
        ConfigError: the config cannot be split over the tensor-parallel ranks.
    """

    def __init__(self, config: T5Config, make_vocab_size_divisible_by: int = 128,
                 attention_backend: str = "auto", checkpoint_activations: bool = False,
                 checkpoint_num_layers: int = 1, label_smoothing: float = 0.0, device=None,
                 dtype=None, tensor_parallel: Optional[TensorParallel] = None,
                 expert_parallel: Optional[ExpertParallel] = None) -> None:
        super().__init__()
        tp = tensor_parallel or TensorParallel.of_this_process()
        ep = expert_parallel or ExpertParallel.of_this_process()
        problems = model_parallel_problems(config, tp.size, ep.size)
        if attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"attention backend {attention_backend!r} is not one of "
                            f"{', '.join(ATTENTION_BACKENDS)}")
        if checkpoint_num_layers < 1:
            problems.append(f"checkpoint_num_layers must be at least 1, not "
                            f"{checkpoint_num_layers}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.config, self.tensor_parallel, self.expert_parallel = config, tp, ep
        self.padded_vocab_size = config.padded_vocab_size(make_vocab_size_divisible_by, tp.size)
        self.checkpoint_activations = checkpoint_activations
        self.checkpoint_num_layers = checkpoint_num_layers
        self.label_smoothing = label_smoothing
        # Each part draws its weights from its own stream (init_rng): the same weights
        # whichever parts a process builds (pipeline stages build only theirs, with the same
        # builders: build_block, shared_embedding, untied_lm_head, final_layer_norm).
        self.shared = shared_embedding(config, self.padded_vocab_size, tp, device, dtype)
        self.encoder = T5Stack(config, False, attention_backend, tp, device, dtype, ep)
        self.decoder = T5Stack(config, True, attention_backend, tp, device, dtype, ep)
        if not config.tie_word_embeddings:
            self.lm_head = untied_lm_head(config, self.padded_vocab_size, tp, device, dtype)
        self.dropout = Dropout(config.dropout_rate)
        self.prompt = None  # prompt tuning: a PromptEncoder (megatron/model/prompt.py)

    # The flat layer list ----------------------------------------------------------------------
    def embed_encoder(self, carry: Carry) -> Carry:
        """carry.hidden holds the encoder input ids on entry; with a prompt, its vectors are
        placed among them (the encoder input and its mask grow by the prompt's length)."""
        if self.prompt is None:
            return carry._replace(hidden=self.dropout(self.shared(carry.hidden)))
        ids, keep = place_prompt(carry.hidden, carry.encoder_mask[:, 0, 0, :] == 0,
                                 self.prompt.layout)
        return carry._replace(hidden=self.dropout(self.prompt(ids, self.shared)),
                              encoder_mask=additive_encoder_mask(keep))

    def finish_encoder(self, carry: Carry) -> Carry:
        output = self.dropout(self.encoder.final_layer_norm(carry.hidden))
        return carry._replace(hidden=None, encoder_output=output, position_bias=None)

    def embed_decoder(self, carry: Carry) -> Carry:
        return carry._replace(hidden=self.dropout(self.shared(carry.decoder_input_ids)),
                              position_bias=None)

    def finish_decoder(self, carry: Carry) -> Carry:
        hidden = self.dropout(self.decoder.final_layer_norm(carry.hidden))
        if self.config.scale_decoder_outputs:
            hidden = hidden * (self.config.d_model ** -0.5)
        return carry._replace(hidden=hidden)

    def layers(self) -> List[Callable[[Carry], Carry]]:
        return [self.embed_encoder, *self.encoder.block, self.finish_encoder,
                self.embed_decoder, *self.decoder.block, self.finish_decoder]

    # Head and loss ----------------------------------------------------------------------------
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, dec_len, padded vocab / TP]."""
        if self.config.tie_word_embeddings:
            return parallel_lm_logits(hidden, self.shared)
        return self.lm_head(hidden)

    def head_flops(self, decoder_length: int) -> int:
        """Forward FLOPs of one sample's logits over the padded vocabulary."""
        return head_flops(self.shared if self.config.tie_word_embeddings else self.lm_head,
                          decoder_length)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor):
        """(mean loss over labelled tokens, per-token losses)."""
        token_losses = vocab_parallel_cross_entropy(logits, labels, self.config.vocab_size,
                                                    label_smoothing=self.label_smoothing,
                                                    tp=self.tensor_parallel)
        count = (labels != -100).sum().clamp(min=1)
        return token_losses.sum() / count, token_losses

    # Whole model ------------------------------------------------------------------------------
    @staticmethod
    def initial_carry(encoder_input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                      encoder_attention_mask: Optional[torch.Tensor] = None,
                      decoder_attention_mask: Optional[torch.Tensor] = None,
                      test_time_routing: bool = False) -> Carry:
        """The carry entering the first layer: ids and additive masks (float32), and whether
        the sparse blocks route as at test time (Carry)."""
        device = encoder_input_ids.device
        batch, enc_len = encoder_input_ids.shape
        dec_len = decoder_input_ids.shape[1]
        if encoder_attention_mask is None:
            encoder_attention_mask = torch.ones(batch, enc_len, dtype=torch.long, device=device)
        encoder_mask = additive_encoder_mask(encoder_attention_mask)
        decoder_mask = additive_decoder_mask(decoder_attention_mask, batch, dec_len, device)
        return Carry(hidden=encoder_input_ids, encoder_output=None, encoder_mask=encoder_mask,
                     decoder_mask=decoder_mask, position_bias=None,
                     decoder_input_ids=decoder_input_ids, test_time_routing=test_time_routing)

    def run_layers(self, carry: Carry, layers=None) -> Carry:
        """Run layers (default: all) on a carry, checkpointing blocks when configured."""
        layers = self.layers() if layers is None else layers
        recompute = self.checkpoint_activations and torch.is_grad_enabled()
        i = 0
        while i < len(layers):
            if recompute and isinstance(layers[i], T5Block):
                j = i
                while (j < len(layers) and j - i < self.checkpoint_num_layers
                       and isinstance(layers[j], T5Block)
                       and layers[j].is_decoder == layers[i].is_decoder):
                    j += 1
                carry = Carry(*checkpoint(_chunk_runner(layers[i:j]), *carry))
                i = j
            else:
                carry = layers[i](carry)
                i += 1
        return carry

    def forward(self, encoder_input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                encoder_attention_mask: Optional[torch.Tensor] = None,
                decoder_attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                test_time_routing: bool = False) -> T5Output:
        carry = self.initial_carry(encoder_input_ids, decoder_input_ids, encoder_attention_mask,
                                   decoder_attention_mask, test_time_routing)
        carry = self.run_layers(carry)
        logits = self.lm_logits(carry.hidden)
        if labels is None:
            return T5Output(logits=logits, aux_loss=carry.aux_loss)
        loss, token_losses = self.loss(logits, labels)
        return T5Output(logits=logits, loss=loss, token_losses=token_losses,
                        aux_loss=carry.aux_loss)

    # Incremental decoding (megatron/generation/) ----------------------------------------------
    def encode(self, encoder_input_ids: torch.Tensor,
               encoder_attention_mask: Optional[torch.Tensor] = None,
               test_time_routing: bool = False):
        """(encoder output [batch, enc_len, d_model], additive encoder mask [batch, 1, 1,
        enc_len]): the encoder's layers of `forward`, run once before decoding."""
        carry = self.initial_carry(encoder_input_ids, encoder_input_ids[:, :1],
                                   encoder_attention_mask, test_time_routing=test_time_routing)
        carry = self.run_layers(carry, self.layers()[:len(self.encoder.block) + 2])
        return carry.encoder_output, carry.encoder_mask

    def encoder_position_bias(self, hidden: torch.Tensor, encoder_mask: torch.Tensor
                              ) -> torch.Tensor:
        """The encoder stack's self-attention bias (relative position bias plus the additive
        mask [batch, 1, 1, enc_len]) for `hidden` [batch, enc_len, d_model], from block 0's
        table: what a pipeline stage starting mid-stack computes (it holds that table too)
        instead of receiving it."""
        compute_bias = self.encoder.block[0].layer[0].SelfAttention.compute_bias
        return stack_position_bias(compute_bias, encoder_mask, hidden)

    def cross_key_values(self, encoder_output: torch.Tensor, blocks: Optional[range] = None):
        """Each decoder block's cross-attention (key, value) of the encoder output (`blocks`:
        those decoder blocks only, a pipeline stage's; default all)."""
        blocks = range(len(self.decoder.block)) if blocks is None else blocks
        return [self.decoder.block[i].layer[1].EncDecAttention.key_value(encoder_output)
                for i in blocks]

    def decode_step(self, decoder_input_ids: torch.Tensor, position: int, encoder_mask,
                    layer_caches, test_time_routing: bool = False) -> torch.Tensor:
        """Logits [batch, 1, padded vocab / TP] of the next token after `decoder_input_ids`
        [batch, 1], the token at decoder position `position`; `layer_caches` (one per decoder
        block, megatron/generation/cache.py) hold the earlier positions' keys and values and
        take this one's. The relative position bias is computed for this position only;
        `test_time_routing`: the sparse blocks' routing (Carry)."""
        hidden = self.embed_step(decoder_input_ids)
        hidden = self.decode_blocks(hidden, position, encoder_mask, layer_caches,
                                    test_time_routing=test_time_routing)
        return self.step_logits(hidden, encoder_mask)

    # decode_step's three parts, which pipeline stages run apart (megatron/generation/pipeline.py)
    def embed_step(self, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, 1, d_model]: the decoder's input embedding of one position's ids."""
        return self.dropout(self.shared(decoder_input_ids))

    def decode_blocks(self, hidden: torch.Tensor, position: int, encoder_mask, layer_caches,
                      blocks: Optional[range] = None,
                      test_time_routing: bool = False) -> torch.Tensor:
        """Decoder blocks `blocks` (default all; one cache each) on one position's hidden
        [batch, 1, d_model]; the bias comes from block 0's table (a pipeline stage holding
        later blocks holds that table too)."""
        blocks = range(len(self.decoder.block)) if blocks is None else blocks
        table = self.decoder.block[0].layer[0].SelfAttention.relative_attention_bias
        bias = relative_bias_at(table, self.config, True, position, position + 1)
        dtype = attention_dtype(hidden)
        if dtype in (torch.float16, torch.bfloat16):
            bias = bias.to(dtype)
        for index, cache in zip(blocks, layer_caches):
            hidden = self.decoder.block[index].decode_step(hidden, bias, encoder_mask, cache,
                                                           test_time_routing)
        return hidden

    def step_logits(self, hidden: torch.Tensor, encoder_mask=None) -> torch.Tensor:
        """[batch, 1, padded vocab / TP]: the decoder's final norm and the head."""
        carry = Carry(hidden=hidden, encoder_output=None, encoder_mask=encoder_mask,
                      decoder_mask=None, position_bias=None, decoder_input_ids=None)
        return self.lm_logits(self.finish_decoder(carry).hidden)


_MINIMUM = torch.finfo(torch.float32).min


def additive_encoder_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, 1, 1, enc_len] float32: 0 where attended, the float32 minimum at padding."""
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    return torch.where(attention_mask.bool()[:, None, None, :], zero, _MINIMUM)


def additive_decoder_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int,
                          device) -> torch.Tensor:
    """[batch, 1, dec_len, dec_len] float32: causal, and padding keys masked."""
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.where(keep, zero, _MINIMUM).expand(batch, 1, length, length)


# The model's parts, each from its own init stream; T5Model and the pipeline's stages
# (pipeline/module.py) build them with these, by name.
def build_block(config: T5Config, is_decoder: bool, index: int, backend: str,
                tp: TensorParallel, has_relative_attention_bias: Optional[bool] = None,
                device=None, dtype=None, ep: ExpertParallel = NO_EXPERT_PARALLEL) -> T5Block:
    """Block `index` of the encoder or the decoder; block 0 holds the stack's bias table unless
    `has_relative_attention_bias` says otherwise (a pipeline stage keeps the table apart); a
    sparse block (config.sparse_blocks) holds this rank's experts of `ep`."""
    stack = "decoder" if is_decoder else "encoder"
    layers = config.num_decoder_layers if is_decoder else config.num_layers
    if has_relative_attention_bias is None:
        has_relative_attention_bias = index == 0
    sparse = config.sparse_blocks(is_decoder)
    with init_rng(f"{stack}.block.{index}"):
        return T5Block(config, InitMethods(config, layers), is_decoder,
                       has_relative_attention_bias, backend=backend, tp=tp, ep=ep,
                       sparse_layers=len(sparse) if index in sparse else 0, device=device,
                       dtype=dtype)


def final_layer_norm(config: T5Config, device=None, dtype=None) -> T5LayerNorm:
    return T5LayerNorm(config.d_model, config.layer_norm_epsilon, device, dtype)


def shared_embedding(config: T5Config, padded_vocab_size: int, tp: TensorParallel,
                     device=None, dtype=None) -> VocabParallelEmbedding:
    """The embedding shared by the encoder, the decoder and (tied) the LM head."""
    init = InitMethods(config, config.num_layers)
    with init_rng("shared"):
        return VocabParallelEmbedding(padded_vocab_size, config.d_model, tp=tp,
                                      init_method=init("embedding"), init_size=config.vocab_size,
                                      device=device, dtype=dtype)


def untied_lm_head(config: T5Config, padded_vocab_size: int, tp: TensorParallel,
                   device=None, dtype=None) -> ColumnParallelLinear:
    init = InitMethods(config, config.num_layers)
    with init_rng("lm_head"):
        return ColumnParallelLinear(config.d_model, padded_vocab_size, tp=tp,
                                    init_method=init("lm_head"), init_size=config.vocab_size,
                                    device=device, dtype=dtype)


def head_flops(head, decoder_length: int) -> int:
    """Forward FLOPs of one sample's logits from the module that computes them: the shared
    embedding when the head is tied, the LM head otherwise."""
    if isinstance(head, VocabParallelEmbedding):
        return head.logits_flops(decoder_length)
    return head.forward_flops(decoder_length)


def compile_blocks(model: nn.Module) -> int:
    """torch.compile every transformer block of `model` in place (names and parameters stay;
    the first call of each shape compiles, a new shape compiles again); returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, T5Block)]
    for block in blocks:
        block.compile(dynamic=False)
    return len(blocks)


def _chunk_runner(blocks):
    def run(*fields):
        carry = Carry(*fields)
        for block in blocks:
            carry = block(carry)
        return tuple(carry)
    return run
