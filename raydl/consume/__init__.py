"""Consume: one trainer rank's view of the loader.

    iterator  DataIterator (iter_batches, iter_torch_batches, state_dict, stats) and IteratorStats
    formats   batch formats: numpy (as made), pyarrow, pandas; collate_fn
    torch     numpy batches to torch tensors

The Loader (raydl/execute/loader.py) hands out the iterators.
"""
