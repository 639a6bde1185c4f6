"""Azure Blob Storage (az://container/key) through obstore: raydl/storage/_objstore.py reads, this module
says how to reach the store.

Credentials, first found first: AzureOptions' connection_string, account_key or sas_token; else
AZURE_STORAGE_CONNECTION_STRING; else the account (AzureOptions.account_name or AZURE_STORAGE_ACCOUNT_NAME)
with Azure's default credential chain (a service principal's or workload identity's environment, then the
managed identity). The secrets never reach a repr, a log or an error (raydl/storage/_objstore.py scrubs
the store's messages).

An object's etag is its ETag; reads with an etag are conditional on it (If-Match), and the etag the store
answers with is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raydl import env
from raydl.options import AzureOptions
from raydl.storage._objstore import ObjectStoreStorage

__all__ = ["AzureStorage", "parse_connection_string"]

_DEV_ACCOUNT = "devstoreaccount1"
# azurite's and the Azure storage emulator's published development key (not a secret)
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def parse_connection_string(text: str) -> dict[str, str]:
    """The fields of an Azure Storage connection string ("Key=value;..."), keys as Azure spells them. A
    malformed one is a ValueError that does not show it (it holds a secret)."""
    fields: dict[str, str] = {}
    for part in text.strip().split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError("the Azure connection string is malformed (want Key=value;Key=value...)")
        fields[name.strip()] = value.strip()
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        fields.setdefault("AccountName", _DEV_ACCOUNT)
        fields.setdefault("AccountKey", _DEV_KEY)
        fields.setdefault("BlobEndpoint", f"http://127.0.0.1:10000/{_DEV_ACCOUNT}")
    return fields


@dataclass(frozen=True)
class AzureStorage(ObjectStoreStorage):
    """Blobs in Azure Blob Storage (or azurite), addressed as az://container/key."""

    options: AzureOptions = field(default_factory=AzureOptions)

    scheme = "az"
    bucket_word = "container"
    options_name = "AzureOptions"

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", AzureOptions())
        if not isinstance(self.options, AzureOptions):
            raise ValueError(f"azure must be a raydl.AzureOptions or None, got {type(self.options).__name__}")

    def settings(self) -> dict[str, str]:
        """What reaches the store: account, key, sas, endpoint (those that are known), from the options, else
        from AZURE_STORAGE_CONNECTION_STRING."""
        o = self.options
        text = o.connection_string
        if text is None and not (o.account_name or o.account_key or o.sas_token):
            text = env.azure_storage_connection_string()
        out: dict[str, str] = {}
        if text is not None:
            cs = parse_connection_string(text)
            for ours, theirs in (
                ("account", "AccountName"),
                ("key", "AccountKey"),
                ("sas", "SharedAccessSignature"),
                ("endpoint", "BlobEndpoint"),
            ):
                if cs.get(theirs):
                    out[ours] = cs[theirs]
            if "endpoint" not in out and "account" in out:
                protocol = cs.get("DefaultEndpointsProtocol", "https")
                suffix = cs.get("EndpointSuffix", "core.windows.net")
                out["endpoint"] = f"{protocol}://{out['account']}.blob.{suffix}"
        for ours, value in (
            ("account", o.account_name),
            ("key", o.account_key),
            ("sas", o.sas_token),
            ("endpoint", o.endpoint_url),
        ):
            if value is not None:
                out[ours] = value
        if "sas" in out:
            out["sas"] = out["sas"].lstrip("?")
        if "account" not in out and "endpoint" in out:
            out["account"] = _account_of(out["endpoint"])
        return out

    @property
    def identity(self) -> str:
        """The account and the endpoint the reads go to: a container's name means other blobs in another."""
        s = self.settings()
        account = s.get("account") or ""
        url = s.get("endpoint") or (f"https://{account}.blob.core.windows.net" if account else "")
        scheme, sep, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        url = f"{scheme.lower()}{sep}{host.lower()}{slash}{path}".rstrip("/")
        return f"{account}@{url}"

    def _make_store(self, bucket: str, client_options: dict, retry_config: dict):
        from obstore.store import AzureStore

        s = self.settings()
        config: dict = {}
        if "account" in s:
            config["account_name"] = s["account"]
        if "key" in s:
            config["account_key"] = s["key"]
        if "sas" in s:
            config["sas_key"] = s["sas"]
        if "endpoint" in s:
            config["endpoint"] = s["endpoint"].rstrip("/")
            if s["endpoint"].lower().startswith("http://"):
                client_options = {**client_options, "allow_http": True}
        return AzureStore(bucket, config=config, client_options=client_options, retry_config=retry_config)

    def _secrets(self) -> tuple[str, ...]:
        o = self.options
        found = [o.connection_string, o.account_key, o.sas_token]
        try:
            s = self.settings()
        except ValueError:
            s = {}
        found += [s.get("key"), s.get("sas")]
        if s.get("sas"):  # its signature alone, and percent-decoded, are secrets too
            found += [part for part in s["sas"].split("&") if part.startswith("sig=")]
        return tuple(x for x in found if x)

    def _credentials_hint(self) -> str:
        return (
            "; set AzureOptions(connection_string=... | account_name=..., account_key=... | sas_token=...), "
            "AZURE_STORAGE_CONNECTION_STRING, or an identity Azure's default credential chain finds"
        )


def _account_of(endpoint: str) -> str:
    """The account an endpoint names: ACCOUNT.blob.core.windows.net's, or the first path segment of an
    emulator's (http://127.0.0.1:10000/ACCOUNT)."""
    rest = endpoint.partition("://")[2]
    host, _, path = rest.partition("/")
    if ".blob." in host:
        return host.split(".", 1)[0]
    return path.split("/", 1)[0]
