"""Launch probe: report what a worker sees, prove the group forms, write to both streams.

stdout: `PROBE {json}` (rank variables, threads, argv, pid); stderr: `STDERR rank R`.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
KEYS += ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "UNISON_TIMEOUT", "TORCHELASTIC_ERROR_FILE")
info = {k: os.environ.get(k) for k in KEYS}
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
info.update(threads=torch.get_num_threads(), argv=sys.argv[1:], pid=os.getpid(), allreduce=total.item())
info.update(file=__file__, argv0=sys.argv[0])
print("PROBE " + json.dumps(info))
print(f"STDERR rank {dist.get_rank()}", file=sys.stderr)
dist.destroy_process_group()
