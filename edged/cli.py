"""The ``edged`` command line: parse arguments, then hand over to the module that does the work.

Exit codes: 0 success, 78 (EX_CONFIG) for a config, model or contract the daemon must not run
with (systemd does not restart on it), 1 for anything else.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edged import __version__
from edged.config import DEFAULT_CONFIG_PATH, ConfigError, Settings, load_config
from edged.service import EXIT_CONFIG, setup_logging

log = logging.getLogger("edged")


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=DEFAULT_CONFIG_PATH, metavar="PATH",
                   help=f"TOML config file (default {DEFAULT_CONFIG_PATH}); EDGED_* variables override it")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edged", description="Embedded vision daemon: camera -> ONNX Runtime -> detections over ZeroMQ.")
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon", description=(
        "Run the daemon: capture frames, detect, publish over ZeroMQ until SIGTERM. "
        "SIGHUP reloads the config (a bad one is logged and the running one kept). "
        "Exit 0 on a clean stop, 78 on a config/model/contract error, 1 otherwise."))
    _config_arg(run)

    check = sub.add_parser("check", help="check config, model, contract and provider placement",
                           description="Load the config and model exactly as `run` would, check the layout "
                           "contract and report which execution provider each node runs on. Exit 0 when "
                           "all is well, 78 with the reasons otherwise.")
    _config_arg(check)

    subscribe = sub.add_parser("subscribe", help="print detections from a running edged",
                               description="Connect to an edged PUB endpoint and print what arrives.")
    subscribe.add_argument("endpoint", help="e.g. tcp://127.0.0.1:5556 or ipc:///run/edged/detections.sock")
    subscribe.add_argument("--topic", default="", help="topic prefix to subscribe to (default: everything)")
    subscribe.add_argument("--stats", action="store_true", help="print a rolling summary instead of messages")
    subscribe.add_argument("--json", action="store_true", help="print each message as JSON")
    subscribe.add_argument("--count", type=int, default=None, help="exit after this many messages")
    subscribe.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")

    schema = sub.add_parser("schema", help="print the JSON Schema of published messages",
                            description="Print the JSON Schema generated from the message models.")
    schema.add_argument("--out", type=Path, default=None, help="write to this file instead of stdout")

    thermal = sub.add_parser("thermal", help="print thermal readings and state",
                             description="Read thermal zones, cpufreq caps and throttling flags once "
                             "(or repeatedly with --watch) and print them with the resulting state.")
    _config_arg(thermal)
    thermal.add_argument("--watch", action="store_true", help="keep printing every poll interval")
    thermal.add_argument("--interval", type=float, default=None, help="seconds between readings")
    thermal.add_argument("--root", type=Path, default=None, help="read this tree instead of /")
    return parser


def _load(path: Path) -> Settings | None:
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"edged: configuration error: {e}", file=sys.stderr)
        return None


def _cmd_run(args: argparse.Namespace) -> int:
    settings = _load(args.config)
    if settings is None:
        return EXIT_CONFIG
    setup_logging(settings.service.log_level)
    from edged.daemon import run

    return run(args.config, settings)


def _cmd_check(args: argparse.Namespace) -> int:
    settings = _load(args.config)
    if settings is None:
        return EXIT_CONFIG
    setup_logging("warning")
    from edged.check import run_check

    return run_check(args.config, settings)


def _cmd_subscribe(args: argparse.Namespace) -> int:
    from edged.subscribe import run_subscribe

    return run_subscribe(args.endpoint, args.topic, stats=args.stats, raw_json=args.json,
                         count=args.count, timeout_s=args.timeout)


def _cmd_schema(args: argparse.Namespace) -> int:
    from edged.messages import schema_text

    if args.out:
        args.out.write_text(schema_text())
    else:
        sys.stdout.write(schema_text())
    return 0


def _cmd_thermal(args: argparse.Namespace) -> int:
    from edged.config import ThermalConfig
    from edged.thermal import run_thermal_command

    cfg = ThermalConfig()
    if args.config.is_file():
        settings = _load(args.config)
        if settings is None:
            return EXIT_CONFIG
        cfg = settings.thermal
    if args.root is not None:
        cfg = cfg.model_copy(update={"root": args.root})
    setup_logging("warning")
    return run_thermal_command(cfg, watch=args.watch, interval_s=args.interval)


COMMANDS = {
    "run": _cmd_run,
    "check": _cmd_check,
    "subscribe": _cmd_subscribe,
    "schema": _cmd_schema,
    "thermal": _cmd_thermal,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
