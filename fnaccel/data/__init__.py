"""The data path: from a user's `DataLoader` to sharded, resumable batches on the device.

- `sharding`: the split of an epoch's order across ranks (`shard_batch`,
  `eval_shards`, `per_rank_batch_size`), shared by training and evaluation;
  which ranks split the data is `fnaccel.dist.data_parallel`'s answer alone.
- `sampler`: `ShardedBatchSampler`, the seeded order of a map-style dataset,
  positioned in O(1).
- `iterable`: `IterableShard`, the same split for an `IterableDataset`.
- `config`: `DataLoaderConfiguration` (re-exported by `fnaccel.utils`).
- `loader`: `prepare_loader`, which rebuilds a user's loader as a `PreparedLoader`.
- `prepared`: the live `PreparedLoader`, a cache behind the state's
  `DataPosition`, `batches` (`fa.batches`), which positions it from the state,
  and `end_epoch` (`fa.end_epoch`), which skips the rest of an epoch unread.
- `evaluation`: `eval_batches` (`fa.eval_batches`), the ordered split (padded
  across processes, never on one) that makes `gather_for_metrics` exact.

See docs/data.md.
"""
