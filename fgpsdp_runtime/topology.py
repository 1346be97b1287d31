"""Nodes x local ranks, and the process groups of each link class.

[Note: slice ownership under the hierarchy]
A bucket of B elements is cut into N = nodes x local_size slices. The
hierarchical reduce-scatter first reduce-scatters inside the node, so local
rank l holds the node's sum of chunk l (B / local_size elements); then the
ranks with local index l (one per node: the "rail") reduce-scatter that chunk,
so node n's rank receives piece n of it. Rank r = n * local_size + l therefore
owns slice ``l * nodes + n`` of every bucket: ``NodeLayout.slice_index(r)``.
With ``flat`` (or one node) the mapping is the identity. The optimizer state
stays sharded over all N ranks; nothing is replicated per node.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist

from .backends import backend_of
from .object_collectives import all_gather_objects


@dataclass(frozen=True)
class Topology:
    """How ranks map to nodes. ``local_size=None`` reads torchrun's environment.

    ``shared_memory``: CPU ranks of one node exchange bucket bytes through
    shared memory instead of gloo's TCP loopback (see shared_memory.py);
    None reads ``FGPSDP_SHARED_MEMORY`` (on unless ``0``).
    """

    local_size: Optional[int] = None
    hierarchical: bool = True
    shared_memory: Optional[bool] = None

    @staticmethod
    def flat() -> "Topology":
        return Topology(local_size=None, hierarchical=False)


TopologyArg = Union[Topology, str, None]


@dataclass(frozen=True)
class NodeLayout:
    """A resolved topology: pure arithmetic over ranks of the wrapper's group."""

    world_size: int
    local_size: int
    hierarchical: bool
    shared_memory: bool = True  # CPU intra-node bytes through shared memory (see Topology)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def uses_hierarchy(self) -> bool:
        # One node or one rank per node: a single level already is the hierarchy.
        return self.hierarchical and self.nodes > 1 and self.local_size > 1

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def local_rank(self, rank: int) -> int:
        return rank % self.local_size

    def intra_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_size, (node + 1) * self.local_size))

    def rail_ranks(self, local_rank: int) -> list[int]:
        return list(range(local_rank, self.world_size, self.local_size))

    def summary(self) -> str:
        """What every rank of the group must resolve alike (compared at wrapping): what
        decides the groups and transports. Without the hierarchy only whether all
        ranks are on one node counts (they may then share memory)."""
        if self.uses_hierarchy:
            text = f"topology of {self.nodes} nodes x {self.local_size} ranks"
        elif self.nodes == 1 and self.local_size > 1:
            text = f"one node of {self.local_size} ranks"
        else:
            return "no hierarchy, ranks on several nodes"
        return text + f", shared memory {'on' if self.shared_memory else 'off'}"

    def slice_index(self, rank: int) -> int:
        """Which slice of every bucket ``rank`` owns (see the note above)."""
        if not self.uses_hierarchy:
            return rank
        return self.local_rank(rank) * self.nodes + self.node_of(rank)


def resolve(topology: TopologyArg, world_size: int,
            group_ranks: Optional[list[int]] = None) -> NodeLayout:
    """Validate and resolve ``topology`` for a group of ``world_size`` ranks.

    ``group_ranks``: the job's ranks of a subgroup's members (None for the whole
    job), which torchrun's LOCAL_WORLD_SIZE places on nodes.
    """
    if topology is None:
        topology = Topology()
    elif isinstance(topology, str):
        if topology == "flat":
            topology = Topology.flat()
        elif topology in ("auto", "hierarchical"):
            topology = Topology()
        else:
            raise ValueError(f"topology must be a Topology, 'flat' or 'auto', got {topology!r}")
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, 'flat' or 'auto', got {type(topology).__name__}")
    local = topology.local_size
    if local is None:
        local = _local_size_from_env(world_size, topology.hierarchical) if group_ranks is None \
            else _local_size_of_subgroup_from_env(group_ranks)
    if not isinstance(local, int) or local < 1:
        raise ValueError(f"local_size must be a positive integer, got {local!r}")
    if world_size % local != 0:
        raise ValueError(f"world size {world_size} is not divisible by local_size {local}: "
                         "every node must run the same number of ranks")
    shared_memory = topology.shared_memory
    if shared_memory is None:
        shared_memory = os.environ.get("FGPSDP_SHARED_MEMORY", "1") != "0"
    return NodeLayout(world_size=world_size, local_size=local, hierarchical=topology.hierarchical,
                      shared_memory=bool(shared_memory))


