"""Which checkpoints `--load` reshards into another layout (megatron/checkpoint/io/reshard.py),
what it refuses before a run starts, and the log line. (The loads themselves, bit for bit
against the offline route: tests/training/test_load_at_another_layout.py.)"""

from megatron.checkpoint.io.reshard import layout_line, reshard_problems, reshardable

LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
          "data_parallel_size": 1, "zero_stage": 0}


def meta(precision="fp32", zero=0, **extra):
    return {"layout": {**LAYOUT, "zero_stage": zero}, "model": {"precision": precision},
            "iteration": 2, **extra}


def test_our_model_checkpoints_are_resharded_not_weights_folders_or_prompts():
    assert reshardable(meta())
    assert not reshardable({**meta(), "format": "weights"})  # loads at any layout already
    prompt = {"prompt": "with_model", "prompt_layout": {"length": 4, "ratios": [1.0]},
              "prompt_base": None, "router_type": None}
    assert not reshardable(meta(checkpoint=prompt))


def test_fp16_zero0_optimizer_states_are_refused_naming_the_way_out():
    assert reshard_problems(meta(), False, "--load X") == []
    assert reshard_problems(meta("fp16", zero=1), False, "--load X") == []
    said = reshard_problems(meta("fp16"), False, "--load X")
    assert len(said) == 1 and said[0].startswith("--load X: ")
    assert "TP 2 PP 1 DP 1 EP 1, ZeRO 0" in said[0] and "--no-load-optim" in said[0]
    assert reshard_problems(meta("fp16"), True, "--load X") == []  # the weights alone


def test_the_log_line_names_both_layouts():
    now = {**LAYOUT, "tensor_model_parallel_size": 1, "data_parallel_size": 2,
           "expert_model_parallel_size": 2, "zero_stage": 3}
    assert layout_line(LAYOUT, now) == ("resharding the checkpoint from TP 2 PP 1 DP 1 EP 1 to "
                                        "TP 1 PP 1 DP 2 EP 2 (ZeRO 0 to 3)")
    assert layout_line(LAYOUT, {**LAYOUT, "data_parallel_size": 4}).endswith("DP 4 EP 1")
