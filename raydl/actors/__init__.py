"""The Ray actors' faces: what runs as an actor, and launching them.

    worker       LoaderWorker: a BatchMaker (raydl/batch/) that carries the worker list's version
    coordinator  one actor per loader: starts, places and replaces the workers
    launch       Ray's nodes as raydl sees them; starting workers on them; the room and cache checks
    peer         CheckpointPeer: receives a checkpoint and serves it on

Actors are plain classes; ray.remote is applied where they are started. Empty on purpose: the
coordinator's process imports only its own modules.
"""
