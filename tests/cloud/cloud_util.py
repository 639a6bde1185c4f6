"""One store for a test (a fresh gs:// bucket or az:// container, its options, and how data goes in)."""
from __future__ import annotations

__all__ = ["Cloud", "make_cloud"]


class Cloud:
    """One store for a test: its scheme, the read_* keyword that reaches it, and how data goes in."""

    def __init__(self, scheme: str, bucket: str, server, options) -> None:
        self.scheme, self.bucket, self.server, self.options = scheme, bucket, server, options
        self.kw = {"gcs" if scheme == "gs" else "azure": options}
        self.root = f"{scheme}://{bucket}/"

    def put(self, key: str, data: bytes) -> None:
        self.server.put(self.bucket, key, data)

    def put_many(self, objects: dict[str, bytes]) -> None:
        self.server.put_many(self.bucket, objects)

    def upload_folder(self, root, prefix: str) -> None:
        from pathlib import Path

        root = Path(root)
        self.put_many({f"{prefix}/{p.relative_to(root).as_posix()}": p.read_bytes()
                       for p in sorted(root.rglob("*")) if p.is_file()})

    def storage(self):
        from raydl.storage import storage_for

        return storage_for(self.root, **self.kw)


def make_cloud(request, scheme: str) -> Cloud:
    """A fresh bucket (gs) or container (az) for the requesting test."""
    if scheme == "gs":
        return Cloud("gs", request.getfixturevalue("gcs_bucket"), request.getfixturevalue("fake_gcs"),
                     request.getfixturevalue("gcs_options"))
    return Cloud("az", request.getfixturevalue("az_container"), request.getfixturevalue("azurite"),
                 request.getfixturevalue("azure_options"))
