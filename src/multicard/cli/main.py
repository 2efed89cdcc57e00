"""The `multicard` command: parses the command line, then runs a command in this process or starts
its workers through torchrun's agent (runtime/launch.py). Both `multicard` and `python -m multicard`
come here.

Commands:
    train        train an image classifier from a config (the recipe written on multicard.Run)
    run          run your own training script that uses multicard.Run, in one process or as N workers
    eval         evaluate a checkpoint exactly, at any world size
    export       write a checkpoint's model as a plain state dict
    plan         per-device memory and step time of each strategy on a named GPU, before renting it
    bench        throughput of each strategy, world size and precision beside a plain loop
    verify       prove on this machine that N processes train like one and resume exactly
    pack         pack a dataset into shards for shared or object storage
    input-split  where input time goes: storage reads, decoding, augmentation, copy to the device
    report       pictures and a summary of runs, from their metrics

Launch examples (all train the same job):
    multicard train --config configs/demo.yaml                       # one process
    multicard train --config configs/demo.yaml --nproc-per-node 2    # DDP, built-in launcher
    torchrun --standalone --nproc-per-node 2 -m multicard train --config configs/demo.yaml
    srun --ntasks-per-node 4 python -m multicard train --config configs/demo.yaml
    multicard train --nnodes 2 --node-rank R --nproc-per-node 4 --master-addr HOST0 --master-port 29400 ...
    multicard run --nproc-per-node 2 my_train.py                     # your own loop, 2 workers
(several machines, Slurm scripts: docs/multinode.md, examples/slurm/train.sbatch; the reference of
every command and option: docs/cli.md, generated from this parser)

Exit codes: errors.ExitCode (docs/errors.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from multicard.assembly.preflight import check_output_folder, preflight
from multicard.base.config import Config, check_world_sizes, load_config, parse_devices
from multicard.base.errors import ExitCode, MulticardError, UserError
from multicard.base.locations import canonical, check_location
from multicard.base.version import __version__
from multicard.runtime.environment import ProcessEnv, detect_env, node_range, node_topology
from multicard.runtime.exits import die_with_launcher, report_error, run_to_the_end
from multicard.runtime.launch import LaunchOptions, check_cpu_capacity, launch_workers, rendezvous_conf
from multicard.runtime.process_group import resolve_gpus
from multicard.runtime.script import run_script
from multicard.runtime.stopping import BeforeTraining
from multicard.strategy.topology import Topology, resolve
from multicard.tools.plan.arguments import add_plan_parser, plan_options
from multicard.tools.verify.checks import CHECKS, FAULTS

DESCRIPTION = (
    "Train PyTorch models on one device, DataParallel, DDP or FSDP, on one machine or many: image classifiers "
    "from a config (train), or your own training loop with multicard.Run (run); then evaluate, export, plan, "
    "measure and verify them."
)
EPILOG = "multicard COMMAND --help describes a command and its options."


class _Parser(argparse.ArgumentParser):
    commands: dict[str, _Parser]  # the top-level parser's subcommands, by name

    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        print(f"multicard: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(ExitCode.BAD_INPUT)


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (DDP workers through torchrun's elastic agent)")
    g.add_argument("--nproc-per-node", type=int, help="worker processes on this node (one per GPU)")
    g.add_argument(
        "--nnodes", default="1",
        help="number of nodes N, or MIN:MAX for an elastic job that goes on as nodes leave and join (default 1)",
    )  # fmt: skip
    g.add_argument(
        "--node-rank", type=int, default=0, help="rank of this node, 0..nnodes-1 (node 0 hosts the rendezvous)"
    )
    g.add_argument("--master-addr", help="rendezvous host (node 0's address that the others reach); multi-node only")
    g.add_argument("--master-port", type=int, help="rendezvous port; a free one is chosen on one node")
    g.add_argument(
        "--max-restarts", type=int, default=0,
        help="restarts of the workers after a failure or a lost node, each from the newest checkpoint (default 0)",
    )  # fmt: skip
    g.add_argument(
        "--rdzv-conf", default="",
        help="torchrun's rendezvous settings KEY=VALUE,...: last_call_timeout, keep_alive_interval, "
        "keep_alive_max_attempt, close_timeout, heartbeat",
    )  # fmt: skip
    g.add_argument(
        "--oversubscribe", action="store_true", help="on CPU, allow more processes than cores or than memory allows"
    )
    g.add_argument(
        "--rdzv-timeout", type=int, default=300, help="seconds to reach node 0 and for all nodes to join (default 300)"
    )


def _command(sub: argparse._SubParsersAction, name: str, summary: str, config: str | None, example: str) -> _Parser:
    """A subcommand with `--config` (when `config` describes it) and KEY=VALUE overrides (when
    `example` shows one)."""
    p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
    if config is not None:
        p.add_argument("--config", help=config)
    if example:
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"config overrides, e.g. {example}")
    return p


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = _command(
        sub, "bench", "img/s, scaling, memory and step-time split of each strategy, world size and precision, "
        "beside a plain loop (and Lightning, Accelerate)",
        "YAML config file (default workload: resnet18, 32×32 on the device, batch 64)", "precision=bf16",
    )  # fmt: skip
    b.add_argument("--runners", default="multicard,plain", help="multicard,plain,lightning,accelerate")
    b.add_argument("--strategies", default="single,dp,ddp", help="single,dp,ddp,fsdp")
    b.add_argument("--world-sizes", default="1,2,4,8", help="processes (ddp) or GPUs (dp), e.g. 1,2")
    b.add_argument("--precisions", default="fp32", help="fp32,bf16,fp16")
    b.add_argument(
        "--ddp-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="extra ddp cells with these options, e.g. bf16:ddp.comm_hook=bf16 or zero1:ddp.shard_optimizer=true",
    )  # fmt: skip
    b.add_argument(
        "--fsdp-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="extra fsdp cells with these options, e.g. zero2:fsdp.reshard_after_forward=false (repeatable)",
    )  # fmt: skip
    b.add_argument("--warmup", type=int, default=5, help="untimed steps per cell (default 5)")
    b.add_argument("--steps", type=int, default=30, help="timed steps per cell (default 30)")
    b.add_argument("--repeats", type=int, default=1, help="runs of every cell, alternating (default 1)")
    b.add_argument("--out", default="runs/bench", help="output directory (bench.json, bench.png)")
    b.add_argument(
        "--logging", action="store_true",
        help="multicard's cells log as train does: metrics.jsonl, TensorBoard and the trackers the config turns on",
    )  # fmt: skip


def _add_verify_parser(sub: argparse._SubParsersAction) -> None:
    v = _command(
        sub, "verify", "prove on this machine that N-process DDP trains like one process, evaluates and resumes "
        "exactly",
        "YAML config file", "model.name=smallcnn",
    )  # fmt: skip
    v.add_argument(
        "--break", dest="faults", action="append", default=[], choices=FAULTS,
        help="break the setup (no-set-epoch, rank-seed) or its checkpoints (rng, data-position) on purpose; repeatable",
    )  # fmt: skip
    v.add_argument("--nproc-per-node", type=int, default=2, help="processes of the DDP run (default 2)")
    v.add_argument("--steps", type=int, default=4, help="optimizer steps of each run (default 4)")
    v.add_argument("--checks", default=",".join(CHECKS), help=f"which checks to run (default {','.join(CHECKS)})")
    v.add_argument("--keep", help="keep the runs' files in this directory")


def build_parser() -> _Parser:
    parser = _Parser(prog="multicard", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--version", action="version", version=f"multicard {__version__}", help="show multicard's version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.commands = sub.choices

    t = _command(sub, "train", "train an image classifier from a config, in one process or as DDP/FSDP workers",
                 "YAML config file (defaults: the embedded dataset, resnet18)", "train.epochs=5")  # fmt: skip
    _add_launch_flags(t)

    e = _command(sub, "eval", "evaluate a checkpoint exactly: top-1, top-5 and loss over every sample once, at any "
                 "world size", None, "data.val_size=1000")  # fmt: skip
    e.add_argument("--checkpoint", required=True, help="checkpoint file (e.g. out_dir/checkpoints/best.pt)")
    e.add_argument("--json", action="store_true", help="print the result as one JSON line")
    e.add_argument("--ema", action="store_true", help="evaluate the checkpoint's EMA of the weights (ema.decay)")
    _add_launch_flags(e)

    x = _command(sub, "export", "write a checkpoint's model as a plain state dict file", None, "")
    x.add_argument("--checkpoint", required=True, help="checkpoint file or sharded checkpoint directory")
    x.add_argument("--out", required=True, help="the state dict file to write, e.g. model.pt")
    x.add_argument("--ema", action="store_true", help="write the checkpoint's EMA of the weights (ema.decay)")

    r = _command(sub, "report", "pictures and a summary of runs, from their metrics.jsonl", None, "")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="out_dir of each run (several are overlaid)")
    r.add_argument("--out", default="report.png", help="the PNG to write (default report.png)")

    _add_bench_parser(sub)
    add_plan_parser(sub)

    k = _command(
        sub, "pack", "pack a dataset into shards (tar in WebDataset's layout + an index) for shared or object storage",
        "YAML config file (its data section names the dataset)", "data.name=imagefolder data.root=DIR",
    )  # fmt: skip
    k.add_argument("--out", help="the folder to pack into (new or empty; an unfinished pack there is continued)")
    k.add_argument("--shard-mb", type=float, default=256.0, help="size of one shard in MiB (default 256)")
    k.add_argument("--workers", type=int, default=0, help="packing processes (default 0: every core)")
    k.add_argument("--verify", metavar="DIR", help="check a packed folder instead: sizes, checksums, members, labels")

    i = _command(
        sub, "input-split", "where input time goes per rank: storage reads, decoding, augmentation, copy to the device",
        "YAML config file", "data.name=shards data.root=DIR",
    )  # fmt: skip
    i.add_argument("--world-size", type=int, default=1, help="ranks whose batches to measure (default 1)")
    i.add_argument("--batches", type=int, default=4, help="micro-batches measured per rank (default 4)")

    _add_verify_parser(sub)
    _add_run_parser(sub)
    return parser


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser(
        "run", help="run your own training script (multicard.Run) in this process or as N DDP/FSDP workers",
        description="Run a training script that uses multicard.Run: in this process, or with --nproc-per-node "
        "as DDP workers through torchrun's agent (graceful stop, stall reports, the same exit codes).",
    )  # fmt: skip
    _add_launch_flags(u)
    u.add_argument(
        "--stop-timeout", type=float, default=300.0,
        help="seconds the workers get to checkpoint and exit after a stop signal (default 300)",
    )  # fmt: skip
    u.add_argument("script", help="the Python script to run")
    u.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def _verify(args: argparse.Namespace) -> int:
    from multicard.tools.verify import VerifyFailed, VerifyOptions, verify

    if detect_env().launched:
        raise UserError("multicard verify starts its own processes; run it without torchrun or srun")
    if args.keep:
        check_output_folder(args.keep, "--keep")
    options = VerifyOptions(
        args.config, args.overrides, args.nproc_per_node, args.steps, args.faults, args.keep, args.checks.split(",")
    )
    failed = [o for o in verify(options) if o.failed]
    if failed:
        raise VerifyFailed(f"{len(failed)} check(s) failed: {'; '.join(o.name for o in failed)}")
    return ExitCode.OK


def _list(text: str, flag: str, kind: type = str) -> list:
    try:
        return [kind(item) for item in text.split(",") if item]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be a comma-separated list of {kind.__name__}s") from None


def _bench(args: argparse.Namespace) -> int:
    from multicard.tools.bench import BenchOptions, bench
    from multicard.tools.bench.cells import parse_variant

    if detect_env().launched:
        raise UserError("multicard bench starts its own processes; run it without torchrun or srun")
    check_output_folder(args.out, "--out")
    options = BenchOptions(
        config=args.config,
        overrides=args.overrides,
        runners=_list(args.runners, "--runners"),
        strategies=_list(args.strategies, "--strategies"),
        world_sizes=_list(args.world_sizes, "--world-sizes", int),
        precisions=_list(args.precisions, "--precisions"),
        variants=[
            *(parse_variant(v, "ddp") for v in args.ddp_variant),
            *(parse_variant(v, "fsdp") for v in args.fsdp_variant),
        ],
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        out=args.out,
        logging=args.logging,
    )
    rows = bench(options)
    return ExitCode.OK if all(r["status"] != "failed" for r in rows) else ExitCode.INTERNAL


def _launch_options(args: argparse.Namespace, env: ProcessEnv) -> LaunchOptions | None:
    if args.nproc_per_node is None:
        return _cloud_options(args, env)
    if env.launched:
        raise UserError(f"--nproc-per-node starts workers, but this process is already one ({env.source}); drop it")
    fewest, most = node_range(args.nnodes, "--nnodes")
    return LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        nnodes=most,
        min_nodes=fewest,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        rdzv_timeout=args.rdzv_timeout,
        oversubscribe=args.oversubscribe,
        rdzv_conf=rendezvous_conf(args.rdzv_conf),
    )


def _cloud_options(args: argparse.Namespace, env: ProcessEnv) -> LaunchOptions | None:
    """This node's workers as a Kubeflow TrainJob or a SkyPilot task describes the job (one command
    per node, no launcher flags), or None: a plain process, or one a launcher already started."""
    node = node_topology()
    if node is None or env.launched:
        return None
    return LaunchOptions(
        nproc_per_node=node.nproc_per_node or max(1, len(resolve_gpus([]))),
        nnodes=node.nnodes,
        min_nodes=node.min_nodes,
        node_rank=node.node_rank,
        master_addr=node.master_addr if node.nnodes > 1 else None,
        master_port=node.master_port if node.nnodes > 1 else None,
        max_restarts=args.max_restarts if node.max_restarts is None else node.max_restarts,
        rdzv_timeout=args.rdzv_timeout,
        oversubscribe=args.oversubscribe,
        rdzv_conf=rendezvous_conf(",".join((node.rdzv_conf, args.rdzv_conf))),
    )


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    env = detect_env()
    options = _launch_options(args, env)
    if options is None and cfg.strategy in ("ddp", "fsdp") and not env.launched:
        # ddp or fsdp asked for without a launcher: one worker per GPU in use (one on CPU).
        options = LaunchOptions(nproc_per_node=max(1, len(resolve_gpus(parse_devices(cfg.devices)))))
    if options is None:
        from multicard.cli import commands  # the training stack, loaded where it runs: not in a launcher

        commands.train(cfg, env)
        return ExitCode.OK
    topology = _resolve_every_size(cfg, options)  # bad input costs no start-up
    if not topology.gpus:
        check_cpu_capacity(options.nproc_per_node, options.oversubscribe)
    worker_argv = ["train", *(["--config", args.config] if args.config else []), *args.overrides]
    with preflight(cfg, hold_lock=options.node_rank == 0) as lock:  # node 0 holds it for the whole job
        try:
            code = launch_workers(options, worker_argv, stop_timeout_s=cfg.checkpoint.stop_timeout_s)
        except UserError:
            lock.refused()
            raise
        if code == ExitCode.BAD_INPUT:
            lock.refused()  # leaves out_dir as it found it (what a run wrote before failing stays)
        return code


def _resolve_every_size(cfg: Config, options: LaunchOptions) -> Topology:
    """The run's topology at its most nodes, once the config holds at every world size it may run at
    (an elastic job's MIN:MAX: the global batch splits over each, and each size's other rules)."""
    sizes = options.world_sizes
    if cfg.train.resume == "never" and options.restartable:
        raise UserError(
            "train.resume=never would start the job afresh at each restart (--max-restarts, --nnodes MIN:MAX); "
            "use train.resume=auto (the default) with a new or emptied out_dir"
        )
    if len(sizes) > 1:
        check_world_sizes(cfg.train.global_batch_size, cfg.train.grad_accum, sizes, options.nodes_text)
    for size in sizes[:-1]:
        resolve(cfg, size, options.nproc_per_node, launched=True)
    return resolve(cfg, sizes[-1], options.nproc_per_node, launched=True)


def _eval(args: argparse.Namespace) -> int:
    from multicard.cli import commands

    env = detect_env()
    options = _launch_options(args, env)
    if options is None:
        commands.evaluate_checkpoint(args.checkpoint, args.overrides, env, args.json, args.ema)
        return ExitCode.OK
    if not commands.check_eval(args.checkpoint, args.overrides, options.world_size, options.nproc_per_node).gpus:
        check_cpu_capacity(options.nproc_per_node, options.oversubscribe)
    flags = [*(["--json"] if args.json else []), *(["--ema"] if args.ema else [])]
    worker_argv = ["eval", "--checkpoint", args.checkpoint, *flags, *args.overrides]
    return launch_workers(options, worker_argv)


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, with KEY=VALUE overrides accepted anywhere among the flags."""
    parser = build_parser()
    commands = parser.commands
    if argv and argv[0] == "run":  # everything after the script is the script's
        args = commands["run"].parse_args(argv[1:])
        args.command = "run"
        return args
    if argv and argv[0] in commands:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # --help, --version, or an unknown command: argparse says so


