"""What megatron/deepspeed_internals.py relies on, pinned against the installed
DeepSpeed: an upgrade that changes one of these behaviours fails here, in the test named after
it. Two real ranks (gloo, data-parallel size 2) build small DeepSpeed engines once (ZeRO-0,
ZeRO-1, ZeRO-3) and record what each adapter function sees; the tests compare it with what the
function promises, computed from the same tensors."""

import inspect
import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # the harness

from megatron import deepspeed_internals as ds  # noqa: E402

pytestmark = pytest.mark.slow


def _engine(model, stage, optimizer=None, clipping=0.0):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
              "gradient_clipping": clipping, "zero_optimization": {"stage": stage}}
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    return engine


def _step(engine, rank):
    x = torch.full((2, 4), float(rank + 1))
    loss = engine(x).square().sum()
    engine.backward(loss)
    engine.step()


def _checked(out, key, fn):
    """out[key] = fn(), or the error it raised (one broken behaviour fails only its test)."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 - reported by the test that reads `key`
        out[key] = f"raised {type(e).__name__}: {e}"


def _expert_groups(rank):
    from deepspeed.utils import groups

    from megatron import parallel_state

    parallel_state.initialize_model_parallel(1, 1, 2)
    groups._EXPERT_PARALLEL_GROUP["ep_size_8"] = None  # a destroyed group of an earlier run
    name = ds.expert_group_name(2)
    ds.register_expert_groups(name, parallel_state.get_expert_model_parallel_group(),
                              parallel_state.get_expert_model_parallel_ranks(),
                              parallel_state.get_expert_data_parallel_group(),
                              parallel_state.get_expert_data_parallel_ranks())
    return {"name": name,
            "ep_group_is_ours": groups._get_expert_parallel_group(name)
            is parallel_state.get_expert_model_parallel_group(),
            "edp_group_is_ours": groups._get_expert_data_parallel_group(name)
            is parallel_state.get_expert_data_parallel_group(),
            "ep_ranks": list(groups._get_expert_parallel_group_ranks(name)),
            "edp_ranks": list(groups._get_expert_data_parallel_group_ranks(name)),
            "our_ep_ranks": list(parallel_state.get_expert_model_parallel_ranks()),
            "our_edp_ranks": list(parallel_state.get_expert_data_parallel_ranks()),
            "max_name": groups._get_max_expert_size_name(),
            "names": sorted(groups._get_expert_parallel_group_dict()),
            "ep_rank": groups._get_expert_parallel_rank(name),
            "ep_world": groups._get_expert_parallel_world_size(name),
            "edp_world": groups._get_expert_data_parallel_world_size(name)}


def _expert_parameters():
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    ds.mark_expert_parameter(expert, "ep_size_2")
    split = split_params_into_different_moe_groups_for_optimizer(
        [{"name": "decay", "params": [dense, expert]}])
    return {"is_expert": [ds.is_expert_parameter(dense), ds.is_expert_parameter(expert)],
            "groups": [({"moe": bool(g.get("moe", False)), "name": g.get("name", "")},
                        [p.numel() for p in g["params"]]) for g in split]}


class _ExpertModel(torch.nn.Module):
    """A dense weight and an 'expert' weight that differs by rank, with the marker."""

    def __init__(self, rank):
        super().__init__()
        self.dense = torch.nn.Linear(4, 3, bias=False)
        self.expert = torch.nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.dense.weight.fill_(0.1)
            self.expert.weight.fill_(0.2 * (rank + 1))
        ds.mark_expert_parameter(self.expert.weight, "ep_size_2")
        self.add_module("marker", ds.expert_marker(4, 2, "ep_size_2"))

    def forward(self, x):
        return self.expert(self.dense(x))


def _expert_engine(rank):
    """The marker turns on the engine's expert handling: an expert gradient is not averaged
    over the data-parallel group (its expert-data-parallel group is this rank alone), only
    divided by the data-parallel size; a dense gradient is averaged."""
    from deepspeed.moe.layer import MoE

    model = _ExpertModel(rank)
    marker = model.marker
    x = torch.full((2, 4), float(rank + 1))
    model(x).square().sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    engine = _engine(model, 0)
    engine.backward(engine(x).square().sum())  # reduces: one micro-batch is the boundary
    return {"is_moe": isinstance(marker, MoE), "has_moe_layers": engine.has_moe_layers,
            "num_experts": list(engine.num_experts),
            "marker_fields": [marker.num_experts, marker.ep_size, marker.expert_group_name,
                              marker.num_local_experts],
            "local": local, "reduced": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _zero3(rank):
    import deepspeed

    torch.manual_seed(3)
    full = torch.nn.Linear(4, 3).weight.detach().clone()
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
              "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.manual_seed(3)
        model = torch.nn.Linear(4, 3)
    weight = model.weight
    out = {"is_zero3": [ds.is_zero3_parameter(weight), ds.is_zero3_parameter(full)],
           "full_shape": list(ds.full_shape(weight)), "full_numel": ds.full_numel(weight),
           "plain_shape": list(ds.full_shape(full)), "plain_numel": ds.full_numel(full),
           "empty": weight.numel(), "full": full}
    out["partition"] = ds.zero3_partition(weight).detach().clone()
    out["stored_is_partition"] = ds.stored_tensor(weight) is ds.zero3_partition(weight)
    out["stored_plain"] = ds.stored_tensor(full) is full
    with deepspeed.zero.GatheredParameters([weight]):
        out["gathered"] = weight.detach().clone()
    with ds.gathered_for_write(weight):
        if rank == 0:
            with torch.no_grad():
                weight.copy_(torch.arange(12.0).view(3, 4))
    out["written_partition"] = ds.zero3_partition(weight).detach().clone()
    engine = _engine(model, 3)
    flats = ds.zero3_flat_partitions(engine.optimizer)
    out["zero3_flats"] = [f.numel() for f in flats]
    out["zero3_swaps"] = ds.zero3_swaps_optimizer(engine.optimizer)
    out["zero3_scale"] = ds.loss_scale(engine.optimizer)
    out["zero3_cur_scale"] = float(engine.optimizer.loss_scaler.cur_scale)
    return out


def _zero1(rank):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = _engine(model, 1)
    optimizer = engine.optimizer
    out = {}
    linked = ds.linked_partitions(optimizer)
    out["linked_are_zero12"] = linked is not None and linked[0] is optimizer.bit16_groups \
        and linked[1] is optimizer.single_partition_of_fp32_groups
    params = list(model.parameters())
    flat = linked[1][0]
    pieces = []
    for p in params:
        mapping = ds.fragment_mapping(p)
        if mapping is not None:
            lo, hi = mapping.lp_fragment_address, mapping.hp_fragment_address
            pieces.append((hi.start, p.detach().reshape(-1).narrow(0, lo.start, lo.numel)))
    out["flat"] = flat.detach().clone()
    out["fragments"] = torch.cat([t for _, t in sorted(pieces, key=lambda x: x[0])])
    out["has_mapping"] = all(ds.has_fragment_mapping(p) for p in params)
    # refresh: new weights reach the masters
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    out["refreshed"] = ds.refresh_masters(optimizer)
    out["flat_after_refresh"] = flat.detach().clone()
    out["fragments_after_refresh"] = torch.cat(
        [p.detach().reshape(-1).narrow(0, ds.fragment_mapping(p).lp_fragment_address.start,
                                        ds.fragment_mapping(p).lp_fragment_address.numel)
         for p in params if ds.fragment_mapping(p) is not None])
    # the local gradient fragment after a backward at the boundary
    x = torch.full((2, 4), float(rank + 1))
    engine.backward(engine(x).square().sum())
    grads = [ds.local_fragment_grad(p) for p in params]
    out["fragment_grad_numels"] = [0 if g is None else g.numel() for g in grads]
    out["mapped_numels"] = [0 if ds.fragment_mapping(p) is None
                            else ds.fragment_mapping(p).lp_fragment_address.numel
                            for p in params]
    engine.zero_grad()
    # Adam's states set on the flat partition are what the fragments read after relinking
    base = optimizer.optimizer
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(float(flat.numel())),
             "exp_avg_sq": torch.ones(flat.numel())}
    base.state[flat] = state
    ds.relink_optimizer_states(optimizer)
    linked_moments = []
    for p in params:
        mapping = ds.fragment_mapping(p)
        if mapping is not None:
            got = mapping.get_optim_state_fragment("exp_avg")
            hi = mapping.hp_fragment_address
            linked_moments.append(torch.equal(got, state["exp_avg"].narrow(0, hi.start,
                                                                             hi.numel)))
    out["relinked"] = linked_moments
    out["zero1_scale"] = ds.loss_scale(optimizer)
    out["zero1_cur_scale"] = float(optimizer.loss_scaler.cur_scale)
    return out


def _zero0(rank):
    from megatron import parallel_state

    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = _engine(model, 0, optimizer=optimizer)
    calls = {"model_step": 0, "pre_step": 0, "grad_seen": None}
    ds.wrap_model_step(engine, lambda: calls.__setitem__("model_step", calls["model_step"] + 1))

    def pre_step():
        calls["pre_step"] += 1
        calls["grad_seen"] = model[0].weight.grad.clone()

    ds.run_before_optimizer_step(engine, pre_step)
    _step(engine, rank)
    out = {"engine_optimizer_is_client": engine.optimizer is optimizer, **calls}
    out["torch_scale"] = ds.loss_scale(engine.optimizer)
    # the ZeRO-0 norm: the reduced gradients' norm; a pipe-replicated copy left out
    x = torch.full((2, 4), float(rank + 1))
    engine.backward(engine(x).square().sum())  # reduces: one micro-batch is the boundary
    params = list(model.parameters())
    out["grads"] = [p.grad.clone() for p in params]
    out["norm"] = ds.zero0_fp32_grad_norm(params, parallel_state)
    setattr(params[0], ds.PIPE_REPLICATED, True)
    out["replicated"] = [ds.is_pipe_replicated(p) for p in params]
    out["norm_with_first_replicated"] = ds.zero0_fp32_grad_norm(params, parallel_state)
    return out


def observe(rank, world_size):
    """Every behaviour, seen on this rank (run by the harness on two processes)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    _checked(out, "expert_groups", lambda: _expert_groups(rank))
    _checked(out, "expert_parameters", _expert_parameters)
    _checked(out, "expert_engine", lambda: _expert_engine(rank))
    _checked(out, "zero3", lambda: _zero3(rank))
    _checked(out, "zero1", lambda: _zero1(rank))
    _checked(out, "zero0", lambda: _zero0(rank))
    return out


