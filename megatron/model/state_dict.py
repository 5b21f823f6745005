"""Full (unsharded, unpadded) state dicts: load into a tensor-parallel model, gather out of one,
and convert to and from Hugging Face T5ForConditionalGeneration names.

Our parameter names are Hugging Face's; the differences are only that Hugging Face also lists
the tied copies (`encoder.embed_tokens.weight`, `decoder.embed_tokens.weight`, and `lm_head.weight`
when tied) and that our vocabulary rows are padded for tensor parallelism. A copy is dropped only
when it equals the embedding; whether a checkpoint's head is tied is decided from its tensors, as
Hugging Face decides it (`from_hf_checkpoint`; for a folder `megatron.checkpoint.formats.hf.read_hf_checkpoint`, or
megatron.checkpoint.formats.hf.read_hf_folder to stream it).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.model.config import T5Config
from megatron.tensor_parallel.layers import shard, unshard

StateDict = Dict[str, torch.Tensor]
VOCAB_PARAMETERS = ("shared.weight", "lm_head.weight")
HF_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Hugging Face checkpoints of some versions carry this unused parameter; it is ignored on load.
HF_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


class StateDictError(ValueError):
    """Names or shapes that do not fit the model; the message lists all of them."""


def from_hf_checkpoint(config: T5Config, hf: StateDict) -> Tuple[T5Config, StateDict]:
    """The model Hugging Face's `from_pretrained` builds from a T5 checkpoint: (our config, our
    full state dict).

    transformers 5.x writes `tie_word_embeddings: true` into every T5 config.json (with the
    decoder-output scaling as its own key, `scale_decoder_outputs`) and decides the tie from the
    tensors when it loads: an `lm_head.weight` that is present and differs from `shared.weight`
    stays a separate head (with a warning), one that is equal or absent is tied. So here: the head
    is untied exactly when the checkpoint holds an `lm_head.weight` that is not equal to the
    embedding, whatever the config's `tie_word_embeddings` says; `scale_decoder_outputs` stays as
    the config has it (`resolve_hf_tie`).

    Args:
        config: read from the checkpoint's config.json (`T5Config.from_json`).
        hf: the checkpoint's tensors under Hugging Face names.

    Raises:
        StateDictError: a tensor that the model would not use (see `from_hf_state_dict`).
    """
    config = resolve_hf_tie(config, hf.get("lm_head.weight"), hf_embedding(hf))
    return config, from_hf_state_dict(hf, config)


def resolve_hf_tie(config: T5Config, lm_head: Optional[torch.Tensor],
                   embedding: Optional[torch.Tensor]) -> T5Config:
    """`config` with `tie_word_embeddings` as Hugging Face decides it from a checkpoint's
    tensors: tied unless an `lm_head.weight` is present and differs from the embedding (None:
    absent). The decoder-output scaling is left as the config has it."""
    tied = lm_head is None or _same(lm_head, embedding)
    if tied != config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=tied)
    return config


def hf_copies(config: T5Config) -> Tuple[str, ...]:
    """The Hugging Face names that are copies of `shared.weight` under `config`."""
    return HF_TIED_COPIES + (("lm_head.weight",) if config.tie_word_embeddings else ())


def hf_embedding_source(names: Iterable[str],
                        copies: Tuple[str, ...] = HF_TIED_COPIES + ("lm_head.weight",)
                        ) -> Optional[str]:
    """The Hugging Face name that holds the embedding: `shared.weight`, or (absent) the first of
    `copies` that is there, as Hugging Face ties them; None if there is none."""
    names = set(names)
    return next((n for n in ("shared.weight", *copies) if n in names), None)


def hf_copy_problem(name: str, tensor: torch.Tensor, embedding) -> Optional[str]:
    """Why the tied copy `name` cannot be dropped (it differs from the embedding), or None."""
    if _same(tensor, embedding):
        return None
    why = ("the config ties the head to the embedding (tie_word_embeddings true), so it "
           "would be lost; read the config with from_hf_checkpoint, which unties it as "
           "Hugging Face does" if name == "lm_head.weight" else
           "this model has one embedding for the encoder and the decoder")
    return f"{name} differs from shared.weight: {why}"


def from_hf_state_dict(hf: StateDict, config: T5Config) -> StateDict:
    """Our full state dict from a Hugging Face T5ForConditionalGeneration one, for `config`.

    Hugging Face also lists the tied copies of the embedding (`encoder.embed_tokens.weight`,
    `decoder.embed_tokens.weight`, and `lm_head.weight` when `config` ties the head); each is
    dropped only if it equals `shared.weight` exactly (it stands in for `shared.weight` when that
    is absent, as in Hugging Face). `HF_IGNORED` is dropped, as Hugging Face drops it.

    Raises:
        StateDictError: a copy that differs from the embedding, so it would be lost: an
            `lm_head.weight` under a tied config (read the config with `from_hf_checkpoint`,
            which unties it as Hugging Face does), or separate encoder / decoder embeddings,
            which this model cannot hold.
    """
    copies = hf_copies(config)
    embedding = hf_embedding(hf, copies)
    out = {k: v for k, v in hf.items() if k not in copies and k not in HF_IGNORED}
    if config.is_moe:
        out = from_switch_names(out, config)
    if embedding is not None:
        out["shared.weight"] = embedding
    problems = [hf_copy_problem(name, hf[name], embedding) for name in copies if name in hf]
    problems = [p for p in problems if p]
    if problems:
        raise StateDictError("Hugging Face state dict: " + "; ".join(problems))
    return out


def hf_embedding(hf: StateDict, copies: Tuple[str, ...] = HF_TIED_COPIES + ("lm_head.weight",)
                 ) -> Optional[torch.Tensor]:
    """`shared.weight`, or (absent) the first of `copies` that is there, as Hugging Face ties
    it; None if there is none."""
    name = hf_embedding_source(hf, copies)
    return None if name is None else hf[name]


def _same(a: torch.Tensor, b) -> bool:
    """Equal shape, dtype and values (Hugging Face's test for tying two checkpoint tensors)."""
    return b is not None and (a is b or (a.shape == b.shape and a.dtype == b.dtype
                                         and torch.equal(a, b)))


def feed_forward_prefix(config: T5Config, stack: str, index: int) -> str:
    """The name of a block's feed-forward sublayer: '{stack}.block.{index}.layer.{1 or 2}'."""
    return f"{stack}.block.{index}.layer.{2 if stack == 'decoder' else 1}"


def _feed_forward_names(config: T5Config):
    """(prefix, sparse) of every block's feed-forward sublayer."""
    for stack in ("encoder", "decoder"):
        decoder = stack == "decoder"
        sparse = set(config.sparse_blocks(decoder))
        for i in range(config.num_decoder_layers if decoder else config.num_layers):
            yield feed_forward_prefix(config, stack, i), i in sparse


def _weight_names(config: T5Config) -> Tuple[str, ...]:
    return ("wi_0", "wi_1", "wo") if config.is_gated_act else ("wi", "wo")


def from_switch_names(hf: StateDict, config: T5Config) -> StateDict:
    """Hugging Face SwitchTransformers names -> ours: a dense block's `mlp` is our
    `DenseReluDense`, a sparse block's experts `mlp.experts.expert_{e}.wi.weight` are stacked
    into `mlp.experts.wi` [experts, ...] (missing experts are left for the caller to report)."""
    out = dict(hf)
    for prefix, sparse in _feed_forward_names(config):
        for w in _weight_names(config):
            if sparse:
                names = [f"{prefix}.mlp.experts.expert_{e}.{w}.weight"
                         for e in range(config.num_experts)]
                if all(n in out for n in names):
                    out[f"{prefix}.mlp.experts.{w}"] = torch.stack([out.pop(n) for n in names])
            elif f"{prefix}.mlp.{w}.weight" in out:
                out[f"{prefix}.DenseReluDense.{w}.weight"] = out.pop(f"{prefix}.mlp.{w}.weight")
    return out


def to_switch_names(full: StateDict, config: T5Config) -> StateDict:
    """Ours -> Hugging Face SwitchTransformers names (`from_switch_names` reversed)."""
    out = dict(full)
    for prefix, sparse in _feed_forward_names(config):
        for w in _weight_names(config):
            if sparse:
                stacked = out.pop(f"{prefix}.mlp.experts.{w}")
                for e in range(config.num_experts):
                    out[f"{prefix}.mlp.experts.expert_{e}.{w}.weight"] = stacked[e]
            else:
                out[f"{prefix}.mlp.{w}.weight"] = out.pop(f"{prefix}.DenseReluDense.{w}.weight")
    return out


def switch_shapes(shapes: Dict[str, Tuple[int, ...]], config: T5Config
                  ) -> Dict[str, Tuple[int, ...]]:
    """Our full parameter shapes under SwitchTransformers names (an expert's shape without the
    experts dimension)."""
    out = dict(shapes)
    for prefix, sparse in _feed_forward_names(config):
        for w in _weight_names(config):
            if sparse:
                shape = tuple(out.pop(f"{prefix}.mlp.experts.{w}"))
                for e in range(config.num_experts):
                    out[f"{prefix}.mlp.experts.expert_{e}.{w}.weight"] = shape[1:]
            else:
                out[f"{prefix}.mlp.{w}.weight"] = out.pop(f"{prefix}.DenseReluDense.{w}.weight")
    return out


def stack_switch_experts(named: Iterable[Tuple[str, torch.Tensor]], config: T5Config):
    """A stream of (SwitchTransformers name, tensor) -> (our name, tensor): each expert tensor is
    held until its layer's every expert has come, then they are yielded stacked."""
    pending: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, tensor in named:
        parts = name.split(".")
        if ".mlp.experts.expert_" in name:
            at = parts.index("experts")
            ours = ".".join(parts[:at + 1] + [parts[at + 2]])
            experts = pending.setdefault(ours, {})
            experts[int(parts[at + 1].removeprefix("expert_"))] = tensor
            if len(experts) == config.num_experts:
                yield ours, torch.stack([experts[e] for e in range(config.num_experts)])
                del pending[ours]
        elif parts[-3:-1] in (["mlp", "wi"], ["mlp", "wi_0"], ["mlp", "wi_1"], ["mlp", "wo"]):
            yield ".".join(parts[:-3] + ["DenseReluDense"] + parts[-2:]), tensor
        else:
            yield name, tensor
    if pending:  # (the names were checked before: only a truncated stream ends here)
        raise StateDictError(f"experts missing for {', '.join(sorted(pending))}")


def to_hf_state_dict(full: StateDict, config: T5Config) -> StateDict:
    """A Hugging Face T5ForConditionalGeneration (SwitchTransformersForConditionalGeneration
    for a Mixture-of-Experts config) state dict from our full one."""
    out = to_switch_names(full, config) if config.is_moe else dict(full)
    for name in HF_TIED_COPIES:
        out[name] = full["shared.weight"]
    if config.tie_word_embeddings:
        out["lm_head.weight"] = full["shared.weight"]
    return out


def persistent_buffers(module: torch.nn.Module) -> Tuple[str, ...]:
    """The names of the module's state that is not a parameter (the experts' routing biases of
    `moe_expert_bias`): in its state_dict, so in checkpoints."""
    params = {name for name, _ in module.named_parameters()}
    return tuple(name for name in module.state_dict(keep_vars=True) if name not in params)


def load_full_state_dict(model: torch.nn.Module, full: StateDict,
                         held_only: bool = False) -> None:
    """Pad the vocabulary rows, keep the model's tensor-parallel shard (`model.tensor_parallel`),
    load (strict for parameters; the persistent buffers `full` holds are loaded too).

    held_only: the parameters and buffers on the meta device are not this process's (a
        pipeline stage's model holds only its parts, megatron/generation/stage.py): they are
        neither loaded nor missing, and their names in `full` are not unexpected.

    Raises:
        StateDictError: missing or unexpected names, or shapes that differ, all listed.
    """
    params = dict(model.named_parameters())
    buffers = {name: model.get_buffer(name) for name in persistent_buffers(model)}
    elsewhere = set()
    if held_only:
        elsewhere = {n for n, t in (*params.items(), *buffers.items()) if t.is_meta}
        params = {n: p for n, p in params.items() if n not in elsewhere}
        buffers = {n: b for n, b in buffers.items() if n not in elsewhere}
    tp = model.tensor_parallel
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params) - set(buffers) - elsewhere)
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    local = {}
    vocab = model.config.vocab_size
    for name, param in params.items():
        if name not in full:
            continue
        tensor = full[name]
        if name in VOCAB_PARAMETERS:
            if tensor.shape[0] != vocab:
                problems.append(f"{name}: {tensor.shape[0]} rows, the config's vocab_size is "
                                f"{vocab}")
                continue
            rows = model.padded_vocab_size - vocab
            tensor = torch.cat([tensor, tensor.new_zeros(rows, *tensor.shape[1:])])
        if getattr(param, "expert_parallel", False):
            tensor = _local_experts(tensor, model.expert_parallel)
        if getattr(param, "tensor_model_parallel", False):
            tensor = shard(tensor, param.partition_dim, param.partition_stride, tp.rank, tp.size)
        if tensor.shape != param.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit "
                            f"{tuple(param.shape)}")
            continue
        local[name] = tensor
    for name, buffer in buffers.items():  # replicated (CPM-2's centroids, expert biases)
        if name in full and full[name].shape != buffer.shape:
            problems.append(f"{name}: shape {tuple(full[name].shape)} does not fit "
                            f"{tuple(buffer.shape)}")
    if problems:
        raise StateDictError("state dict does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in local.items():
            params[name].copy_(tensor)
        for name, buffer in buffers.items():
            if name in full:
                buffer.copy_(full[name])


def _local_experts(tensor: torch.Tensor, ep) -> torch.Tensor:
    """This expert-parallel rank's experts of a stacked [experts, ...] tensor."""
    if ep is None or ep.size == 1 or tensor.shape[0] % ep.size:
        return tensor  # (a count that does not divide is reported as a shape mismatch)
    local = tensor.shape[0] // ep.size
    return tensor[ep.rank * local:(ep.rank + 1) * local]


def gather_full_state_dict(model: torch.nn.Module, grads: bool = False) -> StateDict:
    """The full parameters (or their gradients) of a tensor-parallel model, vocabulary unpadded;
    every tensor rank gets the whole dict, with the persistent buffers (replicated). Parameters
    without a gradient are left out when `grads` is set, and so are the buffers."""
    tp = model.tensor_parallel
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            continue
        if tp.size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(tp.size)]
            dist.all_gather(parts, tensor.contiguous(), group=tp.group)
            tensor = unshard(parts, param.partition_dim, param.partition_stride)
        ep = getattr(model, "expert_parallel", None)
        if getattr(param, "expert_parallel", False) and ep.size > 1:
            parts = [torch.empty_like(tensor) for _ in range(ep.size)]
            dist.all_gather(parts, tensor.contiguous(), group=ep.group)
            tensor = torch.cat(parts)
        if name in VOCAB_PARAMETERS:
            tensor = tensor[:model.config.vocab_size]
        out[name] = tensor.clone()
    if not grads:
        for name in persistent_buffers(model):
            out[name] = model.get_buffer(name).detach().clone()
    return out

