"""The `bapo` command line: bapo train | bapo runs [show RUN] | bapo tasks."""
from __future__ import annotations

import argparse
import logging
import sys


def cmd_train(args) -> int:
    from bapo_vl.config import load_config
    from bapo_vl.train import train

    cfg = load_config(args.preset, args.config, args.overrides)
    run_dir = train(cfg, quiet=args.quiet)
    print(f"run record: {run_dir / 'run.db'}\nfinal policy: {run_dir / 'final'}\n"
          f"inspect: bapo runs show {run_dir}")
    return 0


def cmd_runs(args) -> int:
    from bapo_vl.runs_cli import cmd_runs_list, cmd_runs_show

    if args.action == "show":
        if not args.run:
            print("bapo runs show RUN: name a run (a directory or a name under --root)", file=sys.stderr)
            return 2
        return cmd_runs_show(args.run, root=args.root, as_json=args.json)
    return cmd_runs_list(args.root)


def cmd_tasks(args) -> int:
    from bapo_vl.plugins import discover

    tasks, errors = discover(args.tasks_dir)
    for name, task in sorted(tasks.items()):
        print(f"{name:16s} {task.origin}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bapo", description="BAPO: off-policy RLVR with batch adaptation")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy (default: the tiny countdown preset on CPU)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. algo=grpo steps=50")
    p.add_argument("--preset", default=None, help="tiny (default) | countdown | math | geometry3k")
    p.add_argument("--config", default=None, help="a YAML file of config fields")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("runs", help="list runs, or show one")
    p.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    p.add_argument("run", nargs="?")
    p.add_argument("--root", default="runs")
    p.add_argument("--json", action="store_true", help="print the run as one JSON object (stable interface)")
    p.set_defaults(fn=cmd_runs)
    p = sub.add_parser("tasks", help="list task plugins and where they came from")
    p.add_argument("--tasks-dir", action="append", default=[])
    p.set_defaults(fn=cmd_tasks)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"bapo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
