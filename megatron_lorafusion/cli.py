"""The `lorafusion` command: a thin dispatcher over the subpackages.

    lorafusion --version
    lorafusion validate JOB.yaml [section.key=value ...] [--print]   (--print: resolved YAML)
    lorafusion train JOB.yaml [section.key=value ...]
    lorafusion serve SERVER.yaml [section.key=value ...]   (jobs join and leave; see submit)
    lorafusion submit --server ROOT JOB.yaml           (queue a job's adapters; prints ids)
    lorafusion status --server ROOT                    (every job: status, step, loss, ETA)
    lorafusion cancel --server ROOT NAME               (checkpoint, export, free its row)
    lorafusion synth-data --out-dir DIR [--tasks reverse sort add upper] [--num N]
    lorafusion export RUN_DIR|CHECKPOINT --out DIR [--merge] [--adapters NAME ...]
    lorafusion report RUN_DIR [--png FILE]             (per-adapter table, loss curves)
    lorafusion plan --lengths xsum --adapters 4 ...     (write and summarise a plan)
    lorafusion plan --job JOB.yaml [section.key=value ...]   (the job's real samples)
    lorafusion simulate --lengths mix --stages 4 ...    (bubble ratios of three schedules, PNG)
    lorafusion simulate --job JOB.yaml [section.key=value ...]

Bad input (config, data) prints every problem and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_lorafusion.config import ConfigError, JobConfig, load_config
from megatron_lorafusion.lifetime import StopSignals, Terminated

if TYPE_CHECKING:
    from megatron_lorafusion.sim.commands import PlanRequest


def _version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron_lorafusion")
    except PackageNotFoundError:  # run from a source tree that was never installed
        import megatron_lorafusion

        return getattr(megatron_lorafusion, "__version__", "unknown")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafusion", description="Fine-tune many LoRA adapters at once on one frozen model."
    )
    parser.add_argument("--version", action="version", version=f"megatron_lorafusion {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("validate", "check a job file and report every problem"),
        ("train", "train the job's adapters together"),
        ("serve", "run a long-running trainer that jobs join and leave (server section)"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("config", help="YAML job file")
        cmd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
        cmd.add_argument(
            "--verbose",
            action="store_true",
            help="show third-party warnings and logs, on every rank",
        )
        if name == "validate":
            cmd.add_argument(
                "--print",
                action="store_true",
                dest="print_job",
                help="print the resolved job (every default, presets expanded, "
                "paths resolved) as YAML that train accepts unchanged",
            )
    submit = sub.add_parser("submit", help="queue a job's adapters on a server")
    submit.add_argument("--server", required=True, help="the server's root (server.root)")
    submit.add_argument("job", help="YAML with adapters:, each with its own steps or epochs")
    status = sub.add_parser("status", help="every job of a server: status, step, loss, ETA")
    status.add_argument("--server", required=True, help="the server's root (server.root)")
    cancel = sub.add_parser("cancel", help="stop a server's job: checkpoint, export, free it")
    cancel.add_argument("--server", required=True, help="the server's root (server.root)")
    cancel.add_argument("name", help="the job's name")
    report = sub.add_parser("report", help="per-adapter summary and loss curves of a run")
    report.add_argument("run", help="run folder (train.output_dir, with metrics.jsonl)")
    report.add_argument("--png", help="curves PNG (default: RUN/curves.png)")
    synth = sub.add_parser("synth-data", help="write the synthetic demo tasks as JSONL")
    synth.add_argument("--out-dir", required=True, help="folder for <task>.jsonl files")
    synth.add_argument("--tasks", nargs="+", default=["reverse", "sort", "add", "upper"])
    synth.add_argument("--num", type=int, default=2000, help="rows per task")
    synth.add_argument("--seed", type=int, default=0)
    export = sub.add_parser(
        "export",
        help="write a run's adapters as PEFT folders",
        description="Write each adapter of a run (its export if it is done, else its newest "
        "complete checkpoint), or one checkpoint, as a PEFT folder.",
    )
    export.add_argument("source", help="run folder (train.output_dir) or checkpoint folder")
    export.add_argument("--out", required=True, help="folder for <adapter>/ (and -merged/)")
    export.add_argument(
        "--merge",
        action="store_true",
        help="also merge each adapter into the Hugging Face base weights",
    )
    export.add_argument("--adapters", nargs="+", help="adapter names (default: all)")
    export.add_argument(
        "--checkpoint",
        help="one checkpoint folder of an adapter (checkpoints/<adapter>/step_<n>, under "
        "SOURCE or a path) instead of the run's newest",
    )
    from megatron_lorafusion.sim.commands import add_plan_arguments, add_simulate_arguments

    add_plan_arguments(sub.add_parser("plan", help="pack samples into a microbatch plan"))
    add_simulate_arguments(
        sub.add_parser(
            "simulate", help="simulate Megatron-style, mLoRA-style and our pipeline schedules"
        )
    )
    return parser


def _synth(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_lorafusion.data import write_task

    for task in args.tasks:
        try:
            path = write_task(task, Path(args.out_dir) / f"{task}.jsonl", args.num, args.seed)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.num} rows to {path}")
    return 0


def _resolved_yaml(cfg: JobConfig, source: str) -> str:
    """The resolved job as YAML; loading it gives ``cfg`` again."""
    import yaml

    header = (
        f"# The resolved job of {source!r}: every default filled in, presets expanded, local\n"
        "# input paths absolute (lorafusion validate --print). Run: lorafusion train THIS_FILE\n"
    )
    body = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True, width=100)
    return header + body


def _job_request(args: argparse.Namespace) -> PlanRequest:
    """``--job``'s problem: its datasets tokenised, split and ordered exactly as train does.

    Raises:
        ConfigError: on a bad job file (the problems validate names).
        DataError: on an unusable dataset.
    """
    from megatron_lorafusion.sim.commands import PlanRequest

    cfg = load_config(args.job, args.overrides)
    # train.main imports Megatron (its warnings hidden); our INFO lines would repeat the summary
    _quiet_start(False, "WARNING")
    from megatron_lorafusion.data import load_tokenizer
    from megatron_lorafusion.train.main import make_jobs, prepare_problem

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    problem = prepare_problem(cfg, make_jobs(cfg, cfg.adapters, tokenizer))
    names = tuple(a.name for a in cfg.adapters)
    return PlanRequest(
        problem, cfg.planner.solver, cfg.planner.time_limit_s, f"job {args.job}", None, names
    )


def _data_problems(cfg: JobConfig) -> list[str]:
    """What train would refuse in the job's data, from the first rows of each dataset."""
    from megatron_lorafusion.data import probe_job_datasets

    return probe_job_datasets(cfg)


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_lorafusion.train.metrics import read_metrics
    from megatron_lorafusion.train.report import format_table, plot_curves, summarize

    try:
        records = read_metrics(args.run)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(summarize(records)))
    png = plot_curves(records, Path(args.png) if args.png else Path(args.run) / "curves.png")
    print(f"wrote {png}")
    return 0


