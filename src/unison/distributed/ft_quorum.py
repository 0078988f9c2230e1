"""What each torchft quorum said, kept for unison's log lines: torchft's `Manager` keeps the
members of its quorums to itself, so its client is passed through `QuorumWitness`.

>>> replica_name("a:3f2c-uuid")
'a'
"""

from __future__ import annotations

from typing import Any

__all__ = ["QuorumWitness", "membership_change", "replica_name"]


class QuorumWitness:
    """torchft's `ManagerClient`, passed through, keeping what each quorum said that the `Manager`
    keeps to itself: which replicas take part, and which one a healing replica copies.

        manager._client = QuorumWitness(manager._client)
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: list[str] = []  # the latest quorum's replicas, by name
        self.starts: list[str] = []  # ... and by start ("<name>:<uuid>": a restart is another one)
        self.healed_from: str | None = None  # the replica the latest heal copied

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        # torchft names a replica "<replica id>:<uuid of this start>"; the name is the user's.
        self.starts = [str(r) for r in quorum.replica_ids]
        names = [replica_name(r) for r in self.starts]
        self.replica_ids = names
        source = quorum.recover_src_replica_rank
        self.healed_from = (
            names[source] if quorum.heal and source is not None and source < len(names) else None
        )
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def replica_name(start: str) -> str:
    """The replica's name in torchft's id of one of its starts (`<name>:<uuid>`).

    >>> replica_name("b:0d1e-uuid")
    'b'
    """
    return start.split(":")[0]


def membership_change(was: list[str], now: list[str]) -> tuple[list[str], str]:
    """Between two quorums' members (starts, `QuorumWitness.starts`): the replicas that joined, and
    a phrase naming those that left, or left and came back restarted ("" if none).

    >>> membership_change(["a:1", "b:2"], ["a:1", "b:3", "c:4"])
    (['c'], 'replica(s) b left the quorum and rejoined (restarted)')
    """
    left = [replica_name(r) for r in was if r not in now]
    joined = [replica_name(r) for r in now if r not in was]
    back = [r for r in left if r in joined]  # restarted between two quorums: left and came back
    left, joined = [r for r in left if r not in back], [r for r in joined if r not in back]
    said = [f"replica(s) {', '.join(left)} left the quorum"] if left else []
    said += [f"replica(s) {', '.join(back)} left the quorum and rejoined (restarted)"] if back else []
    return joined, "; ".join(said)
