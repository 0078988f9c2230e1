"""GPU paths proved on the CPU: the `meta` device stands in for `cuda`, a fake CUDA_VISIBLE_DEVICES
for id mapping. What needs a real GPU is in `make gpu-check` (benchmarks/gpu_check.py)."""

import contextlib
import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Checkpoint, DataLoaders, Learner, set_seed
from unison.distributed.devices import (
    check_local_rank,
    cuda_check_without_init,
    pick_device,
    place_training_state,
    resolve_backend,
    to_cpu,
)
from unison.rng import get_rng_state, set_rng_state

META = torch.device("meta")
CPU = torch.device("cpu")


def _learner(path, loss_func=None):
    set_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 5, generator=g)
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))
    loss = loss_func if loss_func is not None else nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))
    return Learner(dls, model, loss, lr=1e-2, opt_func=torch.optim.AdamW, path=path)


def _fit(learn, n=1, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit(n, **kwargs)


# ---- item 3 and 9: which device a process trains on ------------------------------------------------
def test_one_process_nccl_launch_trains_on_its_gpu():
    # `--gpus 1` / `--nproc 1` on a GPU machine: a one-process NCCL group still binds its GPU.
    assert pick_device("nccl", None, 0, 1, CPU) == torch.device("cuda", 0)
    assert pick_device("nccl", None, 1, 2, CPU) == torch.device("cuda", 1)  # not every rank on cuda:0


def test_cuda_id_wins_and_gloo_or_no_gpu_keeps_the_model_where_it_is():
    assert pick_device("nccl", 1, 0, 2, CPU) == torch.device("cuda", 1)
    assert pick_device("gloo", None, 1, 2, CPU) == CPU
    assert pick_device("nccl", None, 1, 2, CPU, force_cpu=True) == CPU
    assert pick_device("gloo", 1, 0, 0, CPU) == CPU  # a script's to_distributed(local_rank) without CUDA


def test_more_local_ranks_than_gpus_is_refused_naming_the_mapping(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match=r"local rank 2 needs GPU 2 but this process sees 2 GPU"):
        pick_device("nccl", None, 2, 2, CPU)  # --nproc 4 on a 2-GPU machine: not all on cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(RuntimeError, match=r"sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES='3,5'\)"):
        check_local_rank(2, 2)
    assert check_local_rank(0, 1) == 0


def test_a_process_given_its_own_gpu_uses_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # SLURM --gpus-per-task=1: local rank 1 sees GPU 5 alone
    assert pick_device("nccl", None, 1, 1, CPU) == torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # --nproc 2 on a one-GPU machine: refused
    with pytest.raises(RuntimeError, match="local rank 1 needs GPU 1"):
        pick_device("nccl", None, 1, 1, CPU)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("UNISON_BACKEND", raising=False)
    assert resolve_backend(None, cuda=True) == "nccl"
    assert resolve_backend(None, cuda=False) == "gloo"
    assert resolve_backend("gloo", cuda=True) == "gloo"  # the CPU on a GPU machine
    monkeypatch.setenv("UNISON_BACKEND", "gloo")  # `unison launch --backend gloo`
    assert resolve_backend(None, cuda=True) == "gloo"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("mpi", cuda=True)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("nccl", cuda=False)


def test_distrib_ctx_backend_gloo_trains_outside_a_launch(tmp_path):
    learn = _learner(tmp_path)
    with learn.distrib_ctx(backend="gloo"):
        _fit(learn)
    reference = _learner(tmp_path)
    _fit(reference)
    assert learn.device == CPU
    assert all(
        torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.model.parameters(), strict=True)
    )


# ---- item 4, 8, 13: model, optimizer state and loss move together ----------------------------------
def test_optimizer_state_and_loss_buffers_move_with_the_model(tmp_path):
    learn = _learner(tmp_path)
    _fit(learn)
    learn.save("m")
    learn.load("m")  # mapped to the CPU, as examples/mp_spawn.py does before distrib_ctx on a GPU
    place_training_state(learn.model, learn.opt, learn.loss_func, META)
    assert {p.device for p in learn.model.parameters()} == {META}
    moments = [v for s in learn.opt.state.values() for k, v in s.items() if k != "step"]
    assert moments and {m.device for m in moments} == {META}  # else: foreach step refuses two devices
    assert all(s["step"].device == CPU for s in learn.opt.state.values())  # torch keeps it on the CPU
    assert learn.loss_func.weight.device == META


def test_bce_pos_weight_moves_too():
    loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0]))
    place_training_state(nn.Linear(2, 1), None, loss, META)
    assert loss.pos_weight.device == META