@pytest.fixture(scope="module")
def seen():
    from harness import run_workers

    return run_workers(2, observe, timeout=600)


def _part(seen, key):
    got = [rank[key] for rank in seen]
    for value in got:
        assert not isinstance(value, str), value
    return got


def test_version_is_the_one_read():
    import deepspeed

    assert deepspeed.__version__ == ds.DEEPSPEED_VERSION, (
        f"DeepSpeed {deepspeed.__version__} is installed; megatron/training/"
        f"deepspeed_internals.py was read against {ds.DEEPSPEED_VERSION}: re-read each "
        f"function's DeepSpeed code, then update DEEPSPEED_VERSION")


def test_expert_groups_we_register_are_what_deepspeeds_getters_return(seen):
    for rank, got in enumerate(_part(seen, "expert_groups")):
        assert got["name"] == "ep_size_2"
        assert got["ep_group_is_ours"] and got["edp_group_is_ours"]
        assert got["ep_ranks"] == got["our_ep_ranks"] == [0, 1]
        assert got["edp_ranks"] == got["our_edp_ranks"] == [rank]
        assert got["names"] == ["ep_size_2"]  # the stale ep_size_8 was cleared
        assert got["max_name"] == "ep_size_2"
        assert (got["ep_rank"], got["ep_world"], got["edp_world"]) == (rank, 2, 1)


