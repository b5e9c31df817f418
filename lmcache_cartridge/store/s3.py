"""Reading packed cartridges from S3 (or any S3-compatible endpoint).

A packed cartridge in S3 is the same two files under a prefix: `s3://bucket/prefix/manifest.json`
and `s3://bucket/prefix/kv.bin`. Because `kv.bin` is chunk after chunk at the offsets the manifest
records, a chunk is one ranged GET straight into the caller's buffer, and a whole payload is many
ranged GETs in parallel into one preallocated file.

Credentials come only from botocore's standard chain (env, shared files, SSO, IMDS...): nothing
here accepts, stores or prints them, and error messages are built from the URI, the operation and
the S3 error code only, never from raw exception text.

Where it runs: inside each plugin instance (ranged reads of chunks, on the residency tier's
threads) and in the CLI and gateway (manifest fetches, whole `.pt` object downloads). Each `S3Origin`
owns its boto3 client and connection pool; callers own the buffers they ask it to fill.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from lmcache_cartridge.errors import CartridgeError

__all__ = [
    "AccessDenied",
    "NotFound",
    "ObjectInfo",
    "OriginError",
    "S3Origin",
    "S3Settings",
    "Timeout",
    "Unavailable",
    "parse_s3_uri",
]

# --- errors ---------------------------------------------------------------------------------


class OriginError(CartridgeError):
    """The object store could not give us the bytes we asked for (base class)."""


class NotFound(OriginError):
    """The bucket or key does not exist (permanent until someone uploads it)."""


class AccessDenied(OriginError):
    """The credentials found by the standard chain may not read this object (or none were found)."""


class TooLarge(OriginError):
    """An object over `S3Settings.max_object_bytes`: refused before a byte of it is read."""


class Unavailable(OriginError):
    """Transient: throttling, 5xx, dropped connections. Worth retrying later."""


class Timeout(Unavailable):
    """Connecting or reading took longer than the configured timeout."""


# --- URIs -----------------------------------------------------------------------------------

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")  # \Z, not "$": no final newline
_IPV4_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+\Z")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._=-]+\Z")
_MAX_KEY_BYTES = 1024


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix[/]` -> `("bucket", "some/prefix")`; prefix may be `""`.

    Strict on purpose: the prefix becomes object keys and cache directory names, so only boring
    segments (`[A-Za-z0-9._=-]`, no `.`/`..`, no empty segments) and valid bucket names pass.
    """
    if not isinstance(uri, str) or not uri:
        raise ValueError("empty S3 URI; expected s3://bucket/prefix")
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an S3 URI; expected s3://bucket/prefix")
    rest = uri[len("s3://"):]
    if rest.endswith("/"):
        rest = rest[:-1]
    bucket, _, prefix = rest.partition("/")
    if (
        not _BUCKET_RE.match(bucket)
        or ".." in bucket
        or ".-" in bucket
        or "-." in bucket
        or _IPV4_RE.match(bucket)
        or bucket.startswith(("xn--", "sthree-"))
        or bucket.endswith(("-s3alias", "--ol-s3"))
    ):
        raise ValueError(
            f"{uri!r}: invalid bucket name {bucket!r} (3-63 characters from [a-z0-9.-], starting "
            "and ending with a letter or digit, not an IP address)"
        )
    if prefix:
        for seg in prefix.split("/"):
            if seg in ("", ".", "..") or not _SEGMENT_RE.match(seg):
                raise ValueError(
                    f"{uri!r}: invalid prefix segment {seg!r}; use non-empty segments of "
                    "[A-Za-z0-9._=-] other than '.' and '..'"
                )
        if len(prefix.encode()) > _MAX_KEY_BYTES - 64:
            raise ValueError(f"{uri!r}: prefix is too long for an S3 key")
    return bucket, prefix


# --- settings -------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)


