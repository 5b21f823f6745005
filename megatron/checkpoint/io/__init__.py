"""The trainer's side of checkpoints: the folder layout (tracker, tags, meta.json, atomic
commit, what a load checks: checkpointing.py), saving with held and background commits
(saver.py, async_save.py), loading converted optimizer states into DeepSpeed's optimizer
(optimizer_state.py), and one writer per --save folder (ownership.py)."""
