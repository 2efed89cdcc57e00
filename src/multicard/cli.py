"""Command line: `multicard train` and `multicard eval`. A thin layer over run and launch.

Launch examples (all train the same job):
    multicard train --config configs/demo.yaml                       # one process
    multicard train --config configs/demo.yaml --nproc-per-node 2    # DDP, built-in launcher
    torchrun --standalone --nproc-per-node 2 -m multicard train --config configs/demo.yaml
    srun --ntasks-per-node 4 python -m multicard train --config configs/demo.yaml
    multicard train --nnodes 2 --node-rank R --nproc-per-node 4 --master-addr HOST0 --master-port 29400 ...
(several machines, Slurm scripts: docs/multinode.md, examples/slurm/train.sbatch)

Exit codes: 0 success, 1 internal error (a bug: traceback shown), 2 bad input (one line),
3 training diverged (NaN/inf loss), 4 `verify` found a difference, 130 / 138 / 143 stopped
by SIGINT / SIGUSR1 / SIGTERM after a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from multicard import __version__, run
from multicard.config import load_config
from multicard.dist import ProcessEnv, detect_env
from multicard.errors import MulticardError, UserError
from multicard.launch import LaunchOptions, launch_workers
from multicard.stopping import Stopped


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        print(f"multicard: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(UserError.exit_code)


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (DDP workers through torchrun's elastic agent)")
    g.add_argument("--nproc-per-node", type=int, help="worker processes on this node (one per GPU)")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=int, default=0, help="rank of this node, 0..nnodes-1")
    g.add_argument("--master-addr", help="rendezvous host (node 0's address that the others reach); multi-node only")
    g.add_argument("--master-port", type=int, help="rendezvous port; a free one is chosen on one node")
    g.add_argument("--max-restarts", type=int, default=0, help="restarts of failed workers (default 0)")
    g.add_argument(
        "--rdzv-timeout", type=int, default=300, help="seconds to reach node 0 and for all nodes to join (default 300)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multicard", description="Train image classifiers on one device, DP or DDP.")
    parser.add_argument("--version", action="version", version=f"multicard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model", description="Train a model.")
    t.add_argument("--config", help="YAML config file")
    _add_launch_flags(t)
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.epochs=5")

    e = sub.add_parser("eval", help="evaluate a checkpoint", description="Evaluate a checkpoint exactly.")
    e.add_argument("--checkpoint", required=True, help="checkpoint file (e.g. out_dir/checkpoints/best.pt)")
    e.add_argument("--json", action="store_true", help="print the result as one JSON line")
    _add_launch_flags(e)
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. data.val_size=1000")
    b = sub.add_parser(
        "bench",
        help="throughput of single / dp / ddp side by side",
        description="Measure the same workload under each runner, strategy, world size and precision.",
    )
    b.add_argument("--config", help="YAML config file (default workload: resnet18, 32×32 on the device, batch 64)")
    b.add_argument("--runners", default="multicard,plain", help="multicard,plain,lightning,accelerate")
    b.add_argument("--strategies", default="single,dp,ddp", help="single,dp,ddp")
    b.add_argument("--world-sizes", default="1,2,4,8", help="processes (ddp) or GPUs (dp), e.g. 1,2")
    b.add_argument("--precisions", default="fp32", help="fp32,bf16,fp16")
    b.add_argument(
        "--ddp-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="extra ddp cells with these options, e.g. bf16:ddp.comm_hook=bf16 (repeatable)",
    )  # fmt: skip
    b.add_argument("--warmup", type=int, default=5, help="untimed steps per cell (default 5)")
    b.add_argument("--steps", type=int, default=30, help="timed steps per cell (default 30)")
    b.add_argument("--repeats", type=int, default=1, help="runs of every cell, alternating (default 1)")
    b.add_argument("--out", default="runs/bench", help="output directory (bench.json, bench.png)")
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. precision=bf16")
    v = sub.add_parser(
        "verify",
        help="check that N-process DDP trains like one process",
        description="Check on this machine that DDP equals single-process training, eval and sampling.",
    )
    v.add_argument("--config", help="YAML config file")
    v.add_argument("--nproc-per-node", type=int, default=2, help="processes of the DDP run (default 2)")
    v.add_argument("--steps", type=int, default=4, help="optimizer steps of each run (default 4)")
    v.add_argument("--break", dest="fault", choices=["no-set-epoch", "rank-seed"], help="break the setup on purpose")
    v.add_argument("--keep", help="keep the runs' files in this directory")
    v.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. model.name=smallcnn")
    return parser


def _verify(args: argparse.Namespace) -> int:
    from multicard.verify import VerifyFailed, VerifyOptions, verify

    if detect_env().launched:
        raise UserError("multicard verify starts its own processes; run it without torchrun or srun")
    options = VerifyOptions(args.config, args.overrides, args.nproc_per_node, args.steps, args.fault, args.keep)
    failed = [o for o in verify(options) if o.failed]
    if failed:
        raise VerifyFailed(f"{len(failed)} check(s) failed: {'; '.join(o.name for o in failed)}")
    return 0


def _list(text: str, flag: str, kind: type = str) -> list:
    try:
        return [kind(item) for item in text.split(",") if item]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be a comma-separated list of {kind.__name__}s") from None


def _bench(args: argparse.Namespace) -> int:
    from multicard.bench import BenchOptions, bench
    from multicard.bench.cells import parse_variant

    if detect_env().launched:
        raise UserError("multicard bench starts its own processes; run it without torchrun or srun")
    options = BenchOptions(
        config=args.config,
        overrides=args.overrides,
        runners=_list(args.runners, "--runners"),
        strategies=_list(args.strategies, "--strategies"),
        world_sizes=_list(args.world_sizes, "--world-sizes", int),
        precisions=_list(args.precisions, "--precisions"),
        variants=[parse_variant(v) for v in args.ddp_variant],
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        out=args.out,
    )
    rows = bench(options)
    return 0 if all(r["status"] != "failed" for r in rows) else 1


def _launch_options(args: argparse.Namespace, env: ProcessEnv) -> LaunchOptions | None:
    if args.nproc_per_node is None:
        return None
    if env.launched:
        raise UserError(f"--nproc-per-node starts workers, but this process is already one ({env.source}); drop it")
    return LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        rdzv_timeout=args.rdzv_timeout,
    )


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    env = detect_env()
    options = _launch_options(args, env)
    if options is None and cfg.strategy == "ddp" and not env.launched:
        # ddp asked for without a launcher: one worker per GPU in use (one on CPU).
        gpus = run.check_topology(cfg, "ddp", 1, 1)
        options = LaunchOptions(nproc_per_node=max(1, len(gpus)))
    if options is None:
        run.train(cfg, env)
        return 0
    if cfg.strategy in ("single", "dp"):
        raise UserError(f"--nproc-per-node starts DDP workers but strategy={cfg.strategy}; use strategy=ddp or auto")
    run.check_topology(cfg, "ddp", options.world_size, options.nproc_per_node)
    run.prepare_out_dir(cfg.out_dir)
    worker_argv = ["train", *(["--config", args.config] if args.config else []), *args.overrides]
    return launch_workers(options, worker_argv)


def _eval(args: argparse.Namespace) -> int:
    env = detect_env()
    options = _launch_options(args, env)
    if options is None:
        run.evaluate_checkpoint(args.checkpoint, args.overrides, env, args.json)
        return 0
    worker_argv = ["eval", "--checkpoint", args.checkpoint, *(["--json"] if args.json else []), *args.overrides]
    return launch_workers(options, worker_argv)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": _train, "eval": _eval, "bench": _bench, "verify": _verify}[args.command](args)
    except Stopped as exc:
        if detect_env().rank == 0:  # every rank stopped alike; one line is enough
            print(f"multicard: {exc}", file=sys.stderr)
        return exc.exit_code
    except MulticardError as exc:
        env = detect_env()
        where = f" (rank {env.rank})" if env.world_size > 1 else ""
        print(f"multicard: error{where}: {exc}", file=sys.stderr)
        if env.launched and env.world_size > 1:
            # End now, before interpreter shutdown closes this rank's connections: a peer that
            # loses them must not exit first, or the launcher would report its error, not ours.
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        print("multicard: interrupted", file=sys.stderr)
        return 130
