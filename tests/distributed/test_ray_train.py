"""Ray Train (issue 22, item 4): a `TorchTrainer` whose workers build a `Learner` and use `distrib_ctx()`.

A real local Ray cluster (`ray.init(num_cpus=2)`, started once for this module) runs
`examples/ray/train_ray.py`'s worker loop on 2 workers. Ray makes the gloo group itself; the tests
check that `distrib_ctx` adopts it (and leaves it to Ray at the end), that 2 workers at batch 8
end on the weights of a plain single-process loop at batch 16, and that a worker killed mid-epoch
(SIGKILL) is restarted by Ray's `FailureConfig(max_failures=1)` and the run resumes from the
Learner's checkpoint in the run's storage folder to those same weights. Skipped, with the reason,
where `ray` cannot be imported (`pip install 'unison[ray]'`).
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'unison[ray]' (Ray Train tests)")
if importlib.util.find_spec("ray.train") is None:  # not imported here: it takes seconds, even unselected
    pytest.skip("ray.train is not installed: pip install 'unison[ray]'", allow_module_level=True)

# A local Ray cluster and its workers: 75-110 s here, past 300 s beside a second copy of the suite
# and two other test runs (load 15-30); the kill-and-restart test was still waiting at 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "examples_ray_train", ROOT / "examples" / "ray" / "train_ray.py"
)
train_ray = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = train_ray  # cloudpickle sends a module's functions by value only if imported
_spec.loader.exec_module(train_ray)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(train_ray)  # the workers cannot import it by name
    # The workers find unison where this process does (they inherit its environment).
    # ray.init installs a SIGTERM handler (sys.exit) that ray.shutdown leaves: the next test in this
    # process (under pytest-xdist, any module's) would chain to it; put the test session's back.
    # Ray Train also replaces builtins.print with a redirecting one, which then cannot be pickled
    # by name (a later test's torch.save of `print` failed): put the real one back too.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    real_print = builtins.print
    # address="local": a cluster of its own, always. Without it ray.init joins a cluster that
    # `ray start` (or RAY_ADDRESS) left on this machine, shared with anything else running there.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        builtins.print = real_print


def one_process(epochs: int = 2, bs: int = 16, lr: float = 0.1) -> torch.Tensor:
    """The independent reference: a plain loop on one process over the same data, in order."""
    x, y = train_ray.make_data()
    model = train_ray.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, 128, bs):
            loss = nn.functional.cross_entropy(model(x[start : start + bs]), y[start : start + bs])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_ray_workers_adopt_its_group_and_a_killed_one_resumes_mid_epoch_to_one_process(
    local_ray: None, tmp_path: Path
) -> None:
    """2 workers at batch 8, in order. Rank 1 SIGKILLs itself before step 5 of 16 (epoch 0 has 8):
    Ray restarts the whole group once; the new workers' `fit(resume=True)` reads the checkpoint of
    step 4 from the run's folder, and the run ends on the plain loop's weights at batch 16 (so the
    uninterrupted part and the resumed part are each exact: a missing shard, a doubled one or a
    fresh start would each end elsewhere)."""
    result = train_ray.fit_with_ray(2, str(tmp_path), "killed", shuffle=False, bs=8, die_at=5)
    assert result.error is None
    m = result.metrics
    assert m["resumed"], "the worker was never killed"
    assert os.path.exists(tmp_path / "killed" / "unison" / "models" / "checkpoint.pth")
    assert m["steps"] == 16 - 4, "the restarted run did not continue from step 4's checkpoint"
    assert (m["world"], m["rank"]) == (2, 0)
    assert m["adopted"], "distrib_ctx made its own group, or destroyed Ray's at its end"
    torch.testing.assert_close(torch.tensor(m["params"]), one_process(), rtol=1e-5, atol=1e-6)
    # Ray holds the Learner's last checkpoint (rank 0 reported its folder), verified and loadable.
    from unison.checkpoint.format import safe_load

    state = safe_load(Path(result.checkpoint.path) / "checkpoint.pth")
    last = torch.cat([t.flatten() for t in state["model"].values()])
    torch.testing.assert_close(last, torch.tensor(m["params"]), rtol=0, atol=0)
