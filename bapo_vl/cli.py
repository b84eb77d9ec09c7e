"""The `bapo` command line: bapo train | bapo runs [show RUN | upgrade RUN] | bapo tasks | bapo eval MODEL.

A bad input (config key, file, run, task, model) ends the command with one line, `bapo: ...`, naming the item and
what to do, exit code 2; a failure while it runs (a full disk) with one line and exit code 1. --debug adds the
traceback."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import traceback

from bapo_vl.plugins import PluginError

# What bad input raises (the project's own ConfigError, RunLockedError, ... are ValueErrors): exit code 2.
INPUT_ERRORS = (ValueError, KeyError, FileNotFoundError, PluginError)


def cmd_train(args) -> int:
    # imports no torch: a bad setting is reported before torch loads
    from bapo_vl.config import launcher, load_config, resume_config

    resume = [o.partition("=")[2] for o in args.overrides if o.partition("=")[0].strip() == "resume"]
    if resume:  # a resumed run takes its recorded config; presets and files would silently change it
        if args.preset or args.config:
            raise ValueError("resume=RUN_DIR continues with the run's recorded config: drop --preset/--config")
        cfg = resume_config(resume[-1], [o for o in args.overrides if o.partition("=")[0].strip() != "resume"])
    else:
        cfg = load_config(args.preset, args.config, args.overrides)
    cfg.run.tasks_dirs = [*cfg.run.tasks_dirs, *_tasks_dirs(args)]  # --tasks-dir
    run_dir = launcher(cfg.run.backend)(cfg, quiet=args.quiet)  # backend=embedded: bapo_vl.train.train
    from bapo_vl.train import learning_summary

    print(learning_summary(run_dir))
    final = run_dir / "final"
    print(f"run record: {run_dir / 'run.db'}\nfinal policy: {final if final.is_dir() else 'none (save_every=-1)'}\n"
          f"inspect: bapo runs show {run_dir}")
    return 0


class ConfigHelp(argparse.Action):
    """`bapo train -h`: the usual help, then every Config field with its default and doc (config.config_help).
    Built only when asked: reading every field's doc is work the other commands need not do."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from bapo_vl.config import config_help

        parser.epilog = config_help()
        parser.print_help()
        parser.exit()


def cmd_runs(args) -> int:
    from bapo_vl.runs_cli import cmd_runs_list, cmd_runs_show, cmd_runs_upgrade

    if args.action in ("show", "upgrade"):
        if not args.run:
            print(f"bapo runs {args.action} RUN: name a run (a directory or a name under --root)", file=sys.stderr)
            return 2
        if args.action == "upgrade":
            return cmd_runs_upgrade(args.run, root=args.root)
        return cmd_runs_show(args.run, root=args.root, as_json=args.json)
    return cmd_runs_list(args.root)


def _tasks_dirs(args) -> list[str]:
    """The global --tasks-dir folders and those given after the subcommand."""
    return [*args.tasks_dirs, *getattr(args, "sub_tasks_dirs", [])]


