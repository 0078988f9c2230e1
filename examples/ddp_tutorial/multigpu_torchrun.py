"""A torchrun script in the shape of pytorch/examples' DDP tutorial series (`multigpu_torchrun.py`),
with the CPU edits only: the gloo backend, and no `.cuda()` / `device_ids`.

It reads its place from torchrun's variables (LOCAL_RANK, ...), makes the process group itself,
shards with `DistributedSampler`, wraps the model in torch's DDP, and saves a snapshot from local
rank 0 that a restarted run resumes from. Nothing in it knows about unison. The tutorial's
README command and unison's are the same but for the launcher's name:

    torchrun --standalone --nproc_per_node=2 examples/ddp_tutorial/multigpu_torchrun.py 4 2
    unison launch --standalone --nproc_per_node=2 examples/ddp_tutorial/multigpu_torchrun.py 4 2

Every rank prints what it does (`[CPU1] Epoch 0 | ...`) and at the end `rank R weights ...`.
"""

import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from datautils import RandomPairs  # a module next to the script, as in the tutorial
from torch.distributed import destroy_process_group, get_rank, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    init_process_group(backend="gloo")  # CPU edit: the tutorial binds LOCAL_RANK's GPU and uses nccl


class Trainer:
    def __init__(self, model, train_data: DataLoader, optimizer, save_every: int, snapshot_path: str):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}")
        self.model = DDP(self.model)  # CPU edit: no device_ids

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        batch = len(next(iter(self.train_data))[0])
        print(f"[CPU{self.local_rank}] Epoch {epoch} | Batchsize: {batch} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    train_set = RandomPairs(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    trainer = Trainer(model, prepare_dataloader(dataset, batch_size), optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    flat = torch.cat([p.detach().double().flatten() for p in trainer.model.module.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"rank {get_rank()} weights {digest} sum {flat.sum().item():.8f}")
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where the snapshot is written")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot)
