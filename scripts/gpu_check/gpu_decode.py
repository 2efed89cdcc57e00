"""GPU JPEG decoding (data.decode=gpu) against the workers loader's CPU decoding, on real photos.

The training loader of the ImageNet recipes alone (no model): random resized crop to 224 px +
flip, batches of `--batch`, `--workers` loader processes, normalised batches on the GPU, timed
between CUDA synchronisations after a warm-up batch, for `--seconds` per mode:
- cpu: workers decode, crop and resize (data.decode=cpu);
- gpu: workers read files and plan crops, nvjpeg decodes the batch and the GPU crops (data.decode=gpu).
Also: the GPU side alone (nvjpeg + crops of one planned batch, ms), and how far the GPU path's
pixels are from the CPU path's (mean absolute difference in uint8 levels, same crops).

    python scripts/gpu_check/gpu_decode.py [--out runs/gpu-decode] [--root ../shared/data/imagenet-sample]

Without photos (../shared does not travel to a GPU machine) it writes photo-like JPEGs under --out
(jpegs.py). The row fails if nvjpeg fell back to Pillow for any batch (GpuDecode.fell_back, or its
warning from inside the loader): a passing row timed nvjpeg. Without CUDA it writes status
"skipped" with the reason.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torchvision
from jpegs import jpeg_files, linked_folder, photos
from train_run import cuda_or_reason

from multicard.base.config import load_config
from multicard.data import build_data
from multicard.data.decoding.decode import read_image
from multicard.data.decoding.gpu_decode import GpuDecode
from multicard.data.decoding.jpeg_crop import JpegTransform, collate_encoded
from multicard.data.loading.sampling import BatchSplit
from multicard.data.augmentation.transforms import RandomResizedCropFlip
from multicard.runtime.process_group import ProcessContext

IMAGE_SIZE = 224


def loader_img_per_s(root: Path, decode: str, batch: int, workers: int, seconds: float, device) -> dict:
    """Images per second of the training loader, normalised batches on `device`."""
    cfg = load_config(None, [
        "data.name=imagefolder", f"data.root={root}", f"data.image_size={IMAGE_SIZE}", "data.loader=workers",
        f"data.num_workers={workers}", f"data.decode={decode}", "data.mean=[0.485,0.456,0.406]",
        "data.std=[0.229,0.224,0.225]",
    ])  # fmt: skip
    ctx = ProcessContext(0, 0, 1, 1, device, distributed=False)
    data = build_data(cfg.data, cfg.seed, BatchSplit(batch, 1, 1), ctx)
    images, timed, epoch = 0, 0.0, 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while timed < seconds:
                data.train.set_epoch(epoch)
                it = iter(data.train)
                next(it)  # the first batch of an epoch waits for the workers to start on it
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                count = 0
                for x, _ in it:
                    count += x.shape[0]
                torch.cuda.synchronize(device)
                timed += time.perf_counter() - start
                images += count
                epoch += 1
        fallbacks = [str(w.message) for w in caught if "nvjpeg could not decode" in str(w.message)]
    finally:
        data.close()
    return {"img_per_s": round(images / timed, 1) if timed else None, "images": images, "epochs": epoch,
            "nvjpeg_fallback": fallbacks[:1]}  # fmt: skip


def gpu_side(files: list[Path], batch: int, device) -> dict:
    """nvjpeg + crops of one planned batch (ms, median of 5), and its pixels against the CPU path's."""
    transform = RandomResizedCropFlip(IMAGE_SIZE, (0.08, 1.0), flip=True, seed=0)
    plan = JpegTransform(transform)
    paths = files[:batch]
    items = [(plan(read_image(p), 0, i), torch.tensor(0), i) for i, p in enumerate(paths)]
    encoded, _, _ = collate_encoded(items)
    decoder = GpuDecode([0, 0, 0], [1, 1, 1], device, 0, IMAGE_SIZE)
    decoder.assemble(encoded)  # warm-up: nvjpeg's handles and buffers
    if decoder.fell_back:
        raise RuntimeError("nvjpeg fell back to Pillow: the GPU decode was not timed")
    times = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        ours = decoder.assemble(encoded)
        torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    cpu = torch.stack([transform(read_image(p), 0, i) for i, p in enumerate(paths)]).float()
    diff = (ours.cpu() - cpu).abs().mean(dim=(1, 2, 3))
    return {"batch": len(paths), "ms": round(sorted(times)[2], 2),
            "img_per_s": round(1000 * len(paths) / sorted(times)[2], 1),
            "mad_vs_cpu_mean": round(diff.mean().item(), 3), "mad_vs_cpu_max": round(diff.max().item(), 3)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu-decode"))
    p.add_argument("--root", type=Path, default=None, help="class folders of JPEG photos (default: the sample)")
    p.add_argument("--photos", type=Path, help="where to write JPEGs when none are at hand (default OUT/photos)")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--workers", type=int, default=8, help="loader processes (both modes)")
    p.add_argument("--seconds", type=float, default=20, help="timed per mode")
    args = p.parse_args()
    result: dict = {"torch": torch.__version__, "torchvision": torchvision.__version__, "root": str(args.root),
                    "image_size": IMAGE_SIZE, "batch": args.batch, "workers": args.workers}  # fmt: skip
    if (reason := cuda_or_reason()) is not None:
        result.update(status="skipped", reason=reason)
    else:
        device = torch.device("cuda", 0)
        result["device"] = torch.cuda.get_device_name(device)
        try:
            root, result["root"] = photos(args.root, args.photos or args.out / "photos")
            files = jpeg_files(root)
            result["photos"] = len(files)
            result["gpu_side"] = gpu_side(files, args.batch, device)
            folder = linked_folder(root, args.out / "imagefolder")
            for decode in ("cpu", "gpu"):
                result[decode] = loader_img_per_s(folder, decode, args.batch, args.workers, args.seconds, device)
            cpu, gpu = result["cpu"]["img_per_s"], result["gpu"]["img_per_s"]
            fell_back = result["gpu"]["nvjpeg_fallback"]
            result.update(status="failed" if fell_back else "passed")
            result["gpu_over_cpu"] = round(gpu / cpu, 2) if cpu and gpu else None
            if fell_back:
                result["reason"] = f"nvjpeg fell back to Pillow in the loader: {fell_back[0]}"
        except Exception as exc:  # the JSON says what failed; the step's exit code says that it did
            first = (str(exc).strip().splitlines() or [""])[0]
            result.update(status="failed", reason=f"{type(exc).__name__}: {first}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if result["status"] == "failed":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