def cmd_tasks(args) -> int:
    from bapo_vl.plugins import discover

    tasks, errors = discover(_tasks_dirs(args))
    rows = [("name", "eval splits", "origin")]
    rows += [(name, ", ".join(t.eval_splits) or "-", t.origin) for name, t in sorted(tasks.items())]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, splits, origin in rows:
        print(f"{name:{width[0]}s}  {splits:{width[1]}s}  {origin}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        print(f"{len(errors)} broken task plugin(s)", file=sys.stderr)
    return 1 if errors else 0


def cmd_compare(args) -> int:
    from bapo_vl.compare import cmd_compare as run

    return run(args.start, args.entry, args.baseline, args.resamples, args.json, args.out)


def cmd_eval(args) -> int:
    import yaml

    from bapo_vl.evaluate import FIELDS, EvalOptions, cmd_eval as run

    options = {}
    for item in args.option:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--option {item!r} is not key=value")
        options[key.strip()] = yaml.safe_load(text)
    given = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    given.update(options=options, tasks_dirs=_tasks_dirs(args),
                 splits=[s.strip() for s in args.splits.split(",") if s.strip()] if args.splits else None)
    return run(EvalOptions(**given), as_json=args.json, out=args.out)


def check_port(host: str, port: int | None) -> None:
    """The dashboard's --port, checked before Gradio loads: a number a port can be, and free on --host (Gradio
    would answer a port in use with advice about its own environment variable)."""
    if port is None:
        return
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is a number from 1 to 65535; choose one, or leave --port out "
                         "(7860, or the next free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        raise ValueError(f"--host {host}: not an address this machine has; give one, e.g. 127.0.0.1") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: a closed port counts as free
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror.lower()}); choose another "
                             "--port, or leave it out (7860, or the next free port)") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bapo", description="BAPO: off-policy RLVR with batch adaptation")
    debug_help = "on an error, print the traceback too (default: one line naming what to fix)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--tasks-dir", dest="tasks_dirs", action="append", default=[], metavar="DIR",
                        help="an extra folder of task plugins (repeatable; train adds it to tasks_dirs)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy (default: the tiny countdown preset on CPU)", add_help=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action=ConfigHelp, help="show this help and every config field, then exit")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. algo=grpo steps=50")
    p.add_argument("--preset", default=None, help="tiny (default) | countdown | math | geometry3k; on the verl "
                   "backend: verl_tiny | verl_countdown | verl_math | verl_geometry3k (bapo_vl/presets/)")
    p.add_argument("--config", default=None, help="a YAML file of config fields")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--tasks-dir", dest="sub_tasks_dirs", action="append", default=[], metavar="DIR",
                   help="an extra folder of task plugins (repeatable), added to tasks_dirs")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("runs", help="list runs, show one, or upgrade an old run record in place")
    p.add_argument("action", nargs="?", choices=["list", "show", "upgrade"], default="list")
    p.add_argument("run", nargs="?")
    p.add_argument("--root", default="runs")
    p.add_argument("--json", action="store_true", help="print the run as one JSON object (stable interface)")
    p.set_defaults(fn=cmd_runs)
    p = sub.add_parser("tasks", help="list task plugins: name, eval splits, origin, and the broken ones")
    p.add_argument("--tasks-dir", dest="sub_tasks_dirs", action="append", default=[], metavar="DIR",
                   help="an extra folder of task plugins (repeatable)")
    p.set_defaults(fn=cmd_tasks)
    p = sub.add_parser("eval", help="evaluate a policy on a task's evaluation sets: mean@k, pass@k, verdicts")
    p.add_argument("model", help="hub id, local path, bundled policy, run directory (its final/), or RUN/checkpoints/step_N")
    p.add_argument("--task", help="task plugin (default: the run's task)")
    p.add_argument("--splits", help="comma-separated sets, e.g. cd34,cd4 (default: the task's EVAL_SPLITS)")
    p.add_argument("--checkpoint", type=int, metavar="N", help="with a run directory: checkpoints/step_N, not final/")
    p.add_argument("--source", help="data file or folder, passed to the task's load()")
    p.add_argument("--template", help="prompt template, passed to load() (default: the run's, or that of "
                   "the preset that trains the model on the task)")
    p.add_argument("--limit", type=int, metavar="N", help="first N problems of each set")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="another load() option")
    p.add_argument("--k", type=int, help="samples per problem (default 8)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1.0; 0 = greedy, needs --k 1)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="default: the run's (or that preset's) "
                   "max_response_length, within the model's positions")
    p.add_argument("--batch-size", type=int, metavar="N", help="sequences per generate call")
    p.add_argument("--device", help="auto (default) | cpu | cuda")
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument("--run", metavar="RUN_DIR", help="also record the results in this run's evals table")
    p.add_argument("--step", type=int, help="step to record them at (default: the checkpoint's, else the last)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--against", metavar="FILE", help="an earlier --out JSON of the same problems: also print this "
                   "evaluation minus it, mean@k paired by problem, with a 95 %% bootstrap interval")
    p.add_argument("--tasks-dir", dest="sub_tasks_dirs", action="append", default=[], metavar="DIR")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("compare", help="compare policies by their `bapo eval --out` files: intervals over seeds and "
                       "problems, gains over the start policy, differences from a baseline entry")
    p.add_argument("start", help="the start policy's `bapo eval --out` file")
    p.add_argument("--entry", action="append", default=[], metavar="NAME=FILE[,FILE...]",
                   help="one method: its evaluation files, one per training seed, in seed order (repeatable)")
    p.add_argument("--baseline", help="the entry the others are compared with, paired by seed and problem")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", metavar="FILE", help="also write the JSON object to FILE")
    p.set_defaults(fn=cmd_compare)
    from bapo_vl.app.cli import add_parser as add_dashboard_parser  # imports no gradio until it runs

    add_dashboard_parser(sub)
    for p in sub.choices.values():  # SUPPRESS: `bapo --debug train` is not undone by the subcommand's default
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    args, extra = parser.parse_known_args(argv)
    if args.command == "train" and not any(x.startswith("-") for x in extra):
        args.overrides += extra  # key=value after an option (`--config c.yaml steps=5`): argparse leaves it over
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "dashboard":
            check_port(args.host, args.port)
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head`) is handled below
        return code
    except BrokenPipeError:  # the reader of our output left (`--json | head`): nothing to say, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
        return 141  # as a tool stopped by SIGPIPE
    except KeyboardInterrupt:
        print("bapo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback with --debug
        from bapo_vl.config import one_line  # here: `bapo --help` does not import torch

        code = 2 if isinstance(e, INPUT_ERRORS) else 1
        if args.debug:
            traceback.print_exc()
        # the project's own errors say all in their message; another library's needs its class (OSError: ...)
        own = type(e).__module__.startswith("bapo_vl")
        hint = "" if code == 2 or args.debug else " (--debug shows the traceback)"
        print(f"bapo: {one_line(e, with_type=code == 1 and not own)}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
