"""Hostile images: one pixel limit for every format, checked from the header before anything is allocated, and a
resampler whose memory and CPU that limit bounds. Every crafted file is built here."""
from __future__ import annotations

import contextlib
import gc
import io
import pickle
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
from PIL import Image

import raydl
from raydl import native
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.transforms import (
    CenterCrop,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    compile_stages,
)
from raydl.errors import DecodeError
from raydl.native import decode
from raydl.plan.order import augmentation_seeds

pytestmark = pytest.mark.timeout(120)

LIMIT = decode.MAX_PIXELS


def _jpeg(w: int, h: int, **kw) -> bytes:
    rng = np.random.default_rng(w * 7919 + h)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", **kw)
    return buf.getvalue()


def _with_frame_size(jpeg: bytes, w: int, h: int) -> bytes:
    """`jpeg` with its frame header (SOF0/1/2) saying w x h: the scan stays that of the small image."""
    i = 2
    while True:
        marker, length = jpeg[i + 1], struct.unpack(">H", jpeg[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            return jpeg[: i + 5] + struct.pack(">HH", h, w) + jpeg[i + 9 :]
        i += 2 + length


def _png(w: int, h: int, *, rows: int | None = None) -> bytes:
    """A greyscale PNG of w x h (all zero) written by hand; `rows`: how many rows of pixel data it holds."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    idat = zlib.compress(bytes((1 + w) * (h if rows is None else rows)), 9)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _bombs() -> dict[str, tuple[bytes, int, int]]:
    """name -> (bytes, width, height): files whose headers promise far more pixels than they hold."""
    baseline = _with_frame_size(_jpeg(8, 8, quality=50), 60000, 60000)
    progressive = _with_frame_size(_jpeg(16, 16, progressive=True), 20000, 20000)
    return {
        "jpeg-60000x60000": (baseline, 60000, 60000),
        "progressive-20000x20000": (progressive, 20000, 20000),
        "png-20000x20000": (_png(20000, 20000, rows=1), 20000, 20000),  # past twice Pillow's limit: its error
        "png-10000x10000": (_png(10000, 10000, rows=1), 10000, 10000),  # past Pillow's limit: only its warning
    }


TRAIN = (Decode(), RandomResizedCrop(224), RandomHFlip(), Normalize.make("imagenet", None))


def _refusals(data: bytes):
    """Every decode entry point on one file: the loader's program (region decode, DCT-scaled or full scale, one
    at a time and batched) and the decode functions."""
    train = compile_stages(TRAIN)
    full = compile_stages((Decode(), CenterCrop(64)), dct_scaling=False)
    slot = np.empty(train.slot_shape(), train.dtype)
    yield "program.run", lambda: train.run(data, 1, slot)
    yield "full-scale program.run", lambda: full.run(data, 1, np.empty(full.slot_shape(), np.uint8))
    yield "program.run_many", lambda: _raise_first(train.run_many([(data, 1, slot), (data, 2, slot)]))
    yield "image_size", lambda: decode.image_size(data, max_pixels=LIMIT)
    yield "decode_rgb", lambda: decode.decode_rgb(data)
    if decode.is_jpeg(data) and native.jpeg_available():
        box = (0.0, 0.0, 64.0, 64.0)
        yield "jpeg_crop_resize_into", lambda: native.jpeg_crop_resize_into(data, box, slot, flip=False, **_AFFINE)


_AFFINE = dict(zip(("scale", "bias"), compile_stages(TRAIN)._affine, strict=True))


@contextlib.contextmanager
def _no_gc():
    """A garbage collection of a long-lived test process's heap is not charged to the call being timed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _raise_first(errors):
    for exc in errors:
        if exc is not None:
            raise exc


@pytest.mark.parametrize("name", list(_bombs()))
def test_a_bomb_is_refused_from_its_header_on_every_decode_path(name):
    """A header over the limit is a DecodeError naming the header's size and the limit, on every path (region
    decode, full scale, batched, decode_rgb, the C decoder itself), in well under 0.1 s of CPU: nothing decoded."""
    data, w, h = _bombs()[name]
    for path, call in _refusals(data):
        with _no_gc():
            t = time.process_time()
            with pytest.raises(DecodeError) as info:
                call()
            cpu = time.process_time() - t
        assert f"image is {w}x{h} ({w * h} pixels), over the pixel limit of {LIMIT}" in str(info.value), path
        assert cpu < 0.05, f"{path} took {cpu:.3f} s of CPU to refuse {name}"


def test_the_c_region_decoder_checks_the_frame_header_itself():
    """raydl_jpeg_crop_resize refuses a frame header over its max_pixels before jpeg_start_decompress (no
    Python check in front of it), for baseline and progressive files, and decodes the same files within it."""
    if not native.jpeg_available():
        pytest.skip("raydl.native._jpeg not built")
    ffi, lib, _ = native._load_jpeg()
    out = np.empty((8, 8, 3), np.uint8)
    for data in (_jpeg(48, 40), _jpeg(48, 40, progressive=True)):
        args = (ffi.from_buffer(data), len(data), 0.0, 0.0, 48.0, 40.0, 8, 8, 0, 0, ffi.NULL, ffi.NULL)
        err = ffi.new("char[]", 200)
        assert lib.raydl_jpeg_crop_resize(*args, ffi.from_buffer(out), 1, 0, 48 * 40 - 1, err, 200) == -5
        assert b"pixel limit" in ffi.string(err)
        assert lib.raydl_jpeg_crop_resize(*args, ffi.from_buffer(out), 1, 0, 48 * 40, err, 200) == 0


@pytest.mark.parametrize("fmt", ["JPEG", "progressive JPEG", "PNG", "WEBP", "BMP", "GIF"])
def test_max_pixels_below_a_real_image_is_a_decode_error_naming_the_size(fmt):
    """decode(max_pixels=) lower than an image's pixels refuses it, whatever its format, naming its size and the
    limit; at exactly its pixels it decodes."""
    rgb = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt.split()[-1], **({"progressive": True} if "progressive" in fmt else {}))
    data = buf.getvalue()
    for limit, refused in ((64 * 48 - 1, True), (64 * 48, False)):
        program = compile_stages((Decode(max_pixels=limit), CenterCrop(16)))
        out = np.empty(program.slot_shape(), program.dtype)
        if refused:
            with pytest.raises(DecodeError, match=rf"image is 64x48 \(3072 pixels\), over the pixel limit of {limit}"):
                program.run(data, 0, out)
            with pytest.raises(DecodeError, match="over the pixel limit"):
                decode.decode_rgb(data, max_pixels=limit)
        else:
            program.run(data, 0, out)


