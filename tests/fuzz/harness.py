"""Runs one fuzz target for a bounded time, in this process, and exits non-zero on a finding.

A target is a module (tests/fuzz/targets/NAME.py) with:
- ``seeds() -> list[bytes]``: the seed corpus, built in code so the target runs anywhere;
- ``run_one(data: bytes) -> None``: exercises one parser or decoder on one input;
- ``ALLOWED`` (optional): the exception types ``run_one`` may raise, by default
  ``(raydl.errors.RaydlError,)``;
- ``MIN_INPUTS`` and ``MIN_ACCEPTED``: the floor of a run. It goes on past ``--seconds`` (up to
  ``--max-seconds``) until it has run MIN_INPUTS inputs and MIN_ACCEPTED of them went through
  ``run_one`` without an allowed error (past every check, so past the first); a run that ends below
  its floor fails. A target that refuses every input, or one slowed to a crawl, is then a failure,
  not "no finding".

Inputs are seeds changed by mutations (bit flips, bytes, interesting integers and strings,
inserts, deletes, repeats, splices, truncation), plus raw bytes, all derived from integers that
Hypothesis draws (so a run is reproducible from its seed). A
finding is any of:
- an exception outside ``ALLOWED`` (Hypothesis shrinks the input first);
- a crash (faulthandler prints the native stack; the input is in ``OUT/current.bin``);
- a hang: one input running past ``--per-input-s`` (faulthandler dumps every thread's stack
  and exits);
- an allocation past ``--memory-mb`` above this process's baseline (address-space limit,
  so it surfaces as a MemoryError or a native allocation failure, never the OOM killer).

tests/fuzz/test_fuzz.py runs every target through this script for ``RAYDL_FUZZ_SECONDS``
(default 20) each. For a longer run on one target::

    .venv/bin/python tests/fuzz/harness.py tests/fuzz/targets/tar_index.py --seconds 3600 --seed random

The run is reproducible for a given ``--seed`` (default 0; scripts/test.sh draws a fresh one each run
and prints it, and the harness prints the seed it used).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import random
import resource
import sys
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

INTERESTING_INTS = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 60000, 65500,
                    0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**63, 2**64 - 1)
INTERESTING_TEXT = (b"-1", b"-512", b"abc", b"0", b"99999999999", b"777777777777", b"\x80\xff\xff\xff",
                    b"\xff\xff\xff\xff", b"\x00", b"size=", b"path=", b" ", b"\n", b"..", b"/", b"%", b"{", b"}",
                    b"\xff\xd8", b"\xff\xd9", b"\xff\xc0", b"\xff\xc2", b"\xff\xda", b"IHDR", b"PAR1")
ROUND_EXAMPLES = 100
PER_EXAMPLE = 8


def load_target(path: Path):
    spec = importlib.util.spec_from_file_location(f"fuzz_target_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


def _at(data: bytes | bytearray, where: int) -> int:
    return where % (len(data) + 1)


def apply(seed: bytes, ops: list[tuple], corpus: list[bytes]) -> bytes:
    """The seed with ``ops`` applied in order; every position wraps to the current length."""
    data = bytearray(seed)
    for op in ops:
        kind, where = op[0], op[1]
        i = _at(data, where)
        if kind == "flip" and i < len(data):
            data[i] ^= 1 << op[2]
        elif kind == "byte" and i < len(data):
            data[i] = op[2]
        elif kind == "int":
            value, width, order = op[2], op[3], op[4]
            data[i : i + width] = (value % (1 << (8 * width))).to_bytes(width, order)
        elif kind == "text":
            data[i : i + len(op[2])] = op[2]
        elif kind == "insert":
            data[i:i] = op[2]
        elif kind == "delete":
            del data[i : i + op[2]]
        elif kind == "repeat":
            chunk = bytes(data[i : i + op[2]])
            data[i:i] = chunk * op[3]
        elif kind == "splice":
            other = corpus[op[2] % len(corpus)]
            j = _at(other, op[3])
            data[i:] = other[j : j + op[4]] + bytes(data[i:])
        elif kind == "truncate":
            del data[i:]
    return bytes(data)


def random_op(rng: random.Random, corpus_size: int) -> tuple:
    """One mutation, drawn from ``rng``: the vocabulary ``apply`` knows."""
    where = rng.randrange(2**32)
    kind = rng.choice(("flip", "byte", "int", "text", "insert", "delete", "repeat", "splice", "truncate"))
    if kind == "flip":
        return kind, where, rng.randrange(8)
    if kind == "byte":
        return kind, where, rng.randrange(256)
    if kind == "int":
        return kind, where, rng.choice(INTERESTING_INTS), rng.choice((1, 2, 4, 8)), rng.choice(("little", "big"))
    if kind == "text":
        return kind, where, rng.choice(INTERESTING_TEXT)
    if kind == "insert":
        return kind, where, rng.randbytes(rng.randrange(65))
    if kind == "delete":
        return kind, where, rng.randrange(1, 4097)
    if kind == "repeat":
        return kind, where, rng.randrange(1, 513), rng.randrange(1, 17)
    if kind == "splice":
        return kind, where, rng.randrange(corpus_size), rng.randrange(2**32), rng.randrange(1, 4097)
    return kind, where


def mutants(example: int, corpus: list[bytes]) -> list[bytes]:
    """The PER_EXAMPLE inputs one Hypothesis example stands for: mostly mutated seeds, some raw bytes.

    Hypothesis draws one integer per example (its own overhead is about 1 ms an example, more
    than many targets take per input), and the inputs follow from it deterministically.
    """
    rng = random.Random(example)
    out = []
    for _ in range(PER_EXAMPLE):
        if rng.random() < 0.1:
            out.append(rng.randbytes(rng.randrange(2049)))
        else:
            ops = [random_op(rng, len(corpus)) for _ in range(rng.randrange(1, 9))]
            out.append(apply(rng.choice(corpus), ops, corpus))
    return out


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class Runner:
    """Runs inputs through one target, leaving each in ``current.bin`` until it has returned."""

    def __init__(self, module, out: Path, per_input_s: float) -> None:
        from raydl.errors import RaydlError

        self.module = module
        self.allowed = tuple(getattr(module, "ALLOWED", (RaydlError,)))
        self.current = out / "current.bin"
        self.per_input_s = per_input_s
        self.count = 0
        self.rejected = 0
        self.min_inputs = int(module.MIN_INPUTS)
        self.min_accepted = int(module.MIN_ACCEPTED)
        self.failed = False  # once set, inputs run past the time budget so Hypothesis can shrink

    @property
    def accepted(self) -> int:
        return self.count - self.rejected

    def floor_reached(self) -> bool:
        return self.count >= self.min_inputs and self.accepted >= self.min_accepted

    def __call__(self, data: bytes) -> None:
        self.current.write_bytes(data)
        faulthandler.dump_traceback_later(self.per_input_s, exit=True)
        try:
            self.module.run_one(data)
        except self.allowed:
            self.rejected += 1
        except BaseException:
            self.failed = True
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.count += 1


def fuzz(runner: Runner, corpus: list[bytes], seconds: float, base_seed: int, max_seconds: float) -> int:
    """Hypothesis rounds of ROUND_EXAMPLES inputs each, until ``seconds`` have passed and the target's floor is
    reached, or ``max_seconds`` have passed; returns rounds run."""
    start = time.monotonic()
    end, last = start + seconds, start + max(seconds, max_seconds)

    def going() -> bool:
        now = time.monotonic()
        return now < last and (now < end or not runner.floor_reached())

    rounds = 0
    strategy = st.integers(0, 2**64 - 1)
    while going():

        @settings(max_examples=ROUND_EXAMPLES, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink))
        @hypothesis_seed(base_seed + rounds)
        @given(strategy)
        def one_round(example: int) -> None:
            if runner.failed or going():
                for data in mutants(example, corpus):
                    runner(data)

        one_round()
        rounds += 1
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="how long a run below its floor goes on (default 3 x --seconds)")
    parser.add_argument("--seed", default="0", help="an integer, or 'random'")
    parser.add_argument("--memory-mb", type=int, default=1536, help="address space allowed above the baseline")
    parser.add_argument("--per-input-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    base_seed = random.randrange(2**32) if args.seed == "random" else int(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    faulthandler.enable(all_threads=True)

    module = load_target(args.target)
    if not all(hasattr(module, name) for name in ("MIN_INPUTS", "MIN_ACCEPTED")):
        print(f"fuzz: {args.target}: declare MIN_INPUTS and MIN_ACCEPTED, the floor of a run", file=sys.stderr)
        return 2
    corpus = list(module.seeds())
    if not corpus:
        print(f"fuzz: {args.target}: seeds() gave no seeds", file=sys.stderr)
        return 2
    runner = Runner(module, args.out, args.per_input_s)
    for data in corpus:  # warms the target's imports and caches before the limit is set
        runner(data)
    runner.count = runner.rejected = 0  # the floor counts mutated inputs, not the seeds
    limit = _address_space() + args.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    started = time.monotonic()
    try:
        rounds = fuzz(runner, corpus, args.seconds, base_seed, 3 * args.seconds if args.max_seconds is None
                      else args.max_seconds)
    except Exception:
        traceback.print_exc()
        print(f"fuzz: {args.target.stem}: FINDING after {runner.count} inputs (seed {base_seed}); "
              f"the last input is in {runner.current}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    counts = (f"{runner.count} inputs ({runner.rejected} rejected with an allowed error, {runner.accepted} "
              f"accepted; floor {runner.min_inputs} and {runner.min_accepted}) in {rounds} rounds, {took:.1f} s, "
              f"seed {base_seed}")
    if not runner.floor_reached():
        print(f"fuzz: {args.target.stem}: BELOW ITS FLOOR: {counts}", file=sys.stderr)
        return 3
    print(f"fuzz: {args.target.stem}: {counts}, no finding")
    runner.current.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
