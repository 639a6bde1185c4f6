"""The tar indexer on hostile headers, each crafted byte by byte: it always ends, with a DataSourceError
naming the shard and the offset of the header at fault."""
from __future__ import annotations

import io
import tarfile

import pytest

from raydl.errors import DataSourceError
from raydl.sources._tar import MAX_EXTENDED_HEADER, index_tar

pytestmark = pytest.mark.timeout(10)  # the old indexer looped forever on a negative size

URI = "hostile.tar"


def octal(n: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, n)


def header(name: bytes = b"a.jpg", *, size: bytes | int = 0, typeflag: bytes = b"0",
           checksum: bytes | None = None) -> bytes:
    """One ustar header block, field by field (POSIX 1003.1 offsets)."""
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = octal(0o644, 8)
    h[108:116] = octal(0, 8)
    h[116:124] = octal(0, 8)
    h[124:136] = octal(size, 12) if isinstance(size, int) else size
    h[136:148] = octal(0, 12)
    h[156:157] = typeflag
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = checksum if checksum is not None else b"%06o\0 " % sum(h)
    return bytes(h)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def member(name: bytes, data: bytes, typeflag: bytes = b"0") -> bytes:
    return header(name, size=len(data), typeflag=typeflag) + pad(data)


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body)
    while len(str(n).encode()) + len(body) != n:
        n = len(str(n).encode()) + len(body)
    return str(n).encode() + body


def pax(records: bytes) -> bytes:
    return member(b"././@PaxHeader", records, typeflag=b"x")


END = bytes(1024)


def index(blob: bytes):
    return index_tar(lambda off, n: blob[off:off + n], len(blob), URI)


def assert_names(blob: bytes, offset: int, match: str) -> None:
    with pytest.raises(DataSourceError, match=match) as info:
        index(blob)
    assert URI in str(info.value) and f"offset {offset}" in str(info.value), str(info.value)
    assert info.value.uri == URI


def base256(n: int) -> bytes:
    """A 12-byte GNU base-256 number field (two's complement, first byte 0x80 or 0xff)."""
    return bytes([0xFF if n < 0 else 0x80]) + (n % 256 ** 11).to_bytes(11, "big")


@pytest.mark.parametrize("size", [-512, -1, -(2 ** 80)])
def test_negative_base256_size_is_an_error_not_a_loop(size):
    """A base-256 size field saying a negative number (-512 made the old indexer step back to where it was,
    forever) is a corrupt header at its offset."""
    blob = member(b"ok.jpg", b"x" * 600) + header(b"a.jpg", size=base256(size)) + END
    assert_names(blob, 1536, rf"corrupt tar header at offset 1536 \(negative size {size}\)")


@pytest.mark.parametrize("value", [b"abc", b"-512", b"+5", b" 5", b"0x10", b"", b"\xd9\xa3", b"9" * 5000])
def test_pax_size_that_is_not_a_decimal_number_is_a_data_source_error(value):
    """pax `size=abc` (a bare ValueError before), `size=-512` (a member of size -512 before), signs, hex,
    non-ASCII digits and a 5000-digit number: a corrupt header naming the member and its pax header."""
    head = member(b"ok.jpg", b"x") + pax(pax_record(b"size", value))
    at = len(head)
    assert_names(head + header(b"a.jpg") + END, at,
                 rf"corrupt tar header at offset {at} \(its pax header at offset 1024 gives size")


def test_pax_size_past_the_end_is_a_truncated_shard():
    """A well-formed pax size larger than what is left of the shard: truncated, naming the member."""
    blob = pax(pax_record(b"size", b"99999999999")) + header(b"a.jpg") + END
    assert_names(blob, 1024, "truncated tar shard: the member at offset 1024 needs 99999999999 bytes")


@pytest.mark.parametrize("records", [
    b"abc path=x\n",  # length not a number
    b"0 path=x\n",  # length 0 (the old loop's end condition)
    b"3 p=\n",  # length shorter than the record's own "<length> k=\n"
    b"200 path=x\n",  # length past the header
    b"10 path=xy",  # no newline at the record's end
    b"11 pathxyz\n",  # no '='
    b"10  =value\n",  # empty key
    b"9path=xy\n",  # no space after the length
    b" 9 path=x\n",  # a space first
])
def test_malformed_pax_records_name_the_pax_header(records):
    """Every malformed pax record (length, newline, key=value) is a corrupt pax header at its offset; a
    record whose length does not move the parser forward cannot loop."""
    blob = member(b"ok.jpg", b"x") + pax(records) + header(b"a.jpg") + END
    assert_names(blob, 1024, "corrupt pax header at offset 1024")


def test_pax_records_and_nul_padding_are_read():
    """Well-formed pax path and size records (NUL padding after them) give the member's name and size."""
    data = b"y" * 700
    records = pax_record(b"path", "ü/long".encode() * 30) + pax_record(b"size", b"700") + b"\0" * 7
    blob = pax(records) + header(b"short.jpg", size=0) + pad(data) + END
    (m,) = index(blob).members
    assert (m.name, m.size, blob[m.offset:m.offset + m.size]) == ("ü/long" * 30, 700, data)


def test_gnu_long_name_over_the_limit_is_an_error():
    """A GNU long name (type L) header of more than MAX_EXTENDED_HEADER bytes is not read into memory."""
    n = MAX_EXTENDED_HEADER + 1
    blob = member(b"ok.jpg", b"x") + header(b"././@LongLink", size=n, typeflag=b"L") + pad(b"n" * n) + END
    assert_names(blob, 1024, f"a {n}-byte extended header")