def test_max_pixels_is_a_stage_parameter_that_reaches_the_workers(tmp_path):
    """Dataset.decode(max_pixels=) is a field of the Decode stage: the compiled program carries it, it survives
    pickling (the worker spec travels to the workers so), and a worker refuses the larger image through on_error
    while the smaller one decodes."""
    (tmp_path / "c0").mkdir()
    Image.new("RGB", (20, 20), "red").save(tmp_path / "c0" / "small.png")  # 400 pixels
    Image.new("RGB", (50, 40), "blue").save(tmp_path / "c0" / "large.jpg")  # 2000 pixels
    ds = raydl.read_images(str(tmp_path)).decode(max_pixels=1000).center_crop(8)
    assert ds.stages[0] == Decode(max_pixels=1000)
    spec = pickle.loads(pickle.dumps(WorkerSpec(program=compile_stages(ds.stages), threads=1, on_error="skip")))
    assert spec.program.max_pixels == 1000
    worker = LoaderWorker(spec, ds.catalog, reuse_buffers=False)
    ids = np.arange(len(ds), dtype=np.int64)
    result = worker.run_batch(
        BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
    )
    [skipped] = result.skipped
    assert skipped.uri.endswith("large.jpg") and "image is 50x40 (2000 pixels), over the pixel limit of 1000" in (
        skipped.reason
    )
    assert len(result.batch["id"]) == 1
    assert Decode().max_pixels == LIMIT == (Image.MAX_IMAGE_PIXELS or LIMIT)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1000", None])
def test_max_pixels_must_be_a_positive_int(bad):
    """A limit that is not a positive int is a ValueError naming max_pixels, raised when the stage is made."""
    with pytest.raises(ValueError, match="max_pixels must be a positive int"):
        Decode(max_pixels=bad)


_CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from raydl.describe.transforms import Decode, Normalize, RandomHFlip, RandomResizedCrop, compile_stages
    from raydl.errors import DecodeError
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))  # the old code asked for 10 GiB
    data = sys.stdin.buffer.read()
    program = compile_stages((Decode(), RandomResizedCrop(224), RandomHFlip(), Normalize.make("imagenet", None)))
    out = np.empty(program.slot_shape(), program.dtype)

    def status_kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here: the decodes' own
        f.write("5")
    before = status_kib("VmRSS")
    for seed in range(3):
        try:
            program.run(data, seed, out)
            print("decoded")
        except DecodeError as exc:
            print("refused:", str(exc)[:80])
    print("grew", status_kib("VmHWM") - before)
    print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """
)


def _peak_kib(data: bytes) -> tuple[int, int, str]:
    """The child's peak RSS (KiB, the interpreter's own included), how far the decodes took it above what it
    held before them (KiB), and its output."""
    proc = _in_child(_CHILD, data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = int(proc.stdout.split("grew")[-1].split()[0])
    return int(proc.stdout.split("peak")[-1]), grew, proc.stdout


def _in_child(code: str, data: bytes = b"", timeout: float = 90) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (`data` on its stdin), so that a crash is this test's failure, not
    pytest's."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=data, capture_output=True,
                          timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def test_peak_memory_of_a_worker_decoding_the_bombs_stays_under_twice_a_normal_images():
    """A child process running the train program on each bomb peaks (ru_maxrss) below twice what the same
    process peaks at on a normal 1600x1200 photo-sized JPEG, and the decodes themselves (the peak above what
    the process held before them) take less than twice the normal image's."""
    normal, normal_grew, out = _peak_kib(_jpeg(1600, 1200, quality=90))
    assert "decoded" in out
    # Measured here: the normal image's decodes grow the process by 1.9-2.1 MiB, each bomb's by 0-0.4 MiB,
    # over an interpreter that peaks near 90 MiB: its own size would hide a bomb's 80 MiB buffer.
    assert 0 < normal_grew < 16 << 10, out
    for name, (data, _, _) in _bombs().items():
        peak, grew, out = _peak_kib(data)
        assert "refused" in out, out
        assert peak < 2 * normal, f"{name}: peak {peak >> 10} MiB vs {normal >> 10} MiB for a normal image"
        assert grew < 2 * normal_grew, f"{name}: the decodes took {grew} KiB vs {normal_grew} KiB for a normal image"




