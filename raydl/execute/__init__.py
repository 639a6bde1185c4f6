"""Execute: the actors and threads that carry the plan out.

    loader       Loader: starts the workers and the coordinator, hands out per-rank iterators
    bootstrap    the Loader's own process makes the first batches while the workers start
    coordinator  one actor per loader: starts, places and replaces the workers
    cluster      Ray's nodes as raydl sees them; starting workers on them
    worker       LoaderWorker: a batch task in, a batch out (fetch, decode, write into slots)

Actors are plain classes; ray.remote is applied where they are started. Empty on purpose: the
coordinator's process imports only its own modules.
"""
