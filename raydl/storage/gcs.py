"""Google Cloud Storage (gs://bucket/key) through obstore: raydl/storage/_objstore.py reads, this module says
how to reach the store.

Credentials: GCSOptions.credentials_file, else Google's application-default credentials
(GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server). STORAGE_EMULATOR_HOST, as Google's
own client honours it, points every gs:// read at an emulator, anonymously. A plain-HTTP endpoint is read
anonymously too: no token goes over an unencrypted connection.

An object's etag is its XML ETag (a plain object's MD5, which every new generation with other bytes
changes); reads with an etag are conditional on it, and the etag the store answers with is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raydl import env
from raydl.options import GCSOptions
from raydl.storage._objstore import ObjectStoreStorage

__all__ = ["GCS_HOST", "GCSStorage"]

GCS_HOST = "storage.googleapis.com"


def _url(host: str) -> str:
    return host if "://" in host else f"http://{host}"


@dataclass(frozen=True)
class GCSStorage(ObjectStoreStorage):
    """Objects in Google Cloud Storage (or an emulator), addressed as gs://bucket/key."""

    options: GCSOptions = field(default_factory=GCSOptions)

    scheme = "gs"
    options_name = "GCSOptions"

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", GCSOptions())
        if not isinstance(self.options, GCSOptions):
            raise ValueError(f"gcs must be a raydl.GCSOptions or None, got {type(self.options).__name__}")

    def endpoint(self) -> tuple[str | None, bool]:
        """(the endpoint URL, None for Google's own; whether the reads go anonymously)."""
        o = self.options
        url, emulated = o.endpoint_url, False
        if url is None:
            host = env.storage_emulator_host()
            if host:
                url, emulated = _url(host), True
        plain = url is not None and url.lower().startswith("http://")
        anonymous = o.anonymous or (o.credentials_file is None and (emulated or plain))
        return url, anonymous

    @property
    def identity(self) -> str:
        """The endpoint the reads go to, lower-cased up to the path ("storage.googleapis.com" for
        Google's)."""
        url, _ = self.endpoint()
        if url is None:
            return GCS_HOST
        scheme, sep, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        return f"{scheme.lower()}{sep}{host.lower()}{slash}{path}".rstrip("/")

    def _make_store(self, bucket: str, client_options: dict, retry_config: dict):
        from obstore.store import GCSStore

        o = self.options
        url, anonymous = self.endpoint()
        config: dict = {}
        if url is not None:
            config["base_url"] = url.rstrip("/")
            if url.lower().startswith("http://"):
                client_options = {**client_options, "allow_http": True}
        if anonymous:
            config["skip_signature"] = True
        elif o.credentials_file is not None:
            config["application_credentials"] = o.credentials_file
        if o.project is not None:
            client_options = {**client_options, "default_headers": {"x-goog-user-project": o.project}}
        return GCSStore(bucket, config=config, client_options=client_options, retry_config=retry_config)

    def _credentials_hint(self) -> str:
        return (
            "; set GCSOptions(credentials_file=...), GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth "
            "application-default login`, or anonymous=True for a public bucket"
        )
