"""A tiny causal transformer pretrained under Ray Train on two token corpora mixed by weight, resumable.

    python examples/llm_pretrain.py                                   # demo corpora, 300 steps
    python examples/llm_pretrain.py --checkpoint-dir ~/ckpt/llm       # run it again to resume
    python examples/llm_pretrain.py --corpus web=/data/web --corpus code=/data/code.parquet \\
        --weight web=0.8 --weight code=0.2 --vocab 50304 --eod 0 --checkpoint-dir ~/ckpt/llm

- `raydl.read_tokens` reads each corpus (a Megatron `.bin`/`.idx` prefix, or a Parquet file of token lists)
  as windows of `--seq-len` + 1 tokens; `raydl.mix` mixes them by weight, so every batch holds each corpus's
  share. Without `--corpus` the script writes two demo corpora (a Megatron dataset of counting runs and a
  Parquet file of repeated motifs, both easy to learn) under the checkpoint folder.
- The model embeds each token's `position_ids` (its position within its own document) and attends only
  within the document, so packed documents never see each other.
- Every `--checkpoint-every` steps each rank saves its iterator's `state_dict()` into the Ray Train
  checkpoint it reports (rank 0 adds the model and optimizer). Run the same command again with the same
  `--checkpoint-dir` after the job was killed: Ray Train hands the latest checkpoint to the workers, and each
  rank goes on with the exact window after the checkpointed step. Without `--checkpoint-dir` the run
  lives in a temporary folder, removed afterwards.
- `--crash-at-step N` kills the run at step N as a `kill -9` of the driver would (after Ray Train has
  recorded the checkpoints reported so far), to try the resume; `--log-windows DIR` writes which windows
  each step trained on, one JSON line per step in DIR/rank<r>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

import raydl

DEMO_VOCAB = 512
DEMO_EOD = 0
DEMO_WEIGHTS = {"counting": 0.7, "motifs": 0.3}
RUN_NAME = "llm-pretrain"


# -- the demo corpora ----------------------------------------------------------------------
def write_megatron(prefix: str, docs: list[np.ndarray]) -> None:
    """PREFIX.bin (the documents' tokens end to end, uint16) and PREFIX.idx (Megatron-LM's MMIDIDX version 1
    index, as its IndexedDatasetBuilder writes it: each document one sequence)."""
    import struct

    lengths = np.array([len(d) for d in docs], np.int32)
    pointers = np.zeros(len(docs), np.int64)
    pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * 2  # byte offsets of uint16 tokens
    np.concatenate(docs).astype(np.uint16).tofile(prefix + ".bin.tmp")
    # magic, version 1, dtype code 8 (uint16), sequences, documents
    with open(prefix + ".idx.tmp", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")


def write_demo_corpora(folder: str, documents: int, seed: int = 0) -> dict[str, str]:
    """Two corpora of `documents` documents each, written once (a restart reads the same files): counting
    runs (a Megatron dataset) and repeated motifs (a Parquet file). Tokens are 1..DEMO_VOCAB-1; 0 is the
    end-of-document token read_tokens adds."""
    os.makedirs(folder, exist_ok=True)
    paths = {"counting": os.path.join(folder, "counting"), "motifs": os.path.join(folder, "motifs.parquet")}
    rng = np.random.default_rng(seed)
    if not os.path.exists(paths["counting"] + ".idx"):
        starts, lengths = rng.integers(1, DEMO_VOCAB, documents), rng.integers(16, 160, documents)
        write_megatron(
            paths["counting"],
            [(s - 1 + np.arange(n)) % (DEMO_VOCAB - 1) + 1 for s, n in zip(starts, lengths, strict=True)],
        )
    if not os.path.exists(paths["motifs"]):
        docs = [
            np.tile(rng.integers(1, DEMO_VOCAB, rng.integers(3, 7)), rng.integers(4, 30))
            for _ in range(documents)
        ]
        table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))})
        pq.write_table(table, paths["motifs"] + ".tmp", row_group_size=64)
        os.replace(paths["motifs"] + ".tmp", paths["motifs"])
    return paths


def dataset(corpora: dict[str, str], weights: dict[str, float], *, seq_len: int, eod: int | None):
    """The corpora as windows of seq_len + 1 tokens, mixed by weight."""
    return raydl.mix(
        {name: raydl.read_tokens(path, seq_len=seq_len, eod=eod) for name, path in corpora.items()},
        weights=weights,
    )


def make_loader(ds, *, batch_size: int, workers: int):
    """The loader whose iterators the ranks consume (a rank's batches depend only on these arguments)."""
    return ds.loader(batch_size=batch_size, world_size=workers, seed=0, cpus_per_worker=0.25)


# -- the model -----------------------------------------------------------------------------
def positional(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embeddings of each token's position within its document (any position, no table)."""
    freqs = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    angles = position_ids[..., None].float() * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask: causal, and only within a document (a document starts where its
    position_ids restart; the window's first token starts one too)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = starts.cumsum(1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
        )
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + positional(position_ids, self.dim)
        mask = document_mask(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


# -- one training rank ---------------------------------------------------------------------
def restore(checkpoint, rank: int, model, opt, it) -> tuple[int, list[float]]:
    """Model, optimizer and this rank's iterator from a checkpoint; returns (step, loss curve). A checkpoint
    of another world size gives every rank rank 0's iterator state: the rest of the epoch is re-dealt."""
    with checkpoint.as_directory() as d:
        model.load_state_dict(torch.load(os.path.join(d, "model.pt")))
        opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt")))
        mine = os.path.join(d, f"loader-rank{rank}.json")
        world = len([n for n in os.listdir(d) if n.startswith("loader-rank")])
        same_world = world == ray.train.get_context().get_world_size() and os.path.exists(mine)
        with open(mine if same_world else os.path.join(d, "loader-rank0.json")) as f:
            state = json.load(f)
    it.load_state_dict(state["loader"])
    return state["step"], state["curve"]


def save(rank: int, step: int, curve: list[float], model, opt, it) -> None:
    """Report a checkpoint: every rank its iterator's state_dict, rank 0 also the model and optimizer."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"loader-rank{rank}.json"), "w") as f:
            json.dump({"step": step, "curve": curve, "loader": it.state_dict()}, f)
        if rank == 0:
            plain = model.module if hasattr(model, "module") else model  # DDP's wrapper
            torch.save(plain.state_dict(), os.path.join(d, "model.pt"))
            torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
        metrics = {"step": step, "loss": curve[-1], "curve": curve}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def crash(config: dict) -> None:
    """Kill the run as `kill -9` of its driver would: the local Ray goes with it, and the steps since the last
    checkpoint are lost. Ray Train first records the checkpoints reported so far."""
    ray.train.get_all_reported_checkpoints()
    if ray.get_runtime_context().get_node_id() == config["driver_node"]:
        os.kill(config["driver_pid"], signal.SIGKILL)
    os._exit(1)


def train_loop_per_worker(config: dict) -> None:
    rank = ray.train.get_context().get_world_rank()
    it = config["loader"].iterator(rank)
    torch.manual_seed(0)
    model = TinyLM(config["vocab"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step, curve, losses = 0, [], []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        step, curve = restore(checkpoint, rank, model, opt, it)
    model = prepare_model(model)
    log = None
    if config["log_windows"]:
        os.makedirs(config["log_windows"], exist_ok=True)
        log = open(os.path.join(config["log_windows"], f"rank{rank}.jsonl"), "a")  # noqa: SIM115
    while step < config["steps"]:
        for batch in it.iter_torch_batches():  # one epoch of the mix, or the rest of one
            logits = model(batch["input_ids"], batch["position_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            losses.append(loss.item())
            if log is not None:
                windows = [[s, int(i)] for s, i in zip(batch["source"], batch["id"], strict=True)]
                log.write(json.dumps({"step": step, "windows": windows}) + "\n")
                log.flush()
            if step % config["checkpoint_every"] == 0 or step == config["steps"]:
                curve.append(sum(losses) / len(losses))
                losses = []
                save(rank, step, curve, model, opt, it)
            if step == config["crash_at_step"]:
                crash(config)
            if step >= config["steps"]:
                break  # the loader's epoch would go on from here
    if log is not None:
        log.close()


# -- the driver ----------------------------------------------------------------------------
def run(
    corpora: dict[str, str],
    weights: dict[str, float],
    *,
    storage: str,
    steps: int = 300,
    seq_len: int = 64,
    batch_size: int = 16,
    workers: int = 1,
    vocab: int = DEMO_VOCAB,
    eod: int | None = DEMO_EOD,
    checkpoint_every: int = 50,
    crash_at_step: int | None = None,
    log_windows: str | None = None,
):
    """Train under Ray Train with its run kept in `storage` (a run there already resumes); returns Ray
    Train's Result."""
    ds = dataset(corpora, weights, seq_len=seq_len, eod=eod)
    print(
        f"{len(ds)} windows of {seq_len + 1} tokens an epoch from {', '.join(corpora)} "
        f"(weights {weights}); {steps} steps of {batch_size} windows on {workers} rank(s)",
        flush=True,
    )
    config = {
        "steps": steps,
        "vocab": vocab,
        "checkpoint_every": checkpoint_every,
        "log_windows": log_windows,
        "crash_at_step": crash_at_step,
        "driver_pid": os.getpid(),
        "driver_node": ray.get_runtime_context().get_node_id(),
    }
    with make_loader(ds, batch_size=batch_size, workers=workers) as loader:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={**config, "loader": loader},
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}
            ),
            run_config=RunConfig(
                name=RUN_NAME, storage_path=storage, checkpoint_config=CheckpointConfig(num_to_keep=2)
            ),
        )
        result = trainer.fit()
    if result.error:
        raise result.error
    return result


