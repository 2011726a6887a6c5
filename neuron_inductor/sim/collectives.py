"""`nki.collectives`: the namespace, so kernels that import it load; the collectives themselves are not modelled.

The interpreter runs one NeuronCore (or the two of an LNC2 kernel) in one process: there are no other ranks to
gather from, reduce with or permute to. A `ReplicaGroup` is built as the docs describe (lists of ranks, sub-groups
without overlap); every collective instruction raises NkiNotModelledError naming itself, so a kernel that reaches
one fails visibly, while one that only imports the module (a KV-data-parallel path left off) runs.
"""

from __future__ import annotations

from .errors import NkiError, NkiNotModelledError


class ReplicaGroup:
    """A group of ranks in a collective: a list of sub-groups, each a list of rank ids, with no rank in two."""

    def __init__(self, replica_groups):
        groups = [list(group) for group in replica_groups]
        ranks = [rank for group in groups for rank in group]
        if len(ranks) != len(set(ranks)):
            raise NkiError(f"nki.collectives.ReplicaGroup: sub-groups {groups} overlap; each rank may be in one only")
        self.replica_groups = groups

    def __repr__(self):
        return f"ReplicaGroup({self.replica_groups})"


def _not_modelled(name):
    def collective(*args, **kwargs):
        raise NkiNotModelledError(f"nki.collectives.{name}: collectives between ranks are not modelled by the "
                                  "interpreter (it runs one NeuronCore or one LNC2 pair, with no other ranks)")
    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = f"nki.collectives.{name}: raises NkiNotModelledError (no ranks to communicate with)."
    return collective


all_reduce = _not_modelled("all_reduce")
all_gather = _not_modelled("all_gather")
all_gather_v = _not_modelled("all_gather_v")
reduce_scatter = _not_modelled("reduce_scatter")
all_to_all = _not_modelled("all_to_all")
all_to_all_v = _not_modelled("all_to_all_v")
collective_permute = _not_modelled("collective_permute")
collective_permute_implicit = _not_modelled("collective_permute_implicit")
collective_permute_implicit_reduce = _not_modelled("collective_permute_implicit_reduce")
collective_permute_implicit_current_processing_rank_id = _not_modelled(
    "collective_permute_implicit_current_processing_rank_id")
rank_id = _not_modelled("rank_id")
