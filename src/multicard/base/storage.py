"""Object storage: URLs (s3://bucket/prefix, gs://, az://, any protocol fsspec knows) read through fsspec.

Where a URL is accepted: `data.name=shards data.root=URL`, a folder `multicard pack` wrote, uploaded as
it is (data/sources/remote_shards.py). Every other path is local, and a URL there is one line
(config.check_local_path). Credentials and endpoints come from the environment the protocol's package
reads (for s3://: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL, ~/.aws), never
from the config: a URL holding them is refused, as the config is saved in config.yaml and checkpoints.

A read that fails transiently (connection refused or reset, a timeout, a 5xx or throttling answer) is
tried again after 0.5 s, 1 s, 2 s, … (at most MAX_WAIT_S apart), `retries` times; then, or at once for a
missing bucket or object or a refusal of access, one line naming the URL and what to check.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
from collections.abc import Callable
from time import sleep  # by this name: a test records the waits of this module alone
from typing import Any, TypeVar

from multicard.base.errors import UserError

FIRST_WAIT_S, MAX_WAIT_S = 0.5, 8.0  # backoff between attempts: doubles from the first, up to the most
# OSErrors that a later attempt may not meet: s3fs's names for SlowDown / 503 (EBUSY), InternalError / 500
# (EREMOTEIO), and the socket's own.
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE})  # fmt: skip
MAX_REASON = 160  # characters of a library's message in our line
THROTTLED = 429  # an HTTP status that asks to come back later, as 5xx do
EXTRAS = {"s3": "multicard[s3]", "s3a": "multicard[s3]"}  # protocols with an extra of ours; others: their package
CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"}
T = TypeVar("T")
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # scheme://... (s3://, gs://, az://, https://, file://)


def is_url(value: str | None) -> bool:
    return bool(URL.match(value or ""))


def protocol(url: str) -> str:
    return URL.match(url)[1].lower()


def check_url(url: str, key: str) -> None:
    """A URL that can be read: no credentials in it, and a protocol fsspec knows whose package is
    installed; else one line naming what to change or install."""
    scheme, rest = protocol(url), url.split("://", 1)[1]
    if not rest.strip("/"):
        raise UserError(f"{key}={url} names no location; give the bucket and prefix, e.g. {scheme}://bucket/prefix")
    if "@" in rest.split("/", 1)[0]:
        shown = f"{scheme}://…@{rest.split('@', 1)[1]}"
        raise UserError(
            f"{key}={shown} holds credentials (user or key before @), which the saved config would keep; remove "
            f"them and give them through the environment (for s3://: {CREDENTIALS['s3']})"
        )
    filesystem_class(scheme, f"{key}={url}")


def filesystem_class(scheme: str, given: str) -> type:
    """fsspec's filesystem for a protocol, imported; a missing package or unknown protocol is one line."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise UserError(f"{given} is read through fsspec: {_install(scheme, None)}") from None
    known = known_implementations.get(scheme)
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = known["class"].split(".")[0] if known else scheme
        install = _install(scheme, package)
        raise UserError(f"{given} needs {package} (fsspec's {scheme}:// protocol): {install}") from None
    except ValueError:
        raise UserError(
            f"{given}: {scheme}:// is no storage protocol fsspec knows; give a local path or a URL such as "
            f"s3://bucket/prefix"
        ) from None


def _install(scheme: str, package: str | None) -> str:
    if scheme in EXTRAS:
        return f"pip install '{EXTRAS[scheme]}'"
    return f"pip install fsspec {package}" if package else f"pip install fsspec and the package of {scheme}://"


def _options(scheme: str) -> dict[str, Any]:
    """Storage options: a new session (never one a parent process made), and for s3:// no retries of
    botocore's own, so that ours are the only ones (bounded and said), with bounded timeouts."""
    options: dict[str, Any] = {"skip_instance_cache": True}
    if scheme in ("s3", "s3a"):
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "connect_timeout": 10, "read_timeout": 60}
    return options


