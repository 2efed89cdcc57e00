"""Requests to storage: retries of what may succeed later, and one line for what will not.

A request that fails transiently (connection refused or reset, a timeout, a 5xx or throttling answer) is
tried again after 0.5 s, 1 s, 2 s, … (at most MAX_WAIT_S apart), `retries` times; then, or at once for a
missing bucket or object or a refusal of access, one line naming the URL and what to check. Credentials
come from the environment the protocol's package reads, never from a URL (base/locations.py refuses
one that holds them), so a line that names the URL shows none.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Iterator
from time import sleep  # by this name: a test records the waits of this module alone
from typing import Any, TypeVar

from multicard.base.errors import UserError
from multicard.base.locations import CREDENTIALS, protocol

FIRST_WAIT_S, MAX_WAIT_S = 0.5, 8.0  # backoff between attempts: doubles from the first, up to the most
# OSErrors that a later attempt may not meet: s3fs's names for SlowDown / 503 (EBUSY), InternalError / 500
# (EREMOTEIO), and the socket's own.
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE})  # fmt: skip
MAX_REASON = 160  # characters of a library's message in our line
THROTTLED = 429  # an HTTP status that asks to come back later, as 5xx do
T = TypeVar("T")


def attempt(what: str, call: Callable[[], T], retries: int, action: str = "read") -> T:
    """call(), tried again on transient errors; then, or on any other error of storage, one line
    (`action`: what the call does to `what`, a URL, as the line says it: read, write, remove)."""
    waited = 0.0
    for tried in range(retries + 1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - what the storage library raised, said in one line
            if not transient(exc) or tried == retries:
                raise storage_error(what, exc, tried + 1, waited, action) from None
            wait = min(FIRST_WAIT_S * 2**tried, MAX_WAIT_S)
            sleep(wait)
            waited += wait
    raise AssertionError("unreachable")


def etag(entry: dict[str, Any]) -> str:
    """An object's version as its listing gives it (s3: ETag, gcs: md5Hash or etag, az: etag); '' if none."""
    return str(entry.get("ETag") or entry.get("etag") or entry.get("md5Hash") or "").strip('"').lower()


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
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


def os_reason(exc: BaseException) -> str | None:
    """The OS's reason (e.g. 'No space left on device') inside an error, or inside the per-rank failures
    torch.distributed.checkpoint collects, if any."""
    if isinstance(exc, OSError):
        return os.strerror(exc.errno) if exc.errno else exc.strerror
    inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]  # (exc, trace)
    for cause in [*inner, exc.__cause__, exc.__context__]:
        if isinstance(cause, BaseException) and cause is not exc:
            reason = os_reason(cause)
            if reason:
                return reason
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