def _pack(args: argparse.Namespace) -> int:
    from multicard.tools.pack import run_pack

    print(run_pack(args.config, args.overrides, args.out, args.verify, args.shard_mb, args.workers))
    return ExitCode.OK


def _input_split(args: argparse.Namespace) -> int:
    from multicard.tools.input_split import run_input_split

    print("\n".join(run_input_split(args.config, args.overrides, args.world_size, args.batches)))
    return ExitCode.OK


def _plan(args: argparse.Namespace) -> int:
    from multicard.tools.plan.command import run_plan  # tracing and planning: loaded only for this command

    options = plan_options(args)
    if detect_env().launched:
        raise UserError("multicard plan starts its own processes; run it without torchrun or srun")
    if options.plans:
        check_output_folder(options.out, "--out")
    return run_plan(options)


def _report(args: argparse.Namespace) -> int:
    from multicard.tools.report import report  # matplotlib: loaded only for this command

    report(args.runs, args.out)
    return ExitCode.OK


def _script(args: argparse.Namespace) -> str:
    """`multicard run`'s SCRIPT, once it is known to be one `python SCRIPT` would run."""
    script = Path(args.script)
    if script.is_dir() and not (script / "__main__.py").is_file():  # with one, python runs a folder
        raise UserError(
            f"script {args.script} is a folder (without a __main__.py); give the path of a Python file "
            f"(multicard run my_train.py)"
        )
    if not (script.is_file() or script.is_dir()):
        raise UserError(f"script {args.script} not found; give the path of a Python file (multicard run my_train.py)")
    return args.script