def test_gnu_long_name_is_used():
    """A GNU long name (type L) names the next member."""
    blob = member(b"././@LongLink", b"d/" + b"n" * 300 + b".jpg\0", typeflag=b"L") + member(b"d/nnn", b"z") + END
    (m,) = index(blob).members
    assert m.name == "d/" + "n" * 300 + ".jpg" and m.size == 1


@pytest.mark.parametrize("size,offset", [(10 ** 9, 1024), (base256(2 ** 70), 1024)])
def test_members_running_past_the_end_are_truncated_shards(size, offset):
    """An octal or base-256 size past the end of the shard: truncated, naming the member's offset."""
    blob = member(b"ok.jpg", b"x") + header(b"a.jpg", size=size) + END
    assert_names(blob, offset, f"truncated tar shard: the member at offset {offset}")


@pytest.mark.parametrize("field,value", [
    ("size", b"zzzzzzzzzzz\0"),  # not octal
    ("checksum", b"0000000\0"),  # wrong checksum
    ("checksum", b"garbage!"),  # not a number
])
def test_unparsable_fields_are_corrupt_headers(field, value):
    """A size that is not a number, a wrong or unparsable checksum: a corrupt header at its offset."""
    kw = {field: value}
    blob = member(b"ok.jpg", b"x") + header(b"a.jpg", **kw) + END
    assert_names(blob, 1024, "corrupt tar header at offset 1024")


def test_sparse_member_is_refused():
    """A GNU sparse member (type S): its data is not the file's bytes, so it is refused, not indexed."""
    blob = member(b"ok.jpg", b"x") + member(b"s.jpg", b"q" * 10, typeflag=b"S") + END
    assert_names(blob, 1024, "GNU sparse member")


def test_odd_names_are_kept_as_bytes_say():
    """Names that are not UTF-8, or empty, are indexed (grouping decides what to do with them)."""
    blob = member(b"\xff\xfe.jpg", b"a") + member(b"", b"b") + END
    assert [m.name for m in index(blob).members] == ["\udcff\udcfe.jpg", ""]


def test_every_step_moves_forward_on_random_headers():
    """Random header bytes (with a fixed checksum, so they parse) end within shard size / 512 reads."""
    import random

    rng = random.Random(17)
    for _ in range(300):
        blocks = []
        for _ in range(rng.randint(1, 6)):
            h = bytearray(header(b"r.jpg", size=rng.randint(0, 3000)))
            for _ in range(rng.randint(1, 8)):
                h[rng.randrange(124, 160 if rng.random() < 0.5 else 512)] = rng.randrange(256)
            h[148:156] = b" " * 8
            h[148:156] = b"%06o\0 " % sum(h)
            blocks.append(bytes(h) + bytes(rng.randint(0, 4) * 512))
        blob = b"".join(blocks) + END
        reads = []

        def read(off, n, blob=blob):
            reads.append(off)
            return blob[off:off + n]

        try:
            index_tar(read, len(blob), URI, window=512)
        except DataSourceError as exc:
            assert URI in str(exc) and "offset" in str(exc)
        assert len(reads) <= len(blob) // 512 + 1


def test_a_member_name_that_is_not_utf8_lists_with_escapes(tmp_path):
    """A member name that is not UTF-8 lists (its key shown with \\x escapes), where the catalog's string
    column raised UnicodeEncodeError before (found by the tar_index fuzz target)."""
    import raydl

    path = tmp_path / "latin1.tar"
    path.write_bytes(member(b"caf\xe9.jpg", b"jpeg") + END)
    ds = raydl.read_webdataset(str(path), label_field=None)
    assert ds.catalog.samples().key == ["caf\\xe9"]


def test_the_fast_header_reader_agrees_with_tarfile_or_leaves_the_header_to_it():
    """index_tar reads ordinary headers itself (_plain_header) and any other through tarfile.TarInfo.frombuf:
    on real headers (ustar, pax, GNU long names) and thousands of mutations of them, whatever it reads itself
    is exactly what frombuf reads, and it leaves to frombuf every header that frombuf refuses."""
    import random

    from raydl.sources._tar import _plain_header

    headers = []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name in ("a.jpg", "dir/" * 30 + "long.jpg", "caf\u00e9.cls"):
                info = tarfile.TarInfo(name)
                info.size = 700
                tar.addfile(info, io.BytesIO(b"x" * 700))
        data = buf.getvalue()
        headers += [data[i : i + 512] for i in range(0, len(data) - 1024, 512) if data[i + 257 : i + 262] == b"ustar"]
    assert all(_plain_header(h) is not None for h in headers)  # the fast path is taken on what shards hold
    rng = random.Random(0)
    taken = 0
    for _ in range(3000):
        h = bytearray(rng.choice(headers))
        for _ in range(rng.randint(1, 3)):
            h[rng.randrange(512)] = rng.choice([0, 32, 45, 48, 55, 56, 76, 95, 120, 128, 255, rng.randrange(256)])
        if rng.random() < 0.8:  # mostly with a right checksum, so that the fields themselves are read
            h[148:156] = b"%06o\0 " % (256 + sum(h) - sum(h[148:156]))
        h = bytes(h)
        fast = _plain_header(h)
        try:
            ref = tarfile.TarInfo.frombuf(h, "utf-8", "surrogateescape")
        except (tarfile.HeaderError, ValueError, OverflowError):
            assert fast is None, h
            continue
        if fast is not None:
            taken += 1
            assert (fast.name, fast.size, fast.type, fast.isreg()) == (ref.name, ref.size, ref.type, ref.isreg())
    assert taken > 1000
