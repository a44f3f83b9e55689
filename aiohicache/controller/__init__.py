"""The controller: transfers between L1 and L2, the storage tier (L2 <-> L3), consensus.

- `Controller` (`_transfers`): plans load/write jobs on the tree, runs them through its
  workers and settles them;
- `StorageTier` (`_storage_tier`): prefetch from and backup to a `StorageBackend`;
- `Consensus` (`_consensus`): the tensor-parallel op log and tick.

Collaborators are passed in at construction; nothing here imports the public face.
"""

from ._consensus import AGAIN, Consensus, Op
from ._jobs import LoadJob, TransferCounters, WriteJob, _Job
from ._l3_parts import TP_SLOTS, PrefetchJob, StorageCounters, page_format, shard
from ._storage_tier import StorageTier
from ._transfers import Controller

__all__ = ("AGAIN", "TP_SLOTS", "Consensus", "Controller", "LoadJob", "Op", "PrefetchJob",
           "StorageCounters", "StorageTier", "TransferCounters", "WriteJob", "_Job",
           "page_format", "shard")
