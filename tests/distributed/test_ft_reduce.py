"""`StepVector`: what a torchft step sums across replicas, packed and unpacked in one process (the
sum of the replicas' vectors is what torchft's all-reduce returns); against one process's step."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from unison.distributed.ft_reduce import StepVector


class WithUnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.unused_head = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


def _share_vector(x, y, rows):
    """A replica's model after its backward pass over its share: the share's summed loss over the
    global batch's rows (a loss counted by rows), packed."""
    model = WithUnusedHead()
    (F.cross_entropy(model(x), y, reduction="sum") / rows).backward()
    host = SimpleNamespace(
        model=model, loss=None, loss_count=0.0, exact_loss=SimpleNamespace(count_is_rows=True)
    )
    return model, StepVector.pack(host)


def test_a_parameter_no_replica_used_keeps_no_gradient_as_one_process_leaves_it():
    """Summed as zeros, the unused head's gradient made AdamW decay weights one process never steps."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    replica, step = _share_vector(x[0::2], y[0::2], rows=8)
    _, other = _share_vector(x[1::2], y[1::2], rows=8)
    step.flat += other.flat  # torchft's all-reduce of the two replicas' vectors
    step.unpack()
    plain = WithUnusedHead()
    F.cross_entropy(plain(x), y).backward()
    assert replica.unused_head.weight.grad is None and replica.unused_head.bias.grad is None
    for opt_model in (replica, plain):
        torch.optim.AdamW(opt_model.parameters(), lr=0.1, weight_decay=0.5).step()
    for (name, got), want in zip(replica.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_a_parameter_one_replica_used_gets_the_summed_gradient():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)
    replica, step = _share_vector(x, y, rows=4)
    other = WithUnusedHead()  # its share used only the body; the head's gradient is this replica's
    other.unused_head.weight.grad = torch.ones_like(other.unused_head.weight)
    host = SimpleNamespace(
        model=other, loss=None, loss_count=0.0, exact_loss=SimpleNamespace(count_is_rows=True)
    )
    step.flat += StepVector.pack(host).flat
    step.unpack()
    assert torch.equal(replica.unused_head.weight.grad, torch.ones_like(replica.unused_head.weight))
    assert replica.unused_head.bias.grad is None
