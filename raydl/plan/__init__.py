"""Plan: pure decisions, tested without Ray.

    order       the epoch's global order, bucket-pure batches, batches per rank, resume offsets, seeds
    scheduling  where workers go, which worker a batch goes to, how deep to prefetch
    tasks       a batch task (what a rank asks for) and its result (what comes back)
    failures    a sample that failed, and the error policy (on_error) that skips, replaces or raises it
    timeouts    how long an iterator waits for a batch by default (a floor, and the waits seen so far)

Empty on purpose: the coordinator imports plan.scheduling alone, without numpy-heavy modules.
"""