def _quiet_start(verbose: bool, level: str) -> None:
    """Our loggers at ``level`` on rank 0 only; third-party warnings and logs filtered.

    Megatron, torch and datasets warn at import and model build (no TE/Apex, deprecations,
    no CUDA runtime): a dozen lines per rank that say nothing about the job. ``--verbose``
    keeps everything.
    """
    import os
    import warnings

    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if verbose:
        logging.basicConfig(level=level, format=fmt)
        return
    import torch  # noqa: F401  (its import sets up torch's loggers and warning filters)

    warnings.filterwarnings("ignore", module=r"(megatron|torch|transformers|datasets|triton)\b")
    logging.basicConfig(level=logging.WARNING, format=fmt)
    # torch re-levels its own registered loggers later; a child's explicit level stays.
    for name in ("megatron", "torch", "torch.utils.cpp_extension", "datasets", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rank0 = os.environ.get("RANK", "0") == "0"  # torchrun's; a plain run is rank 0
    logging.getLogger("megatron_lorafusion").setLevel(level if rank0 else logging.ERROR)


def _export(args: argparse.Namespace) -> int:
    from megatron_lorafusion.train.export import export_checkpoint

    try:
        source = Path(args.source)
        if args.checkpoint is not None:  # a path, or one relative to the run folder
            named = Path(args.checkpoint)
            source = named if named.is_absolute() or named.exists() else source / named
        folders = export_checkpoint(source, args.out, merge=args.merge, names=args.adapters)
    except ValueError as err:  # ConfigError included: a job.json this version cannot read
        print(f"error: {err}", file=sys.stderr)
        return 2
    for folder in folders:
        print(f"wrote {folder}")
    return 0


def _server_files(args: argparse.Namespace) -> int:
    """``submit``, ``status`` and ``cancel``: files in the server's root, no torch."""
    from megatron_lorafusion.inbox import ServerRoot, submit_job

    if args.command == "submit":
        for name in submit_job(args.server, args.job):
            print(f"submitted {name}")
        return 0
    root = ServerRoot(args.server)
    if not root.root.is_dir():
        print(f"error: server root {args.server!r} does not exist", file=sys.stderr)
        return 2
    if args.command == "status":
        print(root.status_table())
        return 0
    try:
        was = root.cancel(args.name)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"cancel of {args.name} ({was}) requested: it stops at the server's next check")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; returns the process exit status.

    SIGINT and SIGTERM end it with one line and status 130 or 143, however often they come
    (`lifetime.StopSignals`; `__main__.run` installs it before the imports and catches an
    interrupt of the argument parsing).
    """
    args = _parser().parse_args(argv)
    stops = StopSignals.current()
    own = stops is None
    if stops is None:  # called as a function, not through __main__.run
        stops = StopSignals()
        stops.install()
    try:
        if args.command in ("submit", "status", "cancel"):
            return _server_files(args)
        if args.command == "synth-data":
            return _synth(args)
        if args.command == "export":
            return _export(args)
        if args.command == "report":
            return _report(args)
        if args.command in ("plan", "simulate"):
            from megatron_lorafusion.sim import commands

            run = commands.run_plan if args.command == "plan" else commands.run_simulate
            try:
                if problems := commands.job_argument_problems(args):
                    raise ValueError("; ".join(problems))
                return run(args, request=None if args.job is None else _job_request(args))
            except ValueError as err:  # bad lengths file or job, capacity below a sample, ...
                print(f"error: {err}", file=sys.stderr)
                return 2
        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":  # the launch is not known yet: train checks it
            if problems := _data_problems(cfg):
                print("\n".join(f"error: {q}" for q in problems), file=sys.stderr)
                return 2
            if args.print_job:
                print(_resolved_yaml(cfg, args.config), end="")
            else:
                print(f"{args.config}: valid ({len(cfg.adapters)} adapters)")
            return 0
        from megatron_lorafusion.validation import launch_problems

        if problems := launch_problems(cfg):  # the layout against this very launch
            raise ConfigError(problems)
        _quiet_start(args.verbose, cfg.logging.level)  # before Megatron is imported
        from megatron_lorafusion.data import DataError
        from megatron_lorafusion.inbox import ServerBusyError
        from megatron_lorafusion.train.checkpoint import CheckpointError
        from megatron_lorafusion.train.export import ExportError
        from megatron_lorafusion.train.main import JobsFailedError
        from megatron_lorafusion.train.main import main as train_main
        from megatron_lorafusion.train.writer import WriteError

        try:
            if args.command == "serve":
                from megatron_lorafusion.train.server import serve

                if cfg.server is None:
                    raise ConfigError(["server must be set (root, max_adapters, ...) to serve"])
                serve(cfg)
            elif cfg.server is not None:
                raise ConfigError(
                    ["server must be unset to train (it is a server's job file: lorafusion serve)"]
                )
            else:
                train_main(cfg)
        except (
            DataError,
            CheckpointError,
            ExportError,
            JobsFailedError,
            WriteError,
            ServerBusyError,
        ) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # one line, not a traceback; 128 + SIGINT or SIGTERM
        stops.done = True  # first: a signal now is ignored, never raised inside this handler
        terminated = isinstance(stop, Terminated)
        where = f" at {stop.args[0]}" if stop.args else ""  # train.main names the step
        print(
            f"{'terminated' if terminated else 'interrupted'}{where}: {args.command} stopped"
            + (
                "; rerun the same command to resume from its last checkpoint"
                if args.command in ("train", "serve")
                else ""
            ),
            file=sys.stderr,
        )
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        if own:
            stops.uninstall()