def test_marked_expert_parameters_are_deepspeeds_moe_parameters(seen):
    for got in _part(seen, "expert_parameters"):
        assert got["is_expert"] == [False, True]
        assert got["groups"] == [({"moe": False, "name": "decay"}, [2]),
                                 ({"moe": True, "name": "ep_size_2"}, [3])]


def test_the_marker_turns_on_the_engines_expert_reduction(seen):
    got = _part(seen, "expert_engine")
    for rank in got:
        assert rank["is_moe"] and rank["has_moe_layers"] and rank["num_experts"] == [4]
        assert rank["marker_fields"] == [4, 2, "ep_size_2", 0]
    dense_mean = (got[0]["local"]["dense.weight"] + got[1]["local"]["dense.weight"]) / 2
    for r, rank in enumerate(got):
        torch.testing.assert_close(rank["reduced"]["dense.weight"], dense_mean)
        # each expert rank's gradient alone, divided by the data-parallel size
        torch.testing.assert_close(rank["reduced"]["expert.weight"],
                                   got[r]["local"]["expert.weight"] / 2)
    assert not torch.allclose(got[0]["reduced"]["expert.weight"],
                              got[1]["reduced"]["expert.weight"])


def test_zero3_parameters_hold_their_partition_and_record_their_shape(seen):
    got = _part(seen, "zero3")
    for rank, g in enumerate(got):
        assert g["is_zero3"] == [True, False]
        assert (g["full_shape"], g["full_numel"], g["empty"]) == ([3, 4], 12, 0)
        assert (g["plain_shape"], g["plain_numel"]) == ([3, 4], 12)
        torch.testing.assert_close(g["gathered"], g["full"])
        # ds_tensor: rank r's equal share of the flat tensor
        torch.testing.assert_close(g["partition"], g["full"].reshape(-1)[rank * 6:(rank + 1) * 6])
        assert g["stored_is_partition"] and g["stored_plain"]
        # what rank 0 wrote inside gathered_for_write is partitioned back to every rank
        torch.testing.assert_close(g["written_partition"],
                                   torch.arange(12.0)[rank * 6:(rank + 1) * 6])


