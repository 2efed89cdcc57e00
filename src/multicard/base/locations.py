"""The one parser of locations: every path or URL multicard is given (data.root, checkpoint.dir,
train.resume, model.weights, out_dir, eval/export --checkpoint, pack --out/--verify, …) is read here,
once, into its canonical form, so that every form fsspec understands is understood everywhere and every
form it does not is one line wherever it is given.

- a URL: its scheme in lower case (`S3://b/x` is `s3://b/x`: fsspec's protocols are lower case), its
  trailing / dropped; a URL holding credentials, of a protocol fsspec does not know or whose package is
  missing is one line (`check_url`);
- `file:///abs/path` (and `local://`) is the local path `/abs/path`;
- a scheme of a protocol fsspec knows followed by one slash or none (`s3:/bucket/x`, `s3:bucket`) is
  refused in one line naming the URL meant: never a local folder `./s3:/bucket/x`;
- anything else is a local path (`C:\\…`, `notes:v2`), `~` its owner's home.
"""

from __future__ import annotations

import os
import re
from typing import Any

from multicard.base.errors import UserError

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # scheme://... (s3://, gs://, az://, https://, file://)
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(.*)$", re.S)  # two letters at least: C:\ is a drive
LOCAL_SCHEMES = ("file", "local")  # fsspec's names of the local filesystem
# Where fsspec cannot be imported: the protocols whose one-slash form is still no local path.
COMMON = ("s3", "s3a", "gs", "gcs", "az", "abfs", "adl", "hdfs", "webhdfs", "http", "https", "file", "local", "oss")
EXTRAS = {"s3": "multicard[s3]", "s3a": "multicard[s3]"}  # protocols with an extra of ours; others: their package
CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"}


def shown(key: str, value: str) -> str:
    """How a setting was given, for a message: `--out VALUE` for a flag, `key=VALUE` for the config."""
    return f"{key} {value}" if key.startswith("-") else f"{key}={value}"


def known_protocols() -> set[str]:
    try:
        import fsspec
    except ImportError:
        return set(COMMON)
    return set(fsspec.available_protocols()) | set(COMMON)


def canonical(value: str, key: str) -> str:
    """`value`, given for `key`, in its canonical form (see the module's docstring); one line where it
    is a malformed URL."""
    match = SCHEME.match(value)
    if match is None:
        return os.path.expanduser(value)
    scheme, rest = match[1].lower(), match[2]
    if not rest.startswith("//"):
        if scheme not in known_protocols():
            return os.path.expanduser(value)  # a local name with a colon
        meant = f"{scheme}:///{rest.lstrip('/')}" if scheme in LOCAL_SCHEMES else f"{scheme}://{rest.lstrip('/')}"
        raise UserError(
            f"{shown(key, value)} is neither a URL nor a local path: a URL has two slashes after its scheme; "
            f"give {meant}"
        )
    if scheme in LOCAL_SCHEMES:
        path = rest[2:]
        if not path.startswith("/"):
            raise UserError(
                f"{shown(key, value)}: a {scheme}:// URL names an absolute path after its two slashes "
                f"({scheme}:///abs/path); give {scheme}:///{path} or the path itself"
            )
        return path
    return f"{scheme}://{rest[2:]}".rstrip("/") if rest[2:].strip("/") else f"{scheme}://{rest[2:]}"


def is_url(value: str | None) -> bool:
    return bool(URL.match(value or ""))


def protocol(url: str) -> str:
    match = URL.match(url)
    if match is None:
        raise ValueError(f"{url!r} is no URL (callers check is_url first)")
    return match[1].lower()


def check_url(url: str, key: str) -> None:
    """A URL that can be read: no credentials in it, and a protocol fsspec knows whose package is
    installed; else one line naming what to change or install."""
    scheme, rest = protocol(url), url.split("://", 1)[1]
    if not rest.strip("/"):
        raise UserError(f"{key}={url} names no location; give the bucket and prefix, e.g. {scheme}://bucket/prefix")
    if "@" in rest.split("/", 1)[0]:
        hidden = f"{scheme}://…@{rest.split('@', 1)[1]}"
        raise UserError(
            f"{key}={hidden} holds credentials (user or key before @), which the saved config would keep; remove "
            f"them and give them through the environment (for s3://: {CREDENTIALS['s3']})"
        )
    filesystem_class(scheme, f"{key}={url}")


def filesystem_class(scheme: str, given: str) -> type[Any]:
    """fsspec's filesystem for a protocol, imported; a missing package or unknown protocol is one line."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise UserError(f"{given} is read through fsspec: {install(scheme, None)}") from None
    known = known_implementations.get(scheme)
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = known["class"].split(".")[0] if known else scheme
        install_it = install(scheme, package)
        raise UserError(f"{given} needs {package} (fsspec's {scheme}:// protocol): {install_it}") from None
    except ValueError:
        raise UserError(
            f"{given}: {scheme}:// is no storage protocol fsspec knows; give a local path or a URL such as "
            f"s3://bucket/prefix"
        ) from None


def install(scheme: str, package: str | None) -> str:
    if scheme in EXTRAS:
        return f"pip install '{EXTRAS[scheme]}'"
    return f"pip install fsspec {package}" if package else f"pip install fsspec and the package of {scheme}://"


def check_local_path(value: str | None, name: str) -> None:
    """A path multicard reads or writes is a local one (a mounted filesystem counts): a URL is one
    line, never a local folder named after its scheme (s3:/bucket/... in the working directory)."""
    match = URL.match(value or "")
    if match and value:
        given = shown(name, value)
        if name == "out_dir":  # the run's own files stay local; its checkpoints may go to the bucket
            raise UserError(
                f"{given} is a URL ({match[1]}://); out_dir holds the run's logs and stays local: give a local "
                f"out_dir and put the checkpoints on object storage with checkpoint.dir={value.rstrip('/')}/checkpoints"
            )
        raise UserError(
            f"{given} is a URL ({match[1]}://); multicard reads and writes local paths only (a mounted "
            f"filesystem works): copy the data or mount the bucket, and give its local path"
        )


def check_location(value: str | None, key: str, urls: bool) -> None:
    """A location (canonical) given for `key` can be used there: a URL where `key` takes one (`urls`) and
    fsspec reads it (check_url), else a local path (check_local_path)."""
    if value and is_url(value) and urls:
        check_url(value, key)
    else:
        check_local_path(value, key)
