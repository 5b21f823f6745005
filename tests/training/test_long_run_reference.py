"""300 steps of our trainer against an independent reference: a plain PyTorch loop on Hugging Face
transformers' T5ForConditionalGeneration with torch.optim.AdamW.

Our side is the real entry point (parse_args + pretrain, as the other training tests run it) on
2 gloo processes, ZeRO-1, fp32, dropout 0, with the tiny T5 v1.1 of tests/conftest.py (gated-gelu,
untied head). The reference starts from the weights our trainer built (exported before its
first step, handed to transformers as a Hugging Face folder by megatron/checkpoint/hf.py) and
reads the same samples in the same order (the run's own dataset objects, global batch by global
batch). Everything else it does by itself: the learning rate from Megatron's formula (linear
warmup from 0, cosine decay to a floor; step k, counted from 0, at lr(k)), AdamW's two groups (no
decay on the RMSNorm weights and the relative attention bias), torch.nn.utils.clip_grad_norm_ on
the global gradient, and the step's loss as the mean of its micro-batches' token-mean losses
(Megatron's convention: the gradient is the mean of the micro-batch gradients).

The losses must agree within 1e-5 (relative) at every step, the gradient norms within 1e-4:
errors that every parallel layout shares (the schedule off by one, decay on norms, clipping on
the wrong norm, Adam's hyperparameters, the loss averaging) grow over hundreds of steps where the
few-step equality tests cannot see them. The settings make each of them act (measured: each such
change of the reference moves some step's loss by 2e-3 to 3e-2, while the two sides agree to
2.7e-7 in the loss and 2.8e-5 in the gradient norm, AMD EPYC, torch 2.13 CPU):
- weight decay 1.0, so that decay alone shrinks the weights by about 30% over the run and a
  parameter in the wrong group shows;
- Adam's betas and eps off their defaults (0.98, 1e-5), so that a value lost on the way shows;
- clipping at 0.8, which roughly half of the steps exceed (asserted);
- whole-word masking: with plain span corruption every sample has the same number of labelled
  tokens, so a token-weighted loss would equal the mean over micro-batches; whole words make
  about 1% of the samples shorter (27 of the 2400 here).
"""

import math
import os

import pytest
import torch

from harness import run_workers
from train_workers import run_pretrain

pytestmark = pytest.mark.slow

STEPS = 300
MICRO_BATCH, GLOBAL_BATCH = 2, 8  # 2 ranks x 2 micro-batches (gradient accumulation 2)
MAX_LR, MIN_LR = 2e-3, 2e-4
WARMUP, DECAY = 30, 300  # optimizer steps (cosine decay from WARMUP to DECAY)
WEIGHT_DECAY, CLIP = 1.0, 0.8
BETAS, EPS = (0.9, 0.98), 1e-5
# Measured (python -m pytest tests/training/test_long_run_reference.py -s prints both): losses
# 2.7e-7 (step 58), gradient norms 2.8e-5 (step 81, a norm of 0.675): the gradients of two
# implementations of the model, ours and Hugging Face's, sum in other orders, and the norm of
# 320 k of them shows more of it than the loss. The smallest fault above moves a loss by 2e-3;
# the bounds leave 35x and 3.5x.
RTOL, NORM_RTOL = 1e-5, 1e-4


def lr_at(step):
    """Megatron's cosine schedule, written out: the rate of the step that follows `step` steps."""
    if step <= WARMUP:
        return MAX_LR * step / WARMUP
    if step > DECAY:
        return MIN_LR
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (MAX_LR - MIN_LR)


