"""Consume: one trainer rank's view of the loader.

    iterator  DataIterator (iter_batches, iter_torch_batches, state_dict, stats) and IteratorStats
    torch     numpy batches to torch tensors

The Loader (raydl/execute/loader.py) hands out the iterators.
"""
