"""The cycle check of ExecuTorch's group partitioner, with set operations instead of a Python loop.

XNNPACK's partitioner proposes its partitions through ExecuTorch's ``GroupBasedPartitioner``
(``executorch.exir.backend.canonical_partitioners.group_partitioner``, executorch 1.5.1 as pinned).
Its ``_merge_partitions`` tries every pair of candidate partitions, and ``_can_merge_partitions``
refuses a pair when a node outside both, a user of one of them, reaches back into them: for each such
user it walks that user's whole transitive downstream set in a generator (``any(n in combined for n in
downstreams)``). On the SmolLM2 int4 step method (30 layers, ~226,000 pairs) that walk ran ~435
million membership tests, the largest single cost of partitioning.

``merge_check_by_set_ops`` answers the same question with ``set.isdisjoint`` (which iterates the
smaller set, the pair's own nodes, in C) over the distinct external users, then runs the same final
``validate_partition`` BFS as ExecuTorch. The answer is the same for every pair, so the partitions are
the same (tests/test_group_merge.py compares both on random graphs and on the ``tiny`` step method).
"""

import contextlib


def can_merge_partitions(self, p1, p2, partitions_by_id) -> bool:
    """``GroupBasedPartitioner._can_merge_partitions``: whether merging partitions ``p1`` and ``p2``
    keeps the graph acyclic (no path leaves the merged nodes and comes back)."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    combined = partitions_by_id[p1].nodes.keys() | partitions_by_id[p2].nodes.keys()
    external = {user for node in combined for user in node.users} - combined
    downstreams_of = self.dependency_viewer.downstreams_of
    if any(not downstreams_of(user).isdisjoint(combined) for user in external):
        return False
    return validate_partition(list(combined))


@contextlib.contextmanager
def merge_check_by_set_ops():
    """ExecuTorch's group partitioner with ``can_merge_partitions`` as its pair check, inside."""
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    original = GroupBasedPartitioner._can_merge_partitions
    GroupBasedPartitioner._can_merge_partitions = can_merge_partitions
    try:
        yield
    finally:
        GroupBasedPartitioner._can_merge_partitions = original
