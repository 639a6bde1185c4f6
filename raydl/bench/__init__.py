"""Benchmarks that put raydl side by side with other loaders (`raydl bench ...`).

loader.py    the orchestrator: rounds of peers, the table, --json, --plot
_runner.py   one peer, one epoch, in its own process; prints one JSON line
peers.py     what each peer runs (raydl, raydl-fast, torch, raydata, dataio, datago, ceiling)
_native_peers.py  DALI's CPU pipeline, SPDL, and the entropy-decoding floor
_clock.py    what a peer is given (PeerSpec) and how it is timed (EpochClock)
_transform.py  the PIL + numpy "train" and "buckets" transforms for the peers that lack them
report.py    medians, the text table and the chart
"""
