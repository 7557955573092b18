"""Where checkpoints live: a local directory, or a folder of an object store.

`checkpoint.storage_path` is a filesystem path (also `file:///abs/path`), or a URI of a
store `pyarrow.fs` opens: `s3://bucket/prefix`, `gs://bucket/prefix`, `hdfs://...`,
`abfs://...`. A store's folder is a `StorePath`: a pyarrow filesystem and a path in it,
with the few operations checkpoints need (list child folders, size, read, stream,
delete a folder, write a small file). A local folder stays a plain `Path`, so local
checkpoints take exactly the code path they always took. `Location` is either.

`checkpoint.storage_options` go to the store's pyarrow filesystem
(`pyarrow.fs.S3FileSystem(**options)`: `endpoint_override`, `region`, `scheme`, ...).
Credentials never go in the spec (it is written into every manifest): pyarrow reads
them from the environment (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, an instance
role, `GOOGLE_APPLICATION_CREDENTIALS`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainstack.errors import ConfigError, first_line, show

if TYPE_CHECKING:
    import pyarrow.fs as pafs

STORE_SCHEMES: tuple[str, ...] = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
"""URI schemes of object stores and remote filesystems (through `pyarrow.fs`)."""
OPTION_SCHEMES: tuple[str, ...] = ("s3", "gs", "gcs")
"""Schemes whose filesystem `checkpoint.storage_options` configures."""
CREDENTIAL_OPTIONS: tuple[str, ...] = (
    "access_key",
    "secret_key",
    "session_token",
    "access_token",
    "credential_token_expiration",
)
"""pyarrow filesystem options that carry secrets: refused in the spec."""
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def scheme_of(text: str) -> str | None:
    """The URI scheme of `text` (lower case), or None for a plain path."""
    match = _URI.match(text)
    return match.group(1).lower() if match else None


def is_store_uri(text: str) -> bool:
    """True when `text` names an object store (or remote filesystem), not a local path."""
    scheme = scheme_of(text)
    return scheme is not None and scheme != "file"


def local_path(text: str) -> Path:
    """`text` (a path, or a `file://` URI) as an absolute local path."""
    if scheme_of(text) == "file":
        text = _URI.match(text).group(2)  # type: ignore[union-attr]
    return Path(text).expanduser().resolve()


LOCAL_RUNS = Path(".cache/trainstack/runs")
"""The local folder of runs whose checkpoints are in an object store (their tracking
record, fault markers and, for text data, prepared tokens), under the working dir."""


def local_storage(storage_path: str) -> Path:
    """The local folder that stands for `checkpoint.storage_path`: the path itself, or
    `LOCAL_RUNS` (absolute) when it names an object store."""
    return LOCAL_RUNS.resolve() if is_store_uri(storage_path) else local_path(storage_path)


class StorePath:
    """A file or folder in a pyarrow filesystem: `fs` and the `path` in it (no scheme),
    shown as `scheme://path`."""

    def __init__(self, fs: pafs.FileSystem, path: str, *, scheme: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.scheme = scheme

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.fs, f"{self.path}/{name}", scheme=self.scheme)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self.fs, self.path.rsplit("/", 1)[0], scheme=self.scheme)

    def _type(self) -> Any:
        return self.fs.get_file_info(self.path).type

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._type() != pafs.FileType.NotFound)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._type() == pafs.FileType.File)

    def size(self) -> int | None:
        """The file's size in bytes; None when there is no such file."""
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.path)
        return int(info.size) if info.type == pafs.FileType.File else None

    def child_dirs(self) -> list[StorePath]:
        """The folders directly in this one (one listing); [] when it does not exist."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        return [
            StorePath(self.fs, info.path, scheme=self.scheme)
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.Directory
        ]

    @contextlib.contextmanager
    def open_binary(self) -> Iterator[IO[bytes]]:
        """The file as a binary stream; FileNotFoundError when absent."""
        with self.fs.open_input_stream(self.path) as stream:
            yield stream

    def read_bytes(self) -> bytes:
        with self.open_binary() as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_text(self, text: str) -> None:
        """One upload: an object store shows the whole object or none of it."""
        with self.fs.open_output_stream(self.path) as stream:
            stream.write(text.encode())

    def delete_file(self) -> None:
        self.fs.delete_file(self.path)

    def delete_tree(self) -> None:
        self.fs.delete_dir(self.path)


Location = Path | StorePath
"""A checkpoint, run or storage folder: local, or in an object store."""


def child_dirs(location: Location) -> list[Location]:
    """The folders directly in `location`; [] when it is not a folder."""
    if isinstance(location, StorePath):
        return list(location.child_dirs())
    if not location.is_dir():
        return []
    return [p for p in location.iterdir() if p.is_dir()]


def size_of(file: Location) -> int | None:
    """A file's size in bytes; None when it is not a file."""
    if isinstance(file, StorePath):
        return file.size()
    return file.stat().st_size if file.is_file() else None


def open_binary(file: Location) -> contextlib.AbstractContextManager[IO[bytes]]:
    """A file as a binary stream (read in blocks, never whole)."""
    if isinstance(file, StorePath):
        return file.open_binary()
    return file.open("rb")