def _run_workers(args: argparse.Namespace, options: LaunchOptions) -> int:
    """`multicard run --nproc-per-node N SCRIPT ARGS`: N workers that each run `multicard run SCRIPT
    ARGS`, the script in the worker's own process (main), started by torchrun's agent."""
    if not resolve_gpus([]):
        check_cpu_capacity(options.nproc_per_node, options.oversubscribe)
    return launch_workers(options, ["run", args.script, *args.args], stop_timeout_s=args.stop_timeout)


def _export(args: argparse.Namespace) -> int:
    from multicard.cli import commands

    commands.export(args.checkpoint, args.out, args.ema)
    return ExitCode.OK


def _check_local_paths(args: argparse.Namespace) -> None:
    """The command line's own paths and URLs, in their canonical form (base/locations.py; config paths:
    config.check_paths): eval/export --checkpoint and pack's --out and --verify may be URLs (tools/pack.py
    checks those), every other one is local."""
    urls = ("checkpoint", "out", "verify") if args.command == "pack" else ("checkpoint",)
    for flag in ("checkpoint", "out", "verify", "keep", "config"):
        value = getattr(args, flag, None)
        if isinstance(value, str):
            setattr(args, flag, canonical(value, f"--{flag}"))
            check_location(getattr(args, flag), f"--{flag}", flag in urls)
    if getattr(args, "runs", None):
        args.runs = [canonical(run_dir, "RUN_DIR") for run_dir in args.runs]
        for run_dir in args.runs:
            check_location(run_dir, "RUN_DIR", urls=False)


