"""`is_peer_failure`: which failed calls name a stalled rank. torch's messages below are the ones a
gloo group gave here when a peer exited or hung, and DDP's when a parameter got no gradient."""

import torch.distributed as dist

from unison.distributed.watchdog import is_peer_failure


def test_a_collective_failed_by_a_peer_is_one() -> None:
    for message in (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:36244",
        "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30",
        "Application timeout caused pair closure",
        "NCCL communicator was aborted on rank 1",
    ):
        assert is_peer_failure(RuntimeError(message)), message
    assert is_peer_failure(dist.DistStoreError("wait timeout"))


def test_this_ranks_own_error_is_not() -> None:
    ddp = (
        "Expected to have finished reduction in the prior iteration before starting a new one. This error "
        "indicates that your module has parameters that were not used in producing loss."
    )
    assert not is_peer_failure(RuntimeError(ddp))
    assert not is_peer_failure(
        RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
    )