def test_a_bad_backend_is_refused_and_nothing_changes(tmp_path):
    from unison.distributed.trainer import DistributedTrainer

    learn = _learner(tmp_path)
    with pytest.raises(ValueError, match="backend must be one of"):
        learn.to_distributed(backend="mpi")
    assert learn.device == CPU and learn.get_cb(DistributedTrainer) is None


def test_resumed_cpu_losses_stack_with_new_ones_on_the_model_device():
    from unison.callbacks.recorder import _stack_on_last_device

    losses = [torch.tensor(1.0), torch.tensor(2.0, device=META)]  # resumed on the CPU, then a "GPU" one
    assert _stack_on_last_device(losses).device == META
    assert torch.equal(
        _stack_on_last_device([torch.tensor(1.0), torch.tensor(2.5)]), torch.tensor([1.0, 2.5])
    )


# ---- item 2: resume where the checkpoint's tensors were mapped to the model's device ---------------
def test_rng_state_restores_from_tensors_of_any_dtype_and_device():
    state = get_rng_state()
    expected = torch.rand(3)
    moved = {**state, "torch": state["torch"].to(torch.int64)}  # as a map_location/cast could leave it
    set_rng_state(to_cpu(moved))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.filterwarnings("ignore:.*meta parameter")
def test_resume_on_a_model_off_the_cpu_restores_the_rng(tmp_path):
    # The model on `meta` stands for cuda:k: the checkpoint used to be loaded to the model's device,
    # and the generator states with it, which torch refuses (`.numpy()`, set_rng_state on CPU only).
    learn = _learner(tmp_path)
    learn.add_cb(Checkpoint(every=1))
    _fit(learn)
    saved = torch.load(tmp_path / "models" / "checkpoint.pth", map_location="cpu", weights_only=True)["rng"][
        0
    ]
    resumed = _learner(tmp_path)
    resumed.add_cb(Checkpoint(every=1))
    resumed.model.to(META)
    assert resumed.get_cb(Checkpoint).restore_latest()
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    assert {p.device for p in resumed.model.parameters()} == {META}  # weights copied to the model's device


# ---- item 1 and 12: spawn's fork path must not initialise CUDA in the parent; results come back on CPU
@pytest.mark.procs
def test_fork_spawn_asks_nvml_and_leaves_cuda_uninitialised(monkeypatch):
    from unison.launch.spawn import spawn

    _needs_cuda_untouched()
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)

    def probe():  # a closure: forked, like a notebook's function
        import os

        return os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), torch.cuda.is_initialized(), torch.ones(2)

    nvml, child_initialised, tensor = spawn(probe, 2, start_method="fork")
    assert nvml == "1" and not child_initialised  # torch's launcher answered is_available() by NVML
    assert torch.equal(tensor, torch.ones(2)) and tensor.device == CPU
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in __import__("os").environ  # put back in the parent
    assert not torch.cuda.is_initialized()


def test_results_are_moved_to_the_cpu_through_containers():
    moved = to_cpu({"a": [torch.ones(1), (torch.zeros(2), 3)], "b": "x"})
    assert moved["a"][0].device == CPU and moved["a"][1][0].device == CPU
    assert moved["a"][1][1] == 3 and moved["b"] == "x"


def _needs_cuda_untouched():
    # On a GPU machine an earlier test in this process may have used CUDA; what these tests check
    # (the parent never initialises it) then cannot be seen here (make gpu-check's fork_spawn row does).
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA")


def test_nvml_check_is_on_inside_the_block_and_put_back(monkeypatch):
    _needs_cuda_untouched()
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with cuda_check_without_init():
        import os

        assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
        torch.cuda.is_available()
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    assert not torch.cuda.is_initialized()


# ---- item 6: DataParallel replicas keep the caller's autocast dtype ---------------------------------
def _in_replica_thread(module, x):
    """What torch's parallel_apply does in each replica's thread: autocast re-entered with no dtype."""
    import threading

    box = {}

    def run():
        with torch.autocast("cpu", enabled=True):
            box["out"] = module(x)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box["out"]


def test_replicas_run_under_the_callers_autocast_dtype():
    from unison.distributed.trainer import AutocastReplica

    layer, x = nn.Linear(4, 2), torch.randn(3, 4)
    # CPU stands in for CUDA (whose default is fp16): a fresh thread's autocast takes the default
    # dtype, not the one the caller asked for.
    assert _in_replica_thread(layer, x).dtype == torch.get_autocast_dtype("cpu") == torch.bfloat16
    out = _in_replica_thread(AutocastReplica(layer, "cpu", torch.float16), x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), layer(x), atol=1e-2, rtol=1e-2)
