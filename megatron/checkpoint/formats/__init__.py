"""Checkpoint formats and conversion, without process groups (data_tools/convert_checkpoint.py).

One intermediate: full, unpadded tensors under our names (Hugging Face T5's), one at a time.
- deepspeed.py reads any checkpoint the trainer writes (any TP, PP, EP, DP, ZeRO 0-3): the
  weights, the fp32 masters, Adam's moments and step. It is the public face of deepspeed_folder.py
  (tracker), meta.py (meta.json's one reader and writer: what a checkpoint is, as typed fields),
  deepspeed_tensors.py (full tensors), deepspeed_pipeline.py (layer and
  tied files), deepspeed_optimizer.py (masters, moments, step), deepspeed_describe.py (--inspect),
  deepspeed_files.py (the safe loader, ZeRO layouts) and deepspeed_experts.py (experts over ranks).
- hf.py writes and reads Hugging Face folders (weights, config, tokenizer); switch.py what a
  Mixture-of-Experts model's (SwitchTransformers) folder holds and cannot hold.
- upcycle.py makes a dense model's tensors a Mixture-of-Experts model's (experts copied).
- cpm2.py reads CPM-2-Pretrain / -Finetune checkpoints (any model-parallel size; the fused
  projections un-strided) and CPM-2-MoE's, and gives a Hugging Face export CPM-2's vocab.txt and
  a README; cpm2_shards.py holds their files and the dense tensors' table, cpm2_moe.py the
  experts (and writes CPM-2-MoE checkpoints).
- weights.py writes a checkpoint of full tensors that the trainer loads in any layout: weights
  (--finetune), or with the optimizer states a resume (megatron/checkpoint/io/optimizer_state.py puts
  them into DeepSpeed's optimizer).
- shards.py writes safetensors shards as the tensors come, one tensor in memory at a time.
"""
