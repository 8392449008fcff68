"""Rollout batches: the batch type, its on-disk format, packing, mini/micro batching."""

from rlaudit.data.batch import KNOWN_FIELDS, Kind, RolloutBatch

__all__ = ["KNOWN_FIELDS", "Kind", "RolloutBatch"]