def test_zero3_optimizer_flat_partitions_and_swapping(seen):
    for g in _part(seen, "zero3"):
        assert sum(g["zero3_flats"]) == 6 + 2  # the weight's 12 and the bias's 3 (padded to 4)
        assert g["zero3_swaps"] is False


def test_loss_scale_reads_the_optimizers_scaler(seen):
    for g in _part(seen, "zero3"):
        assert g["zero3_scale"] == g["zero3_cur_scale"] == 1.0
    for g in _part(seen, "zero1"):
        assert g["zero1_scale"] == g["zero1_cur_scale"] == 1.0
    for g in _part(seen, "zero0"):
        assert g["torch_scale"] == 1.0
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert isinstance(inspect.getattr_static(cls, "cur_scale"), property), cls

    class FP16Optimizer:  # the fp16 optimizer without ZeRO keeps only the scaler
        loss_scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1,
                                        delayed_shift=1, consecutive_hysteresis=False)

    assert ds.loss_scale(FP16Optimizer()) == 2.0 ** 16


def test_zero12_fragments_tile_the_flat_partition(seen):
    for g in _part(seen, "zero1"):
        assert g["linked_are_zero12"] and g["has_mapping"]
        flat = g["flat"]
        torch.testing.assert_close(g["fragments"], flat[:g["fragments"].numel()])
        assert flat[g["fragments"].numel():].abs().sum() == 0  # padding
        assert g["refreshed"] is True
        torch.testing.assert_close(g["fragments_after_refresh"],
                                   g["flat_after_refresh"][:g["fragments"].numel()])
        assert g["fragment_grad_numels"] == g["mapped_numels"]
        assert sum(g["mapped_numels"]) > 0


def test_relinking_points_the_fragments_at_the_new_adam_states(seen):
    for g in _part(seen, "zero1"):
        assert g["relinked"] and all(g["relinked"])


def test_model_step_hook_and_optimizer_pre_hook_run_once_per_step(seen):
    got = _part(seen, "zero0")
    for g in got:
        assert g["engine_optimizer_is_client"]
        assert (g["model_step"], g["pre_step"]) == (1, 1)
    # the pre-hook sees the reduced gradients: the same on both ranks, whose inputs differ
    torch.testing.assert_close(got[0]["grad_seen"], got[1]["grad_seen"])
    assert got[0]["grad_seen"].abs().sum() > 0


def test_zero0_norm_is_the_reduced_gradients_and_counts_pipe_copies(seen):
    """The norm DeepSpeed's ZeRO-0 fp32 clipping takes counts the tied copies a pipeline marks
    `ds_pipe_replicated` (why training/pipeline_step.py clips itself there)."""
    got = _part(seen, "zero0")
    for g in got:
        for mine, theirs in zip(g["grads"], got[0]["grads"]):
            torch.testing.assert_close(mine, theirs)  # reduced: equal on both ranks
        total = math.sqrt(sum(float(t.double().square().sum()) for t in g["grads"]))
        assert g["norm"] == pytest.approx(total, rel=1e-6)
        assert g["replicated"] == [True, False, False, False]
        assert g["norm_with_first_replicated"] == pytest.approx(total, rel=1e-6)