def test_a_1x10000000_png_resized_to_16_does_not_crash():
    """The vertical filter of a 10,000,000-row image downscaled to 16 has 1.25 M taps: their weights and row
    pointers are on the heap (they were stack arrays: SIGSEGV), and the result is the image's colour."""
    proc = _in_child(
        """
        import sys, numpy as np
        from raydl.describe.transforms import Decode, Resize, compile_stages
        program = compile_stages((Decode(), Resize((16, 16))))
        out = np.full((16, 16, 3), 7, np.uint8)
        program.run(sys.stdin.buffer.read(), 0, out)
        print("max", int(out.max()))
        """,
        _png(1, 10_000_000),
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    assert "max 0" in proc.stdout


def test_the_kernel_downscales_a_2000000_pixel_axis_to_one_pixel():
    """crop_resize_into on a 2,000,000 x 1 array to 1 x 1: 4 M taps, whose weights (32 MB) were a stack array.
    (Uniform: past ~16,000 taps a window's Q14 weights round to 0 and its remainder goes to one tap.)"""
    proc = _in_child(
        """
        import numpy as np
        from raydl import native
        src = np.full((2_000_000, 1, 3), 123, np.uint8)
        out = np.empty((1, 1, 3), np.uint8)
        native.crop_resize_into(src, (0, 0, 1, 2_000_000), out, flip=False)
        print("value", int(out[0, 0, 0]))
        """
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    assert "value 123" in proc.stdout


def test_the_region_decoder_keeps_its_row_window_off_a_small_thread_stack():
    """A 65000-row JPEG region-decoded to one pixel on a thread with a 256 KiB stack: its window of 130,001
    row pointers and their weights are on the heap (jpeg.c's stack arrays overflowed such a thread)."""
    if not native.jpeg_available():
        pytest.skip("raydl.native._jpeg not built")
    proc = _in_child(
        """
        import io, threading, numpy as np
        from PIL import Image
        from raydl import native
        buf = io.BytesIO()
        Image.new("RGB", (8, 65000), (90, 90, 90)).save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        done = []
        def run():
            out = np.empty((1, 1, 3), np.uint8)
            done.append(native.jpeg_crop_resize_into(data, (0, 0, 8, 65000), out, flip=False))
            done.append(int(out[0, 0, 0]))
        threading.stack_size(256 << 10)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        print("result", done)
        """
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    assert "result [True, 9" in proc.stdout  # grey 90, give or take JPEG's rounding


def test_a_20000000x1_png_resized_to_224_is_refused_in_bounded_cpu():
    """Every output row re-reads the whole 20 M-pixel span (13 s of CPU per sample before): the resize reads
    more filter taps than the pixel limit allows, so it is a DecodeError naming the bound, before any decode."""
    data = _png(20_000_000, 1)
    program = compile_stages((Decode(), Resize((224, 224))))
    with _no_gc():
        t = time.process_time()
        with pytest.raises(DecodeError, match=r"resizing a 20000000x1 box to 224x224 would read more filter taps than"):
            program.run(data, 0, np.empty((224, 224, 3), np.uint8))
        cpu = time.process_time() - t
    assert cpu < 1.0  # decoding the 20 M pixels, which the pixel limit bounds; no resize
    with pytest.raises(DecodeError, match="filter taps"):
        native.crop_resize_into(np.zeros((1, 20_000_000, 3), np.uint8), (0, 0, 20_000_000, 1),
                                np.empty((224, 224, 3), np.uint8), flip=False)


@pytest.mark.parametrize("w,h", [(9459, 9459), (65535, 1365), (1365, 65535), (8000, 6000), (1, 1), (3, 200000)])
@pytest.mark.parametrize("out", [(224, 224), (16, 16), (512, 1024), (1, 1)])
def test_the_work_bound_admits_every_ordinary_resize_within_the_limit(w, h, out):
    """Images within the default limit of ordinary proportions (square, 48:1 either way, 4:3, tiny, a 3-wide
    strip) resized whole to common outputs are within the kernel's bound, which bites only for extreme ones."""
    if not native.native_available():
        pytest.skip("no C kernels")
    work = native.resample_work((h, w), (0.0, 0.0, float(w), float(h)), *out)
    assert out[0] * out[1] <= work <= native.resample_bound(LIMIT, *out), (w, h, out, work)
    if out[0] > 1:  # a square output of a 1-row image re-reads its whole span once per output row
        extreme = native.resample_work((1, 20_000_000), (0, 0, 20_000_000, 1), *out)
        assert extreme > native.resample_bound(LIMIT, *out)


def test_a_bomb_under_the_limit_is_a_decode_error_when_memory_runs_out():
    """Within the pixel limit but past what the process may allocate (an address-space limit): the decoders'
    MemoryError becomes this sample's DecodeError, never a batch failure."""
    proc = _in_child(
        """
        import resource, sys
        from raydl.native import decode
        from raydl.errors import DecodeError
        data = sys.stdin.buffer.read()
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (100 << 20), resource.RLIM_INFINITY))
        try:
            decode.decode_rgb(data)
        except DecodeError as exc:
            print("DecodeError:", exc)
        """,
        _with_frame_size(_jpeg(8, 8), 9000, 9000),  # 81 M pixels, under the limit: 243 MB of RGB
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    assert "DecodeError: out of memory decoding a 9000x9000 image" in proc.stdout


def test_an_image_past_pillows_warning_is_refused_by_raydl_before_pillow_warns(recwarn):
    """raydl checks the size itself before Pillow opens the file (where Pillow's bomb warning was silenced, and
    the image then decoded): past the limit it is raydl's DecodeError, and no Pillow warning."""
    data = _png(10000, 10000, rows=1)  # past Pillow's MAX_IMAGE_PIXELS, under twice it
    with pytest.raises(DecodeError, match="over the pixel limit"):
        decode.decode_rgb(data)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
