"""The memory tests' layouts: a `Layout` (megatron.config) from the few settings a test varies,
at the sizes the tests were written for (bf16, one micro-batch of 512 / 114 tokens)."""

from megatron.config import Layout, ParallelConfig
from megatron.config.training import BatchConfig, PrecisionConfig, ZeroConfig
from megatron.cost.memory import estimate_memory
from megatron.model.settings import ModelConfig


def rank_layout(t5, *, tensor_parallel_size=1, data_parallel_size=1, expert_parallel_size=1,
                zero_stage=0, precision="bf16", offload_optimizer="none", offload_param="none",
                micro_batch_size=1, gradient_accumulation_steps=1, encoder_seq_length=512,
                decoder_seq_length=114, checkpoint_activations=False, checkpoint_num_layers=1,
                make_vocab_size_divisible_by=128, zero_optimization=None) -> Layout:
    """A rank's layout of model `t5`; zero_optimization: DeepSpeed's section (its buckets)."""
    parallel = ParallelConfig(world_size=tensor_parallel_size * data_parallel_size,
                              tensor_model_parallel_size=tensor_parallel_size,
                              data_parallel_size=data_parallel_size,
                              expert_model_parallel_size=expert_parallel_size)
    batch = BatchConfig(micro_batch_size=micro_batch_size,
                        global_batch_size=micro_batch_size * data_parallel_size
                        * gradient_accumulation_steps,
                        gradient_accumulation_steps=gradient_accumulation_steps)
    model = ModelConfig(t5=t5, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                        checkpoint_activations=checkpoint_activations,
                        checkpoint_num_layers=checkpoint_num_layers)
    return Layout(parallel, batch, PrecisionConfig(precision=precision),
                  ZeroConfig(stage=zero_stage, offload_optimizer=offload_optimizer,
                             offload_param=offload_param), model, encoder_seq_length,
                  decoder_seq_length, {"zero_optimization": dict(zero_optimization or {})})


def estimate(t5, *, device_type="cuda", attention_kernel="fused", pipeline_cut=None,
             pipeline_stage=0, **layout):
    """`estimate_memory` of `rank_layout(t5, **layout)`."""
    return estimate_memory(rank_layout(t5, **layout), device_type, attention_kernel,
                           pipeline_cut, pipeline_stage)
