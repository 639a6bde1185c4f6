"""Making one batch in any process (a loader worker, or the Loader's own process while its workers start):
no Ray import.

    spec     WorkerSpec (one member's stages and the process's settings), MixtureSpec (every member's)
    maker    BatchMaker: a task in, a batch out; its threads and reused batch buffers
    member   MemberReader: one member's samples located, read, decoded into slots, through the user's stages
    run      BatchRun: one member's rows of one batch, step by step (fetch, enqueue, drain, finish)
    mixing   a mixture's task split by member, and the members' rows joined into one batch
    collate  a batch's column of one field, by the field's kind
    pools    the decode threads and the IO pool a maker's members share
"""
