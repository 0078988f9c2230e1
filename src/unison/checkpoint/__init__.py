"""What is on disk: checkpoint files, sharded checkpoints, their integrity, and the callback.

- `format`: plain checkpoint files, written atomically by one rank, read weights-only.
- `sharded`: checkpoints of FSDP2-sharded models (torch.distributed.checkpoint), one writer
  per shard, atomic, loadable on any number of processes.
- `integrity`: every file of either kind is verified (CRC32) before anything is loaded.
- `errors`: `CheckpointError` and `DiskFullError`, one line naming the file.
- `callback`: `Checkpoint`, the callback that writes resumable checkpoints during `fit`.
"""
