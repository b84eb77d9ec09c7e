"""`bapo dashboard RUN_DIR...`: argument parsing for the web dashboard (the app itself is app/dashboard.py).

bapo_vl/cli.py wires it in with two lines:  `from bapo_vl.app.cli import add_parser as add_dashboard_parser`
and `add_dashboard_parser(sub)` next to the other subcommands; `cmd_dashboard` is set as the parser's `fn`.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
PASSWORD_ENV = "BAPO_DASHBOARD_PASSWORD"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dashboard", help="web dashboard over run records (live while training): bapo dashboard RUN_DIR...",
        description="Serve a Gradio dashboard over one or more run directories (or folders of runs). "
                    "Only the runs named here can be shown; it listens on 127.0.0.1 unless --host says otherwise.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run directory (with run.db) or a folder of runs")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only); another address, e.g. "
                        "0.0.0.0, exposes the runs to the network and needs --password or --no-password")
    p.add_argument("--port", type=int, default=None, help="port (default: Gradio's, 7860 or the next free one)")
    p.add_argument("--password", default=None,
                   help=f"require a login (user --user) with this password; or set ${PASSWORD_ENV}")
    p.add_argument("--user", default="bapo", help="login name with --password (default bapo)")
    p.add_argument("--no-password", action="store_true",
                   help="allow a non-local --host without a login (anyone who can reach the port sees the runs)")
    p.add_argument("--poll", type=float, default=3.0, metavar="SECONDS", help="how often the page polls the records")
    p.set_defaults(fn=cmd_dashboard)
    return p


def is_local(host: str) -> bool:
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_dashboard(args) -> int:
    password = args.password or os.environ.get(PASSWORD_ENV) or None
    if not is_local(args.host) and not password and not args.no_password:
        print(f"bapo dashboard: --host {args.host} serves the runs beyond this machine: add --password PASSWORD "
              f"(or ${PASSWORD_ENV}), or --no-password to serve them without a login", file=sys.stderr)
        return 2
    if args.poll <= 0:
        print("bapo dashboard: --poll must be > 0 seconds", file=sys.stderr)
        return 2
    from bapo_vl.app.dashboard import launch  # gradio is imported only for this command
    from bapo_vl.record import RecordVersionError

    try:
        launch(args.runs, host=args.host, port=args.port, password=password, user=args.user,
               poll_seconds=args.poll, block=True)
    except (FileNotFoundError, RecordVersionError) as e:  # RecordVersionError says how to upgrade the record
        print(f"bapo dashboard: {e}", file=sys.stderr)
        return 2
    return 0
