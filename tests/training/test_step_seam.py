"""The training-step seam: the loop drives any `TrainStep`. A plain PyTorch implementation (no
DeepSpeed: torch's AdamW, gradient accumulation by hand, torch's clipping) run by the same
entry point gives the losses, gradient norms and evaluations of DeepSpeed's data-parallel step.
"""

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain


def run_with_plain_step(rank, world_size, argv):
    """`pretrain` with the entry point's step builder replaced by a plain PyTorch step."""
    import os

    import torch

    from megatron import parallel_state
    from megatron import pretrain_t5
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed
    from megatron.training.engine import build_model, param_groups
    from megatron.training.step import EvalResult, StepResult, TrainStep, core_metrics, to_device

    class PlainStep(TrainStep):
        def __init__(self, config):
            self.model = build_model(config.model, config.zero, torch.device("cpu"),
                                     config.deepspeed_json())
            opt = config.optimizer
            self.optimizer = torch.optim.AdamW(
                param_groups(self.model, opt.weight_decay), lr=opt.lr,
                betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                weight_decay=opt.weight_decay)
            self.clip = opt.clip_grad
            self.micro_batches = config.batch.gradient_accumulation_steps

        def step(self, batches, lr):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            totals = torch.zeros(3, dtype=torch.float64)
            for _ in range(self.micro_batches):
                batch = to_device(next(batches), torch.device("cpu"))
                out = self.model(**batch)
                (out.loss / self.micro_batches).backward()
                totals += torch.stack([out.loss.detach().double(),
                                       batch["encoder_attention_mask"].sum().double(),
                                       (batch["labels"] != -100).sum().double()])
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(core_metrics(totals[0] / self.micro_batches, totals[1],
                                           totals[2]), float(norm), False, 1.0)

        def eval_step(self, batch):
            batch = to_device(batch, torch.device("cpu"))
            with torch.no_grad():
                out = self.model(**batch)
            return EvalResult(out.token_losses.double().sum(), (batch["labels"] != -100).sum())

        def train(self, mode=True):
            self.model.train(mode)

        def save(self, root, tag, iteration):
            raise NotImplementedError

        def load(self, root, tag, weights_only):
            raise NotImplementedError

    config = parse_args(argv, env=os.environ)
    initialize_distributed(config.runtime, config.parallel)
    pretrain_t5.build_step = lambda config, watchdog, writer: PlainStep(config)
    try:
        state = pretrain_t5.pretrain(config)
    finally:
        parallel_state.destroy_model_parallel()
    return {"losses": dict(state.losses), "grad_norms": dict(state.grad_norms),
            "evals": list(state.evaluations)}


def test_the_loop_runs_a_plain_pytorch_step_like_deepspeeds(train_data):
    argv = base_argv(train_data)  # one process, accumulation 2, fp32, ZeRO 0, clipping 1.0
    plain = run_workers(1, run_with_plain_step, argv, timeout=300)[0]
    deepspeed = run_workers(1, run_pretrain, [argv], timeout=300)[0][0]
    assert sorted(plain["losses"]) == sorted(deepspeed["losses"]) == [1, 2, 3, 4]
    order = sorted(plain["losses"])
    assert [plain["losses"][i] for i in order] == \
        pytest.approx([deepspeed["losses"][i] for i in order], rel=1e-5)
    assert [plain["grad_norms"][i] for i in order] == \
        pytest.approx([deepspeed["grad_norms"][i] for i in order], rel=1e-4)
    assert [e[:2] for e in plain["evals"]] == [e[:2] for e in deepspeed["evals"]]
    assert [e[2] for e in plain["evals"]] == \
        pytest.approx([e[2] for e in deepspeed["evals"]], rel=1e-5)
