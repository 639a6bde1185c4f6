"""Checkpoint transfer: publish once, fetch peer to peer with one-sided RMA reads.

    ref = checkpoint.publish(model.state_dict())      # laid out once, served from this process
    state = checkpoint.fetch(ref)                     # on any peer: dict[str, Tensor] on the bytes read
    refs = checkpoint.broadcast(ref, peers)           # many peers, each serving on what it has

Ray is the control plane (the small, picklable CheckpointRef travels through
it); libfabric (raydl.native.pyfi) moves the bytes. The checkpoint is laid out
as a safetensors file in one buffer registered with the fabric, so a fetched
copy is a valid .safetensors file and tensors are built on it without another
copy; each chunk carries an XXH3-64 digest checked on arrival. Every published
checkpoint can also be fetched through Ray's object store, served on demand.

The package, along its seams:
    layout        the safetensors bytes: header, packing, tensors, digests (pure)
    ref           CheckpointRef, FetchedCheckpoint, HolderLocation (what travels through Ray)
    held          HeldCopy / HeldCopies: the copies a process serves, and their owner
    fabric        the fabric transport: FabricClient, pull()
    object_store  the object-store transport served on demand; holder_status()
    api           publish, fetch, unpublish: one process's checkpoints (prepare re-exported)
    process       what a process holds for checkpoints: copies, buffers, fabric client, endpoints
    startup       prepare(): the fabric side and a receive buffer ahead of the first fetch; the size hint
    chain         broadcast() over a chain of peers that pipelines
    peer_actor    starts a CheckpointPeer (raydl/actors/peer.py): receives a checkpoint, serves it on
    target        where a fetch lands: a pooled buffer, or an into= file allocated in full first

Importing it starts libfabric on a background thread (checkpoint.prepare();
RAYDL_CHECKPOINT_PREPARE=0 turns it off, a size such as 512MiB also faults a
receive buffer that large in; inside Ray, by default, one of the cluster's
last published checkpoint size), but opens no endpoint: nothing listens until
something is published, and the last unpublish closes the listener (see
docs/security.md).
"""

from raydl.checkpoint.api import DEFAULT_CHUNK, fetch, prepare, publish, unpublish
from raydl.checkpoint.api import prepare_at_import as _prepare_at_import
from raydl.checkpoint.chain import broadcast
from raydl.checkpoint.ref import CheckpointRef, FetchedCheckpoint
from raydl.errors import CheckpointError

__all__ = [
    "DEFAULT_CHUNK",
    "CheckpointError",
    "CheckpointRef",
    "FetchedCheckpoint",
    "broadcast",
    "fetch",
    "peer_actor",
    "prepare",
    "publish",
    "unpublish",
]


def peer_actor(node_id: str | None = None, *, bind: str | None = None, provider: str | None = None):
    """Start a CheckpointPeer actor (raydl/actors/peer.py): a broadcast target that serves on what it holds.
    See `raydl.actors.peer.peer_actor`; imported here on first call, since the actor imports this package."""
    from raydl.actors.peer import peer_actor as start

    return start(node_id, bind=bind, provider=provider)


_prepare_at_import()
