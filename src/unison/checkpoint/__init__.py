"""What is on disk: checkpoint files, sharded checkpoints, their integrity, and the callback.

- `format`: plain checkpoint files, written atomically by one rank, read weights-only.
- `sharded`: checkpoints of FSDP2-sharded models (torch.distributed.checkpoint), one writer
  per shard, atomic, loadable on any number of processes.
- `store`: one save/load pair for both, the format named by the model's strategy.
- `integrity`: every file of either kind is verified (CRC32) before anything is loaded.
- `errors`: `CheckpointError` and `DiskFullError`, one line naming the file.
- `components`: the objects with `state_dict` / `load_state_dict` a checkpoint is handed.
- `callback`: `Checkpoint`, the callback that writes resumable checkpoints during `fit`; it lists
  what it saves once per save or restore, and hands it to `store`.
- `learner_files`: `Learner.save` / `load` through `store`, and `fit(resume=True)`.
"""
