"""Process groups of dropped wrappers on a subgroup, kept for the next wrapper.

[Note: why a subgroup wrapper's groups are kept, not destroyed]
A wrapper on a subgroup names its own groups by a hash of their ranks and of the
number of groups the process holds (see topology.hashed_group_names). Destroying
them would lower that number, so the next wrapper's groups would get the same
names, and the same keys in the job's store: a member that arrives first reads
the address its peer published for the old group, and gloo fails to connect
("Connection refused"; torch DDP, which makes no groups, does not meet this).
So a dropped wrapper releases them here instead, and the next wrapper on the
same ranks, with the same timeout, takes them back where every member of a group
released it (the members tell each other what they hold at construction).
Groups a wrapper never takes back are freed with the default group
(``destroy_process_group()``).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist

# An offer: (group name, the group's global ranks, its timeout in seconds or None).
Offer = tuple[str, tuple[int, ...], Optional[float]]

# Released groups by name (the name is the same on every member).
_released: dict[str, tuple[dist.ProcessGroup, tuple[int, ...], Optional[float]]] = {}


def _seconds(timeout: Optional[timedelta]) -> Optional[float]:
    return None if timeout is None else timeout.total_seconds()


def _registered_name(group: dist.ProcessGroup) -> Optional[str]:
    """The name torch holds the group under; None once it is destroyed."""
    try:
        return dist.distributed_c10d._world.pg_names.get(group)
    except AttributeError:  # private: another torch
        return None


def release(group: dist.ProcessGroup, timeout: Optional[timedelta]) -> bool:
    """Keep a dropped wrapper's hash-named group for a later wrapper; False if it
    cannot be kept (then the caller destroys it)."""
    name = _registered_name(group)
    if name is None:
        return False
    _released[name] = (group, tuple(dist.get_process_group_ranks(group)), _seconds(timeout))
    return True


def offers() -> list[Offer]:
    """What this process has released and still holds (groups destroyed since,
    with the default group, are forgotten)."""
    for name, (group, _, _) in list(_released.items()):
        if _registered_name(group) != name:
            del _released[name]
    return [(name, ranks, timeout) for name, (_, ranks, timeout) in sorted(_released.items())]


class ReusableGroups:
    """The released groups a wrapper under construction may take back: for a
    group of ranks R, those every member of R released. Every member of R takes
    them in the same order, as it creates its groups in the same order."""

    def __init__(self, offers_by_rank: dict[int, Sequence[Offer]]):
        self._offers_by_rank = offers_by_rank
        self._taken: set[str] = set()
        # Groups this wrapper got by hashed name: released again when it is dropped.
        self.groups: list[dist.ProcessGroup] = []

    def take(self, ranks: Sequence[int], timeout: Optional[timedelta]) -> Optional[dist.ProcessGroup]:
        key = (tuple(ranks), _seconds(timeout))
        common: Optional[set[str]] = None
        for rank in key[0]:
            names = {name for name, r, t in self._offers_by_rank.get(rank, ()) if (r, t) == key}
            common = names if common is None else common & names
        for name in sorted((common or set()) - self._taken):
            self._taken.add(name)
            entry = _released.pop(name, None)
            if entry is not None:
                return entry[0]
        return None

    def keep(self, group: Any) -> None:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            self.groups.append(group)