def _parse_size(value: Any) -> int:
    """`8388608`, `"8MiB"`, `"512k"` -> bytes (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use bytes or e.g. 8MiB)")
    unit = (m.group(2) or "b")[0].lower()
    return int(m.group(1)) * {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]


@dataclass(frozen=True)
class S3Settings:
    """How to talk to the object store. Deliberately holds no credentials.

    `max_attempts` counts the first try (botocore `total_max_attempts`); `retry_mode` is
    botocore's `standard` or `adaptive` (client-side rate limiting on throttling).
    """

    endpoint_url: str | None = None
    region: str | None = None
    max_attempts: int = 5
    retry_mode: str = "standard"
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_concurrency: int = 8
    part_size: int = 8 << 20
    addressing_style: str = "path"
    # Largest whole object (an input `.pt`, a file of an input directory) fetched from S3.
    max_object_bytes: int = 32 << 30

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            # Never echo a rejected URL: it may carry a secret (user:pass@, or a mangled one).
            if "@" in self.endpoint_url:
                raise ValueError("endpoint_url must not embed credentials; use the standard chain")
            u = urlsplit(self.endpoint_url)
            try:
                _ = u.port  # parsed on access: ValueError for a port that is not a number
            except ValueError:
                u = u._replace(netloc="")
            if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
                raise ValueError("endpoint_url must look like http(s)://host[:port]")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {self.retry_mode!r}")
        if self.addressing_style not in ("path", "virtual", "auto"):
            raise ValueError(f"addressing_style must be path, virtual or auto, got {self.addressing_style!r}")
        for name in ("max_attempts", "max_concurrency", "part_size", "max_object_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], prefix: str = "") -> "S3Settings":
        """Build from plain string settings (e.g. LMCache `extra_config`); unknown keys ignored.

        Keys are the field names, optionally behind `prefix` (e.g. `"s3_"`); sizes accept `8MiB`.
        """
        conv: dict[str, Callable[[Any], Any]] = {
            "endpoint_url": lambda v: str(v) or None,
            "region": lambda v: str(v) or None,
            "max_attempts": int,
            "retry_mode": str,
            "connect_timeout": float,
            "read_timeout": float,
            "max_concurrency": int,
            "part_size": _parse_size,
            "addressing_style": str,
            "max_object_bytes": _parse_size,
        }
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            key = prefix + f.name
            if key in d and d[key] is not None:
                try:
                    kwargs[f.name] = conv[f.name](d[key])
                except (TypeError, ValueError) as e:
                    raise CartridgeError(f"bad S3 setting {key}: {e}") from None
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise CartridgeError(f"bad S3 settings: {e}") from None


# --- the origin -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectInfo:
    """A whole object as downloaded: what the cache keeps beside it to know it is current."""

    uri: str
    size: int
    etag: str
    sha256: str


_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED = {
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem",
}
_WINDOW = 1 << 20  # bytes per readinto: bounds urllib3's temporary copy (it reads then copies)
_MAX_MANIFEST_BYTES = 64 << 20


class S3Origin:
    """One cartridge prefix in S3, read through one thread-safe boto3 client.

    `stats` counts logical requests and HTTP attempts (via botocore's `before-send` event, so
    retries are observable without a server-side log). Owned by its creator; no global state.
    """

    def __init__(self, uri: str, settings: S3Settings | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.settings = settings or S3Settings()
        s = self.settings
        config = Config(
            region_name=s.region,
            retries={"mode": s.retry_mode, "total_max_attempts": s.max_attempts},
            connect_timeout=s.connect_timeout,
            read_timeout=s.read_timeout,
            max_pool_connections=max(10, s.max_concurrency),
            s3={"addressing_style": s.addressing_style},
        )
        # A private session: the default session is process-global and not thread-safe to build.
        self._client = boto3.session.Session().client("s3", endpoint_url=s.endpoint_url, config=config)
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "attempts": 0, "gets": 0, "heads": 0, "bytes": 0, "errors": 0}
        self._client.meta.events.register("before-send.s3", self._on_send)

    # -- bookkeeping --
    @property
    def stats(self) -> dict[str, int]:
        """A snapshot. `retries` = HTTP attempts beyond the first, botocore's and our own."""
        with self._lock:
            d = dict(self._stats)
        d["retries"] = d["attempts"] - d["requests"]
        return d

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    def _on_send(self, **_: Any) -> None:
        self._count(attempts=1)  # returning None lets botocore send the request as usual

    def key(self, key_suffix: str) -> str:
        if not key_suffix or key_suffix.startswith("/") or ".." in key_suffix.split("/"):
            raise ValueError(f"bad key suffix {key_suffix!r}")
        return f"{self.prefix}/{key_suffix}" if self.prefix else key_suffix

    def uri_of(self, key_suffix: str) -> str:
        return f"s3://{self.bucket}/{self.key(key_suffix)}"

    # -- error mapping --
    def _map_error(self, e: BaseException, key_suffix: str, op: str, *, key: str | None = None) -> OriginError:
        """botocore/urllib3 exception -> our taxonomy, with a message free of raw exception text."""
        from botocore import exceptions as bx

        self._count(errors=1)
        where = f"{op} {self.uri_of(key_suffix) if key is None else f's3://{self.bucket}/{key}'}"
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in _NOT_FOUND or status == 404:
                what = "bucket" if code == "NoSuchBucket" else "object"
                return NotFound(f"{where}: {what} not found (S3 {code or status})")
            if code in _DENIED or status == 403:
                return AccessDenied(
                    f"{where}: access denied (S3 {code or status}); check the IAM policy or bucket "
                    "policy for the credentials the standard chain picked up"
                )
            if status in (412, 416) or code in ("PreconditionFailed", "InvalidRange"):
                return OriginError(f"{where}: object changed or is shorter than expected (S3 {code or status})")
            if status == 429 or status >= 500 or "Throttl" in code or code in ("SlowDown", "RequestTimeout"):
                return Unavailable(f"{where}: S3 unavailable after {self.settings.max_attempts} attempts "
                                   f"(S3 {code or status})")
            return OriginError(f"{where}: S3 error {code or status}")
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return AccessDenied(f"{where}: no usable AWS credentials found by the standard chain")
        if isinstance(e, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
            return Timeout(f"{where}: timed out ({type(e).__name__}; connect {self.settings.connect_timeout}s, "
                           f"read {self.settings.read_timeout}s)")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionError, bx.HTTPClientError,
                          bx.ResponseStreamingError, bx.IncompleteReadError)):
            return Unavailable(f"{where}: connection failed ({type(e).__name__})")
        if isinstance(e, _ShortBody):
            return Unavailable(f"{where}: {e}")
        if isinstance(e, OSError):
            return Unavailable(f"{where}: connection failed ({type(e).__name__})")
        return OriginError(f"{where}: unexpected {type(e).__name__}")

    # -- primitives --
    def head(self, key_suffix: str) -> int:
        """Size of the object in bytes."""
        return self._head(key_suffix)[0]

    def _head(self, key_suffix: str) -> tuple[int, str | None]:
        self._count(requests=1, heads=1)
        try:
            r = self._client.head_object(Bucket=self.bucket, Key=self.key(key_suffix))
        except Exception as e:
            raise self._map_error(e, key_suffix, "HEAD") from e
        return int(r["ContentLength"]), r.get("ETag")

    def get_manifest_bytes(self, name: str = "manifest.json") -> bytes:
        """The whole (small) manifest object; refuses anything implausibly large."""
        self._count(requests=1, gets=1)
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self.key(name))
            size = int(r["ContentLength"])
            if size > _MAX_MANIFEST_BYTES:
                r["Body"].close()
                raise OriginError(f"{self.uri_of(name)}: {size} bytes is too large for a manifest")
            data = r["Body"].read()
        except OriginError:
            raise
        except Exception as e:
            raise self._map_error(e, name, "GET") from e
        self._count(bytes=len(data))
        return data

    def list_names(self, limit: int = 1000) -> dict[str, tuple[int, str]]:
        """The objects directly under this prefix (`prefix/<name>`, no deeper): name -> (size,
        ETag). One LIST request per 1000 objects; more than `limit` objects is refused."""
        out: dict[str, tuple[int, str]] = {}
        base = f"{self.prefix}/" if self.prefix else ""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
        while True:
            self._count(requests=1)
            try:
                r = self._client.list_objects_v2(**kw)
            except Exception as e:
                raise self._map_error(e, "", "LIST", key=base) from e
            for o in r.get("Contents") or ():
                name = o["Key"][len(base):]
                if name:
                    out[name] = (int(o["Size"]), str(o.get("ETag") or ""))
            if len(out) > limit:
                raise OriginError(f"s3://{self.bucket}/{base} holds more than {limit} objects: not a cartridge")
            if not r.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = r["NextContinuationToken"]

    def read_range_into(self, key_suffix: str, offset: int, out: memoryview | Any,
                        *, if_match: str | None = None) -> int:
        """Ranged GET of exactly `len(out)` bytes at `offset` into `out`; returns the object size.

        `out` may be any writable contiguous buffer (bytearray, numpy array, a tensor's numpy view,
        LMCache's ctypes `<B` byte_array): it is recast to plain bytes because urllib3's readinto
        cannot assign into `<B` views. Bytes land in `out` through bounded windows, never via a
        full-size temporary. The bytes are not verified here: the caller checks them once they have
        all landed (`integrity.check_chunk`), on its own thread.
        """
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("read_range_into needs a writable buffer")
        if view.nbytes == 0:
            return self.head(key_suffix)
        return self._get_range(key_suffix, offset, view, if_match)

    def _get_range(self, key_suffix: str, offset: int, view: memoryview, if_match: str | None) -> int:
        """One logical ranged GET of `len(view)` bytes into `view`. botocore retries failures up
        to the response headers; a body cut short or stalled afterwards is retried here by
        re-fetching the whole range."""
        n = view.nbytes
        self._count(requests=1, gets=1)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(key_suffix),
                              "Range": f"bytes={offset}-{offset + n - 1}"}
        if if_match:
            kw["IfMatch"] = if_match
        attempt = 0
        while True:
            attempt += 1
            try:
                r = self._client.get_object(**kw)
            except Exception as e:
                raise self._map_error(e, key_suffix, "GET") from e
            body = r["Body"]
            try:
                total = _total_from_content_range(r.get("ContentRange"), offset, n)
                if int(r["ContentLength"]) != n:
                    raise OriginError(f"GET {self.uri_of(key_suffix)}: asked for {n} bytes at "
                                      f"{offset}, got {r['ContentLength']}")
                pos = 0
                while pos < n:
                    got = body.readinto(view[pos:pos + min(_WINDOW, n - pos)])
                    if not got:
                        raise _ShortBody(f"body ended after {pos} of {n} bytes")
                    pos += got
            except OriginError:
                raise
            except Exception as e:
                err = self._map_error(e, key_suffix, "GET")
                if isinstance(err, Unavailable) and attempt < self.settings.max_attempts:
                    time.sleep(random.random() * min(1.0, 0.05 * 2**attempt))  # jittered backoff
                    continue  # the retry's HTTP attempt is counted by before-send
                raise err from e
            finally:
                body.close()
            self._count(bytes=n)
            return total

    def download_object(self, dest_path: str | os.PathLike[str]) -> "ObjectInfo":
        """Fetch the whole object this URI names (`s3://bucket/key.pt`) into `dest_path`, atomically.

        boto3's transfer manager (s3transfer) does the work: parallel ranged parts of `part_size`,
        its own retries, pinned by If-Match to the ETag a HEAD saw, so every part is the same object
        version. The result is checked against that HEAD: the size always, and the MD5 when the
        ETag is one (single-part uploads). A failure leaves nothing at `dest_path`.
        """
        import hashlib
        import tempfile

        from s3transfer.manager import TransferConfig, TransferManager
        from s3transfer.subscribers import BaseSubscriber

        if not self.prefix:
            raise ValueError(f"{self.uri} names a bucket, not an object")
        dest = Path(dest_path)
        self._count(requests=1, heads=1)
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.prefix)
        except Exception as e:
            raise self._map_error(e, "", "HEAD", key=self.prefix) from e
        size, etag = int(head["ContentLength"]), str(head.get("ETag") or "")
        if size > self.settings.max_object_bytes:
            raise TooLarge(f"{self.uri}: {size} bytes, over the {self.settings.max_object_bytes}-byte limit "
                           "(s3.max_object_bytes)")

        class _Known(BaseSubscriber):  # what the HEAD saw: no second HEAD, parts pinned to this ETag
            def on_queued(self, future, **kwargs):  # noqa: ARG002 (s3transfer's subscriber signature)
                future.meta.provide_transfer_size(size)
                if etag:
                    future.meta.provide_object_etag(etag)

        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            s = self.settings
            config = TransferConfig(multipart_threshold=s.part_size, multipart_chunksize=s.part_size,
                                    max_request_concurrency=s.max_concurrency, num_download_attempts=s.max_attempts)
            self._count(requests=1, gets=1)
            try:
                with TransferManager(self._client, config) as manager:
                    manager.download(self.bucket, self.prefix, tmp, subscribers=[_Known()]).result()
            except Exception as e:
                raise self._map_error(e, "", "GET", key=self.prefix) from e
            sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
            got = 0
            with open(tmp, "rb") as f:
                while block := f.read(1 << 20):
                    sha.update(block)
                    md5.update(block)
                    got += len(block)
            plain_md5 = etag.strip('"')
            if got != size or (re.fullmatch(r"[0-9a-f]{32}", plain_md5) and md5.hexdigest() != plain_md5):
                raise OriginError(f"GET {self.uri}: downloaded {got} bytes that do not match the object "
                                  f"(HEAD said {size} bytes, ETag {etag}); try again")
            os.replace(tmp, dest)
            tmp = ""
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:  # never created, or already removed
                    pass
        self._count(bytes=size)
        return ObjectInfo(self.uri, size, etag, sha.hexdigest())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "S3Origin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Origin({self.uri!r}, endpoint={self.settings.endpoint_url!r})"


class _ShortBody(Exception):
    """The connection delivered fewer body bytes than Content-Length promised."""


def _total_from_content_range(value: str | None, offset: int, n: int) -> int:
    """`bytes a-b/total` -> total, checking that the server returned the range we asked for."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", value or "")
    if not m or int(m.group(1)) != offset or int(m.group(2)) != offset + n - 1:
        raise OriginError(f"server ignored or changed the requested range (Content-Range {value!r})")
    return -1 if m.group(3) == "*" else int(m.group(3))