def named(values: list[str], flag: str, kind=str) -> dict:
    """NAME=VALUE arguments as a dict."""
    out = {}
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} takes NAME=VALUE, got {v!r}")
        out[name] = kind(value)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a token corpus for read_tokens (repeatable; default: two demo corpora)",
    )
    parser.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="NAME=W",
        help="a corpus's mixing weight (default: 0.7/0.3 for the demo, equal otherwise)",
    )
    parser.add_argument("--vocab", type=int, default=DEMO_VOCAB, help="the corpora's vocabulary size")
    parser.add_argument(
        "--eod",
        type=int,
        default=None,
        help=f"end-of-document token id (default: {DEMO_EOD} for the demo, none otherwise)",
    )
    parser.add_argument("--documents", type=int, default=400, help="documents in each demo corpus")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers (ranks)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="Ray Train's storage; a run there resumes (default: a temporary folder)",
    )
    parser.add_argument(
        "--crash-at-step", type=int, default=None, help="kill the run at this step (try a resume)"
    )
    parser.add_argument(
        "--log-windows",
        default=None,
        metavar="DIR",
        help="write each step's windows (source, id) to DIR/rank<r>.jsonl",
    )
    args = parser.parse_args(argv)
    if args.checkpoint_dir is None:
        with tempfile.TemporaryDirectory(prefix="raydl-llm-") as tmp:
            return train(args, tmp)
    return train(args, os.path.abspath(os.path.expanduser(args.checkpoint_dir)))


def train(args: argparse.Namespace, storage: str) -> None:
    corpora = named(args.corpus, "--corpus")
    eod = args.eod
    if not corpora:
        corpora = write_demo_corpora(os.path.join(storage, "corpora"), args.documents)
        eod = DEMO_EOD if eod is None else eod
    weights = named(args.weight, "--weight", float) or (
        DEMO_WEIGHTS if set(corpora) == set(DEMO_WEIGHTS) else dict.fromkeys(corpora, 1.0)
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    result = run(
        corpora,
        weights,
        storage=storage,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        workers=args.workers,
        vocab=args.vocab,
        eod=eod,
        checkpoint_every=args.checkpoint_every,
        crash_at_step=args.crash_at_step,
        log_windows=args.log_windows,
    )
    curve = (result.metrics or {}).get("curve", [])
    print("mean loss every", args.checkpoint_every, "steps:", " ".join(f"{v:.2f}" for v in curve))
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    ray.shutdown()


if __name__ == "__main__":
    main()
