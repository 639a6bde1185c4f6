"""gs:// and az:// without Ray, against fake-gcs-server and azurite: listings of more than one page, string
prefixes, paths that do not exist named by URI, options validated with no secret in a repr or an error, the node
cache's store identity, YAML `gcs:`/`azure:` sections and `raydl index`."""
from __future__ import annotations

import io
import pickle
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.errors import DataSourceError, ObjectChangedError
from raydl.storage import storage_for
from raydl.storage.azure import AzureStorage
from raydl.storage.gcs import GCSStorage

pytestmark = pytest.mark.timeout(120)

SECRET_KEY = "c2VjcmV0LWtleS1ub3Qtc2hvd24tYW55d2hlcmUtMTIzNDU2Nzg5MA=="
SECRET_SAS = "sv=2022-11-02&ss=b&srt=co&sp=rl&se=2030-01-01T00:00:00Z&sig=TOPSECRETSIGNATURE%3D"


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, payload in (("a.jpg", b"x"), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def test_listing_of_more_than_one_page_is_complete(cloud):
    """More keys than one listing page holds (GCS 1000, Azure 5000) all come back, with sizes; a string prefix
    lists exactly the keys that start with it."""
    n = 1003 if cloud.scheme == "gs" else 5003
    cloud.put_many({f"many/k-{i:05d}.bin": b"x" * (i % 7) for i in range(n)})
    cloud.put("many2/other.bin", b"y")
    storage = cloud.storage()
    got = {o.uri: o.size for o in storage.list(f"{cloud.root}many/")}
    assert len(got) == n
    assert got[f"{cloud.root}many/k-{n - 1:05d}.bin"] == (n - 1) % 7
    assert [o.uri for o in storage.list(f"{cloud.root}many/k-0100")] == [
        f"{cloud.root}many/k-{i:05d}.bin" for i in range(n) if f"{i:05d}".startswith("0100")]
    assert [o.uri for o in storage.list(f"{cloud.root}many/k-00007.bin")] == [f"{cloud.root}many/k-00007.bin"]
    assert len(list(storage.list(f"{cloud.root}many"))) == n + 1  # a string prefix: many2/ too


def _missing(call, uri: str) -> None:
    with pytest.raises(DataSourceError) as info:
        call()
    assert str(info.value) == f"{uri!r} does not exist" and info.value.uri == uri


def test_every_read_of_a_path_that_does_not_exist_names_it(cloud, monkeypatch, tmp_path):
    """A shard, a Parquet file, a prefix with nothing under it and a missing bucket are DataSourceErrors naming
    their URI; a glob that matches nothing stays a ValueError; patterns and globs find what is there."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    kw = cloud.kw
    for i in range(3):
        cloud.put(f"d/s-{i}.tar", _tar())
    buf = io.BytesIO()
    pq.write_table(pa.table({"n": [1, 2]}), buf)
    cloud.put("p/ok.parquet", buf.getvalue())
    base = cloud.root.rstrip("/")
    assert len(raydl.read_webdataset(f"{base}/d/s-{{0..2}}.tar", **kw)) == 3
    assert len(raydl.read_webdataset(f"{base}/d/s-*.tar", **kw)) == 3
    assert len(raydl.read_parquet(f"{base}/p/", **kw)) == 2

    _missing(lambda: raydl.read_webdataset(f"{base}/d/gone.tar", **kw), f"{base}/d/gone.tar")
    _missing(lambda: raydl.read_parquet(f"{base}/p/gone.parquet", **kw), f"{base}/p/gone.parquet")
    _missing(lambda: raydl.read_parquet(f"{base}/none/", **kw), f"{base}/none/")
    with pytest.raises(DataSourceError, match="no images") as info:
        raydl.read_images(f"{base}/none", **kw)
    assert info.value.uri == f"{base}/none"
    with pytest.raises(ValueError, match="matches nothing"):
        raydl.read_webdataset(f"{base}/d/gone-*.tar", **kw)
    other = f"{cloud.scheme}://no-such-bucket-here/x/a.bin"
    with pytest.raises(DataSourceError) as info:
        storage_for(other, **kw).read_range(other, 0, 4)
    assert info.value.uri == other and other in str(info.value)


def test_rewritten_object_is_an_object_changed_error_naming_it(cloud):
    """A read with the listed etag of an object rewritten since is ObjectChangedError naming its URI, for a ranged
    read and a streamed one; the new etag reads the new bytes."""
    cloud.put("c/obj", b"0123456789")
    uri = f"{cloud.root}c/obj"
    storage = cloud.storage()
    etag = storage.stat(uri).etag
    assert etag and storage.read_range(uri, 2, 3, etag=etag) == b"234"
    cloud.put("c/obj", b"abcdefghij")
    with pytest.raises(ObjectChangedError) as info:
        storage.read_range(uri, 2, 3, etag=etag)
    assert info.value.uri == uri and uri in str(info.value)
    with pytest.raises(ObjectChangedError):
        b"".join(storage.stream(uri, etag=etag))
    new = storage.stat(uri).etag
    assert new != etag and storage.read_range(uri, 2, 3, etag=new) == b"cde"
    assert b"".join(storage.stream(uri, etag=new, chunk=3)) == b"abcdefghij"


def test_options_are_validated_and_keep_their_secrets():
    """Options are frozen and checked on construction; account_key, sas_token and connection_string never appear
    in a repr or a validation error."""
    with pytest.raises(ValueError, match="timeout_s"):
        raydl.GCSOptions(timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        raydl.AzureOptions(retries=0)
    with pytest.raises(ValueError, match="anonymous"):
        raydl.GCSOptions(anonymous=True, credentials_file="/x.json")
    with pytest.raises(ValueError) as info:
        raydl.AzureOptions(connection_string=f"AccountName=a;AccountKey={SECRET_KEY}", account_key=SECRET_KEY)
    assert SECRET_KEY not in str(info.value)
    with pytest.raises(ValueError) as info:
        raydl.AzureOptions(account_key=SECRET_KEY, sas_token=SECRET_SAS)
    assert SECRET_KEY not in str(info.value) and "TOPSECRET" not in str(info.value)
    for o in (raydl.AzureOptions(account_name="acct", account_key=SECRET_KEY),
              raydl.AzureOptions(account_name="acct", sas_token=SECRET_SAS),
              raydl.AzureOptions(connection_string=f"AccountName=acct;AccountKey={SECRET_KEY}")):
        text = repr(o) + repr(AzureStorage(o)) + str(o)
        assert SECRET_KEY not in text and "TOPSECRET" not in text and "acct" in repr(o) or "connection" not in text
        with pytest.raises(Exception):  # noqa: B017 - frozen
            o.account_name = "other"
    assert "credentials_file='/k.json'" in repr(raydl.GCSOptions(credentials_file="/k.json"))


def test_errors_never_show_the_sas_token_or_key(azurite, az_container):
    """A read refused under a SAS token (azurite rejects a bad signature) is an AccessDeniedError naming the URI,
    with neither the token nor its signature in the message or the chained causes."""
    uri = f"az://{az_container}/x/a.bin"
    azurite.put(az_container, "x/a.bin", b"abc")
    for opts in (raydl.AzureOptions(account_name="devstoreaccount1", sas_token=SECRET_SAS,
                                    endpoint_url=azurite.endpoint, retries=1),
                 raydl.AzureOptions(account_name="devstoreaccount1", account_key=SECRET_KEY,
                                    endpoint_url=azurite.endpoint, retries=1)):
        with pytest.raises(DataSourceError) as info:
            AzureStorage(opts).read_range(uri, 0, 2)
        assert info.value.uri == uri and uri in str(info.value)
        chain, exc = [], info.value
        while exc is not None:
            chain.append(f"{exc!r} {exc}")
            exc = exc.__cause__ or exc.__context__
        text = " ".join(chain)
        assert "TOPSECRET" not in text and SECRET_KEY not in text and SECRET_SAS not in text


def test_storages_pickle_as_options_and_name_their_store(monkeypatch):
    """A storage pickles as its options (no client); its identity is the endpoint for GCS (Google's host by
    default, STORAGE_EMULATOR_HOST when set) and the account with its endpoint for Azure."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    assert GCSStorage().identity == "storage.googleapis.com"
    assert GCSStorage(raydl.GCSOptions(endpoint_url="HTTP://127.0.0.1:4443/")).identity == "http://127.0.0.1:4443"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9023")
    assert GCSStorage().identity == "http://127.0.0.1:9023" and GCSStorage().endpoint()[1] is True
    a = AzureStorage(raydl.AzureOptions(account_name="acct"))
    assert a.identity == "acct@https://acct.blob.core.windows.net"
    b = AzureStorage(raydl.AzureOptions(account_name="other"))
    assert a.identity != b.identity
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       f"AccountName=envacct;AccountKey={SECRET_KEY};BlobEndpoint=http://127.0.0.1:1/envacct")
    assert AzureStorage().identity == "envacct@http://127.0.0.1:1/envacct"
    for s in (a, GCSStorage(raydl.GCSOptions(anonymous=True))):
        assert pickle.loads(pickle.dumps(s)) == s and len(pickle.dumps(s)) < 1024


def test_yaml_sections_and_raydl_index(cloud, tmp_path, monkeypatch):
    """A YAML source takes `gcs:` and `azure:` sections as it takes `s3:`; `raydl index` indexes gs:// and az://
    shards."""
    from raydl.cli import main
    from raydl.config import load_config

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    for i in range(2):
        cloud.put(f"d/s-{i}.tar", _tar())
    if cloud.scheme == "gs":
        section, flags = f"gcs: {{endpoint_url: '{cloud.options.endpoint_url}', timeout_s: 5}}", [
            "--gcs-endpoint-url", cloud.options.endpoint_url]
    else:
        section, flags = f"azure: {{connection_string: '{cloud.options.connection_string}', retries: 2}}", []
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", cloud.options.connection_string)
    path = tmp_path / "c.yaml"
    path.write_text(f"source: {{kind: webdataset, urls: '{cloud.root}d/s-{{0..1}}.tar', {section}}}\n"
                    "loader: {batch_size: 2}\n")
    config = load_config(str(path))
    assert len(config.source.read()) == 2
    out = tmp_path / "index.bin"
    assert main(["index", f"{cloud.root}d/s-{{0..1}}.tar", "--out", str(out), *flags]) == 0
    assert out.stat().st_size > 0