def test_pipe_replicated_is_deepspeeds_name():
    from deepspeed.runtime.constants import PIPE_REPLICATED

    assert ds.PIPE_REPLICATED == PIPE_REPLICATED


def test_pipeline_engine_reads_its_instruction_table_and_allreduce_flag_on_the_instance():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    engine = PipelineEngine.__new__(PipelineEngine)  # no process groups needed
    table = ds.pipeline_instructions(engine)
    assert table is not None and {schedule.ForwardPass, schedule.BackwardPass,
                                  schedule.OptimizerStep, schedule.ReduceGrads} <= set(table)
    ds.set_pipeline_instructions(engine, {schedule.ForwardPass: table[schedule.ForwardPass]})
    assert set(engine._INSTRUCTION_MAP) == {schedule.ForwardPass}
    assert set(PipelineEngine._INSTRUCTION_MAP) == set(table)  # the class's is untouched
    assert "self._INSTRUCTION_MAP" in inspect.getsource(PipelineEngine._exec_schedule)
    assert ds.pipeline_instructions(object()) is None
    ds.skip_lone_pipeline_allreduce(engine)
    assert engine.pipeline_enable_backward_allreduce is False
    assert "self.pipeline_enable_backward_allreduce" in \
        inspect.getsource(PipelineEngine._exec_reduce_grads)


def test_frozen_weights_come_from_module_when_the_saved_fragments_are_empty():
    """A ZeRO-2 save writes `frozen_param_fragments` even when nothing was frozen, and the load
    looks the frozen parameters up in it whenever it is not None; the adapter drops an empty
    one as the files are read, and leaves a real one alone."""
    from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    load = inspect.getsource(DeepSpeedEngine.load_module_state_dict)
    assert "checkpoint.get(FROZEN_PARAM_FRAGMENTS, None) is not None" in load
    assert "saved_frozen_params[name]" in load
    assert "self.checkpoint_engine.load(" in inspect.getsource(SDLoaderBase)
    assert "checkpoint_engine=self.checkpoint_engine" in \
        inspect.getsource(DeepSpeedEngine._load_checkpoint)

    class Files:
        saved = {"module": {}, FROZEN_PARAM_FRAGMENTS: {}}
        kept = {"module": {}, FROZEN_PARAM_FRAGMENTS: {"w": torch.zeros(1)}}

        def load(self, path, map_location=None):
            return dict(getattr(self, path))

    class Engine:
        checkpoint_engine = Files()

    engine = Engine()
    real = engine.checkpoint_engine
    with ds.frozen_weights_from_module(engine):
        assert engine.checkpoint_engine.load("saved") == {"module": {}}
        assert FROZEN_PARAM_FRAGMENTS in engine.checkpoint_engine.load("kept")
    assert engine.checkpoint_engine is real


def test_arch_lists_with_arch_specific_entries_are_read_by_deepspeeds_jit_builder(monkeypatch):
    # DeepSpeed's CUDA builder (the FusedAdam one; its CPU twin is what the CPU accelerator
    # resolves) parses the list without building anything: "9.0a" fails there, seen on an H200
    # image; the rewritten list passes and keeps what it asked for
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    assert ds.arch_list_deepspeed_reads("8.0 9.0a+PTX;9.0;10.0f") == "8.0;9.0+PTX;9.0;10.0"
    for user in ("8.0;9.0a", "7.5 8.6 9.0a+PTX"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", user)
        with ds.deepspeed_op_build_env():
            assert builder.compute_capability_args() == []  # jit: torch makes the -gencode flags
            built = os.environ["TORCH_CUDA_ARCH_LIST"]
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == user  # restored
        assert built == {"8.0;9.0a": "8.0;9.0+PTX", "7.5 8.6 9.0a+PTX": "7.5;8.6;9.0+PTX"}[user]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    with ds.deepspeed_op_build_env():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0+PTX"  # what a build writes back
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