def _local_size_from_env(world_size: int, hierarchical: bool = True) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return world_size  # not launched by torchrun: assume one node
    local = int(value)
    if local < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} is not a positive integer")
    if world_size % local:
        if not hierarchical:
            # Nodes of different sizes (torchrun agents with different
            # --nproc_per_node): without the hierarchy only "one node or
            # several" counts, and this node is not all of them. As a subgroup
            # spread unevenly over nodes (_local_size_of_subgroup_from_env).
            return 1
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world_size}"
                         " (nodes of different sizes: topology='flat' runs on them)")
    return local


def _local_size_of_subgroup_from_env(group_ranks: list[int]) -> int:
    """Members per node of a subgroup, torchrun numbering the job's ranks node by node.

    LOCAL_WORLD_SIZE counts the node's ranks, not the subgroup's: a data-parallel
    group [0, 1] of a node of 4 is one node of 2, a group [0, 2] of two nodes of
    2 is two nodes of 1. Members spread unevenly over nodes get no hierarchy
    (one rank per node: every link is taken as inter-node).
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return len(group_ranks)  # not launched by torchrun: assume one node
    local = int(value)
    if local < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} is not a positive integer")
    per_node: dict[int, int] = {}
    for rank in group_ranks:
        per_node[rank // local] = per_node.get(rank // local, 0) + 1
    counts = set(per_node.values())
    return counts.pop() if len(counts) == 1 else 1


def check_contiguous_nodes(layout: NodeLayout, group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """A problem sentence if this rank's node does not hold contiguous ranks, else None.

    torchrun numbers ranks node by node; GROUP_RANK (the node index it assigned)
    must then equal rank // local_size.
    """
    group_rank = os.environ.get("GROUP_RANK")
    local_rank = os.environ.get("LOCAL_RANK")
    if group_rank is None or local_rank is None or group is not None:
        return None
    rank = dist.get_rank()
    if (int(group_rank), int(local_rank)) != (layout.node_of(rank), layout.local_rank(rank)):
        return (f"rank {rank} is LOCAL_RANK {local_rank} of node GROUP_RANK {group_rank}, but "
                f"contiguous placement with local_size {layout.local_size} puts it at local rank "
                f"{layout.local_rank(rank)} of node {layout.node_of(rank)}")
    return None


@dataclass
class LinkGroups:
    """The process groups this rank uses per link class."""

    intra: Optional[dist.ProcessGroup]  # the ranks of this node
    inter: Optional[dist.ProcessGroup]  # the ranks with this local index, one per node


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout the job gave ``group`` (``init_process_group(timeout=...)``).
    Groups created without one wait torch's default (30 minutes on gloo) for a
    peer that stalls: ours must give up when the job's own collectives do."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        nccl = backend_of(pg, torch.device("cuda")) == "nccl"
        device = torch.device("cuda" if nccl else "cpu")
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # private API: other torch versions
        return None


class GroupNaming:
    """The names of one wrapper's groups on a subgroup (see [Note: naming the groups
    of a wrapper on a subgroup]): a hash of each group's ranks and a number the
    members agreed on, one per group."""

    def __init__(self, first_number: int):
        self._next = first_number

    def next_name(self, ranks: list[int]) -> str:
        text = f"fgpsdp:{'_'.join(map(str, sorted(ranks)))}:{self._next}"
        self._next += 1
        return hashlib.sha1(text.encode()).hexdigest()


_GROUPS_PER_WRAPPER = 1 << 16  # numbers per wrapper: more than its groups
_named_wrappers = 0  # wrappers this process built on a subgroup


def hashed_group_names(group: Optional[dist.ProcessGroup]) -> Optional[GroupNaming]:
    """How the wrapper's own groups over ``group`` are named: by a hash of their
    ranks and an agreed number (a GroupNaming), or by torch's counter (None).

    [Note: naming the groups of a wrapper on a subgroup]
    torch names a plain ``new_group`` by a per-process counter, which every rank
    of the job must advance alike. Only a subgroup's members build a wrapper on
    it, maybe while other ranks build theirs on other subgroups (pipeline
    stages, data-parallel groups beside tensor-parallel ones): both sets of
    groups then got the same names, and store keys, whose gloo rendezvous
    collided (an error or a hang). So a wrapper on a subgroup creates its
    groups with ``use_local_synchronization=True`` (only the members take
    part) under names of its own: a hash of the group's ranks and a number,
    from a block per wrapper that the members agree on (one above the most
    wrappers any member has built so far: a collective over ``group``), given
    to torch by standing in for its ``_process_group_name`` while the group is
    created. torch's own hashed names would not do: up to torch 2.13 the hash
    counts the groups a process holds, which differs between members that are
    also in other groups (wrappers on overlapping subgroups hung), and comes
    back after groups are destroyed (a rebuilt wrapper met a user's live group
    of that name, or its dropped groups' stale rendezvous addresses); torch
    2.14 salts it with the counter and advances the counter on the members
    alone, so every later counter-named group of the job got different names
    on members and others (a job-wide wrapper after one on a subgroup hung).
    The job's counter moves on no rank here, and no name comes back.
    """
    global _named_wrappers
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return None  # every rank of the job builds it: the counter agrees
    usable = hasattr(dist.distributed_c10d, "_process_group_name")  # private: another torch
    views = all_gather_objects((usable, _named_wrappers), group, "group naming")
    if not all(usable for usable, _ in views):
        return None
    _named_wrappers = max(count for _, count in views) + 1
    return GroupNaming(_named_wrappers * _GROUPS_PER_WRAPPER)


def new_group_like(ranks: list[int], group: Optional[dist.ProcessGroup],
                   naming: Optional[GroupNaming] = None) -> dist.ProcessGroup:
    """A process group of ``ranks`` with ``group``'s timeout (every rank of ``group``
    calls it, in the same order); ``naming``: see hashed_group_names."""
    kwargs = {}
    timeout = group_timeout(group)
    if timeout is not None:
        kwargs["timeout"] = timeout
    if naming is None:
        return dist.new_group(ranks, **kwargs)
    c10d = dist.distributed_c10d
    name = naming.next_name(ranks)
    torchs_names = c10d._process_group_name

    def named(group_ranks, use_hashed_name):
        return name if use_hashed_name else torchs_names(group_ranks, use_hashed_name)
    c10d._process_group_name = named
    try:
        return dist.new_group(ranks, use_local_synchronization=True, **kwargs)
    finally:
        c10d._process_group_name = torchs_names


def create_link_groups(layout: NodeLayout, group: Optional[dist.ProcessGroup],
                       naming: Optional[GroupNaming] = None) -> LinkGroups:
    """Create every node group and rail group, on every rank, in the same order."""
    def global_ranks(ranks):
        if group is None:
            return ranks
        return [dist.get_global_rank(group, r) for r in ranks]

    rank = dist.get_rank(group)
    intra = inter = None
    for node in range(layout.nodes):
        g = new_group_like(global_ranks(layout.intra_ranks(node)), group, naming)
        if layout.node_of(rank) == node:
            intra = g
    for local in range(layout.local_size):
        g = new_group_like(global_ranks(layout.rail_ranks(local)), group, naming)
        if layout.local_rank(rank) == local:
            inter = g
    return LinkGroups(intra=intra, inter=inter)