def delete_tree(folder: Location) -> None:
    """Delete a folder and everything in it; errors are ignored (as `rm -rf`)."""
    if isinstance(folder, StorePath):
        with contextlib.suppress(OSError):
            folder.delete_tree()
        return
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def open_location(text: str, options: Mapping[str, Any]) -> Location:
    """`text` as a location: a local path (resolved), or a store URI whose filesystem is
    built from `options` (`checkpoint.storage_options`). Raises ConfigError."""
    scheme = scheme_of(text)
    if scheme is None or scheme == "file":
        return local_path(text)
    fs, path = filesystem(text, options, key="checkpoint.storage_path")
    return StorePath(fs, path, scheme=scheme)


def check_uri(uri: str, options: Mapping[str, Any]) -> None:
    """Raise ConfigError when `uri` with `options` could not name a store, without
    contacting it: an unknown scheme, a bad S3 bucket name, an option pyarrow refuses."""
    scheme = scheme_of(uri) or ""
    key = "checkpoint.storage_path"
    if scheme not in STORE_SCHEMES:
        raise ConfigError(
            f"{key}={show(uri)} has an unknown scheme {scheme!r}; allowed: a filesystem path, "
            f"file:///path, or a URI of {', '.join(s + '://' for s in STORE_SCHEMES)} "
            "(e.g. s3://bucket/prefix)"
        )
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    if scheme == "s3" and not _S3_BUCKET.match(bucket):
        raise ConfigError(
            f"{key}={show(uri)} is not s3://BUCKET/prefix with a valid bucket name "
            f"({bucket!r}); allowed: 3 to 63 lower-case letters, digits, dots and hyphens"
        )
    if scheme not in OPTION_SCHEMES:
        if options:
            raise ConfigError(
                f"checkpoint.storage_options={show(dict(options))}: options apply to "
                f"{', '.join(s + '://' for s in OPTION_SCHEMES)} storage only; for {scheme}:// "
                "put them in the URI's query (?key=value)"
            )
        return
    filesystem(uri, options, key=key)


CREDENTIAL_ENV: tuple[str, ...] = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "GOOGLE_APPLICATION_CREDENTIALS",
)
"""What pyarrow's S3 and GCS filesystems read from the environment."""


def credential_env() -> dict[str, str]:
    """This process's `CREDENTIAL_ENV` variables, for processes that do not inherit its
    environment (a `ray start` cluster's workers)."""
    return {k: v for k, v in os.environ.items() if k in CREDENTIAL_ENV}


def with_env_credentials(location: StorePath, options: Mapping[str, Any]) -> pafs.FileSystem:
    """`location`'s filesystem with this process's AWS keys (`AWS_ACCESS_KEY_ID`, ...)
    written into it, for a process that has another environment (Ray Train's controller
    has its raylet's). Any other store, or no keys in the environment: `location.fs`."""
    import pyarrow.fs as pafs

    keys = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if location.scheme != "s3" or not all(keys):
        return location.fs
    token = os.environ.get("AWS_SESSION_TOKEN")
    return pafs.S3FileSystem(
        **s3_options(options), access_key=keys[0], secret_key=keys[1], session_token=token
    )


def s3_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`checkpoint.storage_options` for pyarrow's S3 filesystem, with the endpoint of an
    S3-compatible store (MinIO, Ceph, a local server) taken from the environment as boto3
    and the AWS CLI take it (`AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`) when the
    options name none: an explicit `endpoint_override` wins."""
    merged = dict(options)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_override" not in merged:
        merged["endpoint_override"] = endpoint
        scheme = scheme_of(endpoint)
        if scheme in ("http", "https"):
            merged.setdefault("scheme", scheme)
    return merged


def filesystem(uri: str, options: Mapping[str, Any], *, key: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of `uri` and the path in it. For s3:// and gs:// it is built
    from `options` alone (no network); other schemes go through `FileSystem.from_uri`,
    which may contact the store. Raises ConfigError."""
    import pyarrow
    import pyarrow.fs as pafs

    scheme = scheme_of(uri)
    path = uri.split("://", 1)[1].rstrip("/")
    secrets = sorted(set(options) & set(CREDENTIAL_OPTIONS))
    if secrets:
        raise ConfigError(
            f"checkpoint.storage_options.{secrets[0]}: credentials do not go in the spec (it is "
            "copied into every checkpoint); allowed: set them in the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS)"
        )
    try:
        if scheme == "s3":
            return pafs.S3FileSystem(**s3_options(options)), path
        if scheme in ("gs", "gcs"):
            return pafs.GcsFileSystem(**options), path
        fs, fs_path = pafs.FileSystem.from_uri(uri)
        return fs, fs_path.rstrip("/")
    except (TypeError, ValueError, pyarrow.ArrowException, OSError) as err:
        reason = first_line(err)
        raise ConfigError(
            f"{key}={show(uri)} with checkpoint.storage_options={show(dict(options))}: pyarrow "
            f"refuses it ({reason}); allowed: options of pyarrow.fs.S3FileSystem "
            "(endpoint_override, region, scheme, ...) or GcsFileSystem"
        ) from None