class Remote:
    """The filesystem of a URL's protocol, opened once per process: a forked loader process opens its
    own session (an event loop and connections do not survive a fork). Reads retry (`retries`)."""

    def __init__(self, url: str, retries: int) -> None:
        scheme, rest = url.split("://", 1)
        self.url = f"{scheme}://{rest.rstrip('/')}"  # a trailing / dropped, never the scheme's
        self.scheme = protocol(url)
        self.retries = retries
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "scheme": self.scheme, "retries": self.retries, "_pid": -1}

    def fs(self) -> tuple[Any, str]:
        """This process's filesystem and the URL's path in it."""
        if self._pid != os.getpid():
            import fsspec.core

            filesystem_class(self.scheme, self.url)  # a package missing here too is one line
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **_options(self.scheme))
            if hasattr(self._fs, "retries"):
                self._fs.retries = 1  # s3fs tries 5 times by itself: ours are the retries
            self._pid = os.getpid()
        return self._fs, self._root

    def join(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes [start, end) of the object `name` under the URL (all of it without them)."""
        fs, root = self.fs()
        return self.attempt(self.join(name), lambda: fs.cat_file(f"{root}/{name}", start=start, end=end))

    def sizes(self) -> dict[str, int]:
        """name → size of every object directly under the URL (one listing)."""
        return {name: int(entry["size"]) for name, entry in self.objects().items()}

    def objects(self) -> dict[str, dict[str, Any]]:
        """name → listing entry (size, ETag…) of every object directly under the URL (one listing)."""
        fs, root = self.fs()
        listing = self.attempt(self.url, lambda: fs.ls(root, detail=True))
        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in listing}

    def attempt(self, url: str, call: Callable[[], T], action: str = "read") -> T:
        """call(), tried again on transient errors; then, or on any other error of storage, one line
        (`action`: what the call does to `url`, as the line says it: read, write, remove)."""
        waited = 0.0
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - what the storage library raised, said in one line
                if not transient(exc) or attempt == self.retries:
                    raise storage_error(url, exc, attempt + 1, waited, action) from None
                wait = min(FIRST_WAIT_S * 2**attempt, MAX_WAIT_S)
                sleep(wait)
                waited += wait
        raise AssertionError("unreachable")


def etag(entry: dict[str, Any]) -> str:
    """An object's version as its listing gives it (s3: ETag, gcs: md5Hash or etag, az: etag); '' if none."""
    return str(entry.get("ETag") or entry.get("etag") or entry.get("md5Hash") or "").strip('"').lower()


def _chain(exc: BaseException | None):
    """The exception, its cause, their causes…: the library's error wraps the socket's."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    """The HTTP status a library error carries (botocore's response, gcsfs' and aiohttp's code/status)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = getattr(exc, "status", None) or getattr(exc, "code", None)
    return code if isinstance(code, int) else None


def transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed: a connection refused, reset or timed out, a 5xx or 429."""
    for link in _chain(exc):
        if isinstance(link, (ConnectionError, TimeoutError, asyncio.TimeoutError)):  # apart before Python 3.11
            return True
        if isinstance(link, OSError) and link.errno in TRANSIENT_ERRNOS:
            return True
        status = _status(link)
        if status is not None and (status >= 500 or status == THROTTLED):
            return True
    return False


def _reason(exc: BaseException) -> str:
    """The library's words on one line, cut short (a validation error quotes whole regular expressions)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def storage_error(url: str, exc: BaseException, attempts: int, waited: float, action: str = "read") -> UserError:
    """One line naming the URL (the URL alone: credentials come from the environment) and what to check;
    any error of the storage call (an invalid bucket name is botocore's ParamValidationError) is one."""
    found = next((link for link in _chain(exc) if isinstance(link, (FileNotFoundError, PermissionError))), None)
    if isinstance(found, FileNotFoundError):
        return UserError(f"{url} does not exist ({_reason(found)}); check the bucket and the path of the URL")
    if isinstance(found, PermissionError):
        where = CREDENTIALS.get(protocol(url), "the credentials the environment gives")
        return UserError(
            f"cannot {action} {url}: access denied ({_reason(found)}); check the credentials ({where}) and that they "
            f"may {action} this bucket"
        )
    if transient(exc):
        return UserError(
            f"cannot {action} {url} ({_reason(exc)}) after {attempts} attempt(s) over {waited:.1f} s; check that the "
            f"storage endpoint is up and reachable (for s3://: AWS_ENDPOINT_URL), then run the same command again"
        )
    return UserError(f"cannot {action} {url} ({_reason(exc)}); check the URL and the storage it names")
