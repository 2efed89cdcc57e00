"""Loader throughput from object storage: packed shards at any URL, and S3 against a network filesystem.

Measure your own bucket: the shards `multicard pack` wrote, uploaded as they are, read by the workers
loader (data.name=shards, as training reads them; no model, so the loader is the limit). Credentials
and endpoint come from the environment, as for training (AWS_PROFILE, AWS_ENDPOINT_URL, ...):

    python benchmarks/object_storage.py s3://my-bucket/cifar10-shards
    python benchmarks/object_storage.py s3://my-bucket/cifar10-shards --samples 20000 data.reads_in_flight=32

Compare S3 with a network filesystem at the same link rate, on one machine (root; ip, tc, sshd, sshfs:
apt-get install -y openssh-server sshfs; moto[server]): an S3 server (moto's) in a network namespace
behind a veth capped by tc, against the same shards on the sharedfs mount (../shared/tools/sharedfs.sh,
nocache) at that rate; the repeats alternate between the two:

    multicard pack --out /tmp/c10-shards data.name=imagefolder data.root=/work/shared/data/cifar10
    python benchmarks/object_storage.py --compare /tmp/c10-shards --rate 1gbit --samples 10000

Prints one JSON line per measurement, a table (median, min, max) and, with --compare, the ratios
S3 / sharedfs and S3 / the link's rate in images/s (the rate divided by the mean sample's bytes).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from shared_storage import measure, print_table  # this folder's: the same measurement as for a mount

from multicard.base.errors import UserError
from multicard.data.sources.shards import read_index

SHAREDFS = Path(os.environ.get("MULTICARD_SHAREDFS", "/work/shared/tools/sharedfs.sh"))
NS, VETH, HOST, SERVER, PORT = "mcs3bench", ("vs3bench0", "vs3bench1"), "10.233.0.2", "10.233.0.1", 5000
BUCKET = "multicard-bench"
# Dummy credentials for the local server; a user's own bucket takes theirs from the environment.
LOCAL_S3 = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{SERVER}:{PORT}"}  # fmt: skip


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=60)


def bits_per_s(rate: str) -> float:
    """tc's rate (1gbit, 500mbit, 100kbit) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        sys.exit(f"object_storage: --rate {rate}: give tc's form, e.g. 1gbit or 500mbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def wait_for_port(host: str, port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"object_storage: the S3 server at {host}:{port} did not start within {timeout_s:g} s")
            time.sleep(0.2)


@contextmanager
def s3_server_behind_link(rate: str):
    """moto's S3 server in network namespace NS, reached over a veth whose both ends tc caps at `rate`."""
    server = None
    try:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        sh("ip", "link", "set", VETH[1], "netns", NS)
        sh("ip", "addr", "add", f"{HOST}/24", "dev", VETH[0])
        sh("ip", "link", "set", VETH[0], "up")
        sh("ip", "-n", NS, "addr", "add", f"{SERVER}/24", "dev", VETH[1])
        sh("ip", "-n", NS, "link", "set", VETH[1], "up")
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        for prefix, dev in ((), VETH[0]), (("ip", "netns", "exec", NS), VETH[1]):  # as sharedfs.sh caps its link
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
               "latency", "50ms")  # fmt: skip
        main = "import sys; from moto.server import main; sys.exit(main())"
        server = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", main, "-H", SERVER,
                                   "-p", str(PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_for_port(SERVER, PORT)
        yield
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


@contextmanager
def sharedfs_mount(rate: str):
    mount = Path("/tmp/multicard-bench-sharedfs")
    try:
        sh(str(SHAREDFS), "up", str(mount), rate, "nocache")
        yield mount
    finally:
        subprocess.run([str(SHAREDFS), "down", str(mount)], capture_output=True)


def upload(folder: Path, url: str) -> None:
    """The pack folder as it is, to `url` (its index and shards under one prefix), through the link."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    start = time.perf_counter()
    fs.put([str(p) for p in sorted(folder.iterdir()) if p.is_file()], url.removeprefix("s3://") + "/")
    print(f"uploaded {folder} to {url} in {time.perf_counter() - start:.1f} s")


def compare(args: argparse.Namespace) -> None:
    folder = args.compare.resolve()
    lengths = read_index(folder).splits["train"].columns["length"]
    link_img_s = bits_per_s(args.rate) / 8 / float(lengths.mean())
    url = f"s3://{BUCKET}/{folder.name}"
    os.environ.update(LOCAL_S3)  # the loader processes inherit it
    with s3_server_behind_link(args.rate), sharedfs_mount(args.rate) as mount:
        upload(folder, url)
        cases = [f"s3:data.name=shards,data.root={url}", f"sharedfs:data.name=shards,data.root={mount}{folder}"]
        rates = measure(cases, args.overrides, args.samples, args.repeats, args.batch)
    print_table(rates)
    s3, fs = statistics.median(rates["s3"]), statistics.median(rates["sharedfs"])
    print(f"link {args.rate}: {link_img_s:,.0f} img/s of {float(lengths.mean()):,.0f}-byte samples")
    print(f"S3 / sharedfs: {s3 / fs:.2f}   S3 / link: {s3 / link_img_s:.3f}   "
          f"acceptance (>= 0.8 of the lower): {s3 >= 0.8 * min(fs, link_img_s)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", nargs="?", help="a pack's URL, e.g. s3://bucket/cifar10-shards")
    p.add_argument("--compare", type=Path, metavar="PACK_DIR", help="a local pack: S3 behind a link vs sharedfs")
    p.add_argument("--rate", default="1gbit", help="--compare: the link's rate, tc's form (default 1gbit)")
    p.add_argument("--samples", type=int, default=10000, help="training samples per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("overrides", nargs="*", help="settings, e.g. data.num_workers=4 data.reads_in_flight=16")
    args = p.parse_args()
    if args.url and "=" in args.url:  # overrides only: argparse took the first for the URL
        args.overrides, args.url = [args.url, *args.overrides], None
    if bool(args.url) == bool(args.compare):
        p.error("give a URL or --compare PACK_DIR (one of them)")
    if args.compare:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server, link and mount are taken down
        if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("sshfs"):
            p.error("--compare needs root, tc and sshfs (apt-get install -y openssh-server sshfs iproute2)")
        compare(args)
    else:
        try:
            rates = measure([f"url:data.name=shards,data.root={args.url}"], args.overrides, args.samples,
                            args.repeats, args.batch)  # fmt: skip
        except UserError as exc:  # a wrong URL, missing credentials: training's own one line
            sys.exit(f"object_storage: error: {exc}")
        print_table(rates)


if __name__ == "__main__":
    main()
