"""Describe: what a Dataset is before anything runs.

    catalog     the Arrow table of samples and the shards they live in, and the Source contract that
                cuts samples out of them; image sizes on demand
    fingerprint the catalog's two fingerprints, hashed from its tables' buffers
    sizes       image width and height from the first bytes of a file (no pixel decode)
    transforms  the declarative stages and the per-sample program they compile to
    buckets     the aspect-ratio bucket set and which bucket an image goes to

Nothing here starts Ray or an actor; the sources (raydl/sources) list into the catalog.
"""