def entry() -> NoReturn:
    """The `multicard` program: the installed command (pyproject's console script) and `python -m
    multicard` both run this, the command line in a process that then ends as exits.run_to_the_end
    says (nothing the user's code left running keeps it alive or outlives it)."""
    run_to_the_end(main)


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: this process's) in this process; its exit code. A
    script `multicard run` runs here runs as under `python SCRIPT`: what it raises is its own
    (run_to_the_end reports it as python would, through multicard.Run's hook if it made a Run)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    die_with_launcher(detect_env())
    try:
        _check_local_paths(args)
        commands_by_name = {
            "train": _train, "eval": _eval, "export": _export, "report": _report, "bench": _bench, "verify": _verify,
            "plan": _plan, "pack": _pack, "input-split": _input_split,
        }  # fmt: skip
        if args.command == "run":
            script = _script(args)
            options = _launch_options(args, detect_env())
            if options is not None:
                return _run_workers(args, options)
        elif args.command == "train" and not detect_env().launched:
            with BeforeTraining():  # a stop signal in start-up is one line too (a worker's launcher says it)
                return _train(args)
        else:
            return commands_by_name[args.command](args)
    except (MulticardError, KeyboardInterrupt, RuntimeError) as exc:
        code = report_error(exc)
        if code is None:
            raise  # a bug: the traceback is shown (exit 1)
        return code
    run_script(script, args.args)
    return ExitCode.OK
