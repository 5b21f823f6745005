"""Which files of an iteration folder a rank downloads at `--load s3://...`
(megatron/checkpoint/io/remote.py `reads`): its own RNG file, the model and optimizer files of
its model-parallel rank (every data-parallel rank's optimizer files: DeepSpeed reads them all at
ZeRO 1-2), the pipeline's layer files of its tensor-parallel rank, and every shared file; the
names are those DeepSpeed and our trainer write (formats/deepspeed_folder.expected_files)."""

from megatron.checkpoint.formats.deepspeed_folder import expected_files
from megatron.checkpoint.io.remote import reads


def test_a_rank_reads_its_own_files_and_the_shared_ones(tmp_path):
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
              "data_parallel_size": 2, "zero_stage": 1}
    names = expected_files(tmp_path, layout, "fp32") + [
        "rng/rank_00000.pt", "rng/rank_00001.pt", "rng/rank_00002.pt", "rng/rank_00003.pt",
        "layer_01-model_00-model_states.pt", "layer_01-model_01-model_states.pt",
        "pipeline_layers.json"]
    # global rank 3: tensor rank 1 (model-parallel rank 1), data-parallel rank 1
    mine = sorted(n for n in names if reads(n, 3, 1, 1))
    assert mine == sorted(["mp_rank_01_model_states.pt",
                           "zero_pp_rank_0_mp_rank_01_optim_states.pt",
                           "zero_pp_rank_1_mp_rank_01_optim_states.pt",
                           "rng/rank_00003.pt", "layer_01-model_01-model_states.pt",
                           "pipeline_layers.json"])
    # every file is read by some rank
    ranks = [(r, r % 2, r % 2) for r in range(4)]
    assert all(any(reads(n, *k) for k in ranks) for n in names)
