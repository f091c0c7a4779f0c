"""The data path: from a user's `DataLoader` to sharded, resumable batches on the device.

- `sharding`: the split of an epoch's order across ranks (`shard_batch`,
  `eval_shards`), shared by training and evaluation.
- `sampler`: `ShardedBatchSampler`, the seeded, resumable order of a map-style dataset.
- `iterable`: `IterableShard`, the same split for an `IterableDataset`.
- `config`: `DataLoaderConfiguration` (re-exported by `fnaccel.utils`).
- `loader`: `prepare_loader`, the live `PreparedLoader`, and `batches` (`fa.batches`).

See docs/data.md.
"""