def argv(data):
    return ["--data-path", data.prefix, "--tokenizer-model", data.spm, "--model-config", data.tiny,
            "--data-cache-path", data.cache, "--split", "100,0,0", "--num-workers", "0",
            "--seed", "11", "--encoder-seq-length", "64", "--whole-word-masking",
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(STEPS), "--eval-iters", "0", "--log-interval", "100",
            "--zero-stage", "1",
            "--lr", str(MAX_LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(DECAY),
            "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP),
            "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS)]


def train_and_export_initial_weights(rank, world_size, argv, path):
    """run_pretrain, with rank 0 saving the full weights the engine starts from to `path`."""
    from megatron import pretrain_t5
    from megatron.model.state_dict import gather_full_state_dict

    build_step = pretrain_t5.build_step

    def build_and_export(config, watchdog, writer):
        step = build_step(config, watchdog, writer)
        if rank == 0:
            torch.save(gather_full_state_dict(step.engine.module), path)
        return step

    pretrain_t5.build_step = build_and_export
    return run_pretrain(rank, world_size, [argv])[0]


def hugging_face_model(initial, model_config, folder):
    """T5ForConditionalGeneration loaded from a Hugging Face folder of `initial` (our names)."""
    from transformers import T5ForConditionalGeneration

    from megatron.checkpoint.formats.hf import write_hf_folder

    write_hf_folder(folder, model_config, initial.items())
    hf = T5ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager")
    assert hf.lm_head.weight is not hf.shared.weight  # v1.1: the head is not tied
    assert not hf.config.scale_decoder_outputs
    state = hf.state_dict()
    for name, tensor in initial.items():
        assert torch.equal(state[name], tensor), name
    return hf.train()


def no_decay_names(hf):
    """Parameters AdamW does not decay: the RMSNorm weights and the relative attention bias."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    names = set()
    for module_name, module in hf.named_modules():
        if isinstance(module, T5LayerNorm) or module_name.endswith("relative_attention_bias"):
            names.update(f"{module_name}.{n}" for n, _ in module.named_parameters())
    return names


def reference_run(hf, dataset):
    """(losses, gradient norms before clipping) of STEPS steps of a plain PyTorch loop."""
    from megatron.training.loaders import collate_tensors

    no_decay = no_decay_names(hf)
    params = dict(hf.named_parameters())
    groups = [{"params": [p for n, p in params.items() if n not in no_decay],
               "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in params.items() if n in no_decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=MAX_LR, betas=BETAS, eps=EPS)
    micro_batches = GLOBAL_BATCH // MICRO_BATCH
    losses, norms = [], []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        # The global batch is samples [step * G, (step + 1) * G), dealt out in micro-batches of
        # consecutive samples (megatron/data/datasets/samplers.py); each weighs 1 / micro_batches.
        for m in range(micro_batches):
            first = step * GLOBAL_BATCH + m * MICRO_BATCH
            batch = collate_tensors([dataset[i] for i in range(first, first + MICRO_BATCH)])
            out = hf(input_ids=batch["encoder_input_ids"],
                     attention_mask=batch["encoder_attention_mask"],
                     decoder_input_ids=batch["decoder_input_ids"],
                     decoder_attention_mask=batch["decoder_attention_mask"],
                     labels=batch["labels"])
            (out.loss / micro_batches).backward()
            loss_sum += out.loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)))
        optimizer.step()
        losses.append(loss_sum / micro_batches)
    return losses, norms


def relative_differences(got, want):
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def test_losses_match_a_plain_pytorch_loop_for_300_steps(train_data, tmp_path):
    from megatron.arguments import parse_args
    from megatron.training.loaders import build_run_datasets

    initial_path = tmp_path / "initial.pt"
    ranks = run_workers(2, train_and_export_initial_weights, argv(train_data), str(initial_path),
                        timeout=900)
    assert ranks[0] == ranks[1]  # both ranks report the same global losses
    ours = ranks[0]
    config = parse_args(argv(train_data), env={**os.environ, "WORLD_SIZE": "2"})
    hf = hugging_face_model(torch.load(initial_path, weights_only=True), config.model.t5,
                            tmp_path / "hf")
    dataset = build_run_datasets(config.data, config.batch)["train"]
    ref_losses, ref_norms = reference_run(hf, dataset)

    assert sorted(ours["losses"]) == list(range(1, STEPS + 1))
    losses = [ours["losses"][i] for i in range(1, STEPS + 1)]
    norms = [ours["grad_norms"][i] for i in range(1, STEPS + 1)]
    differences = relative_differences(losses, ref_losses)
    worst = max(range(STEPS), key=lambda i: differences[i])
    norm_differences = relative_differences(norms, ref_norms)
    worst_norm = max(range(STEPS), key=lambda i: norm_differences[i])
    print(f"largest relative loss difference {differences[worst]:.2e} at step {worst + 1} "
          f"(ours {losses[worst]:.6f}, reference {ref_losses[worst]:.6f}); gradient norms: "
          f"{norm_differences[worst_norm]:.2e} at step {worst_norm + 1} (ours "
          f"{norms[worst_norm]:.6f}, reference {ref_norms[worst_norm]:.6f})")
    # The run does something: the loss falls, clipping acts on some steps and not on others.
    assert sum(losses[-20:]) < 0.8 * sum(losses[:20])
    clipped = sum(n > CLIP for n in ref_norms)
    assert 0.1 * STEPS < clipped < 0.9 * STEPS, clipped
    bad = [(i + 1, losses[i], ref_losses[i]) for i in range(STEPS) if differences[i] > RTOL]
    assert not bad, f"{len(bad)} steps differ by more than {RTOL} (step, ours, reference): " \
                    f"{bad[:5]}"
    assert norms == pytest.approx(ref_norms, rel=NORM_RTOL)
