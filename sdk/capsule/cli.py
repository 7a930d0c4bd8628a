"""`capsule` command line: demo | doctor | bench | memory | pull | push | inspect | verify | repair. Parsing and
dispatch only.

Each command imports what it runs (capsule.tools.*) inside itself, so `capsule --version`
and `import capsule.cli` load none of them.
"""
from __future__ import annotations

import argparse
import platform
import sys
from typing import Sequence

from ._version import __version__
from .errors import CapsuleError


def _version_line() -> str:
    import torch

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return f"capsule {__version__} (torch {torch.__version__}{cuda}, python {platform.python_version()})"


def _cmd_demo(args: argparse.Namespace) -> int:
    from .tools.demo import run_demo

    run_demo(model=args.model, tokenizer=args.tokenizer, device=args.device, store=args.store)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .tools.doctor import cpu_works, format_checks, run_checks

    print(f"{_version_line()}\nchecking backends with a tiny real inference each ...", flush=True)
    checks = run_checks(debug=args.debug)
    print(format_checks(checks))
    return 0 if cpu_works(checks) else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench import BenchOptions, run_suite
    from .tools.bench.plots import draw_plots
    from .tools.bench.report import format_table
    from .tools.bench.run_all import parse_suites, run_suites

    try:
        names = parse_suites(args.suite)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    only = tuple(x.strip() for x in (args.only or "").split(",") if x.strip())
    opts = BenchOptions(model=args.model, device=args.device, quick=args.quick, steps=args.steps, only=only)
    print(f"bench {','.join(names)}: model {opts.model}, device {opts.device}{', quick' if opts.quick else ''}",
          flush=True)
    if args.suite and len(names) == 1:      # one suite: its tables here, its report and plots there
        run = run_suite(names[0], opts, args.out)
        for title, rows in run.result.tables.items():
            print(f"\n{title}\n{format_table(rows, markdown=False)}")
        drawn = [n for n, st in draw_plots({names[0]: run.result.results}, run.json_path.parent).items()
                 if st == "ok"]
        print(f"\nwrote {run.json_path} and {run.md_path.name}" + (f", {', '.join(drawn)}" if drawn else ""))
        return 0
    done = run_suites(names, opts, args.out)
    print(f"\nwrote {done.json_path}, {done.md_path.name} and the plots in {done.out_dir}"
          + (f"; FAILED: {', '.join(done.failed)}" if done.failed else ""))
    return 1 if done.failed else 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools.store_report import inspect_report, read_sign_key

    if args.store.startswith("s3://"):
        from .tools.fleet_cli import inspect_remote

        ok, report = inspect_remote(args.store, args.fleet_key_file)
        print(report)
        return 0 if ok else 1

    ok, report = inspect_report(args.store, *read_sign_key(args.sign_key_file))
    print(report)
    return 0 if ok else 1   # an epoch that cannot be read was listed with why


def _cmd_verify(args: argparse.Namespace) -> int:
    from .tools.store_report import read_sign_key, verify_store

    ok, report = verify_store(args.store, *read_sign_key(args.sign_key_file))
    print(report)
    return 0 if ok else 1


def _cmd_repair(args: argparse.Namespace) -> int:
    from .tools.store_report import read_sign_key
    from .tools.repair import repair_store

    print(repair_store(args.store, *read_sign_key(args.sign_key_file)))
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from .tools.fleet_cli import run_pull
    from .tools.store_report import read_sign_key

    print(run_pull(args.url, args.store, args.epoch, args.fleet_key_file, read_sign_key(args.sign_key_file)[0]))
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from .tools.fleet_cli import run_push
    from .tools.store_report import read_sign_key

    print(run_push(args.store, args.url, args.fleet_key_file, read_sign_key(args.sign_key_file)[0]))
    return 0


def _cmd_memory_reencode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .session import Session

    store = Path(args.store)
    try:
        if not (store / "index.sqlite").exists() and not (store / "segments").exists():
            raise ValueError(f"{args.store!r} is not a capsule store folder")
        runtime = {"dtype": args.dtype} if args.dtype else None
        # restore=False: only the facts are touched, not the streams (they may be another model's)
        with Session.open(store, model=args.model, device=args.device, runtime=runtime, restore=False,
                          memory={"embedder": None}) as s:
            total = s.memory.count()
            with tqdm(total=total, desc="re-encode", unit="fact", leave=False,
                      disable=None if total > 200 else True) as bar:
                n, failed = s.memory.reencode(progress=lambda i: bar.update(i - bar.n))
    except (CapsuleError, ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1   # as the other subcommands (2 is for usage errors)
    print(f"re-encoded {n} of {total} fact(s) for {args.model} (stored under another model or damaged)")
    for fid, why in failed:
        print(f"fact {fid}: not re-encoded: {why}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the verb; SUPPRESS keeps a subcommand from resetting it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks instead of one-line errors")
    parser = argparse.ArgumentParser(prog="capsule", parents=[common],
                                     description="Execution-state capsules for edge robots.")
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", parents=[common], help="short end-to-end run with timings")
    demo.add_argument("--model", default="smollm2-135m",
                      help="smollm2-135m (trained, the default), a .gguf file, a checkpoint folder or builtin:<preset>")
    demo.add_argument("--tokenizer", default=None,
                      help="family name or tokenizer file (default: the model's own, cl100k_base for builtin)")
    demo.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name / YAML")
    demo.add_argument("--store", default=None, help="keep the store here (default: a temp folder, deleted)")
    demo.set_defaults(func=_cmd_demo)

    doctor = sub.add_parser("doctor", parents=[common], help="which backends work here (runs a tiny inference each)")
    doctor.set_defaults(func=_cmd_doctor)

    bench = sub.add_parser("bench", parents=[common], help="run benchmark suites (all of them by default)")
    bench.add_argument("--suite", default=None, metavar="NAME,...",
                       help="suites to run, comma-separated, from: decode, capsules, tokenize, tokenize-diff, tokenize-tails, "
                            "tokenize-bpe, memory, control, fleet, reliability (default: all these, one "
                            "report with plots), peers (capsule vs llama.cpp; only when named: its "
                            "first run builds llama.cpp)")
    bench.add_argument("--model", default="builtin:small", help="builtin:<preset> or a checkpoint folder")
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name / YAML")
    bench.add_argument("--out", default=None,
                       help="output folder (default bench-results/<time>/, or bench-results/<suite>-<time>/ for one suite)")
    bench.add_argument("--quick", action="store_true",
                       help="fewer sizes and steps (every suite: about 3 minutes on a 2-core CPU)")
    bench.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    bench.add_argument("--only", default=None, metavar="SECTION,...",
                       help="run only these sections of a suite that has them (memory: ttft, decode, "
                            "recall, deviation, accuracy)")
    bench.set_defaults(func=_cmd_bench)

    memory = sub.add_parser("memory", parents=[common], help="manage a store's persistent memory facts")
    memory_sub = memory.add_subparsers(dest="memory_command", metavar="ACTION", required=True)
    reencode = memory_sub.add_parser("reencode", parents=[common],
                                     help="re-encode facts stored under another model (or rope), or whose "
                                          "K/V record is damaged, for this model")
    reencode.add_argument("store", help="store folder")
    reencode.add_argument("--model", required=True,
                          help="the model the facts are for: builtin:<preset> or a checkpoint folder")
    reencode.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name / YAML")
    reencode.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                          help="the sessions' runtime dtype (default: the device profile's); K/V is "
                               "encoded in it")
    reencode.set_defaults(func=_cmd_memory_reencode)

    fleet_key = ("a replica's fleet key: a file (chmod 600) holding its raw bytes (default: "
                 "$CAPSULE_FLEET_KEY_FILE)")
    store_key = "the local store's own signing key file (default: $CAPSULE_SIGN_KEY_FILE)"
    pull_p = sub.add_parser("pull", parents=[common], help="copy a replica's newest (or a named) epoch into a "
                                                           "new store; Session.open on it restores it")
    pull_p.add_argument("url", help="s3://bucket/prefix (endpoint and keys: the AWS_* variables)")
    pull_p.add_argument("store", help="the new store folder (must hold no epoch)")
    pull_p.add_argument("--epoch", default=None, help="an epoch id or name (default: the newest)")
    pull_p.add_argument("--fleet-key-file", metavar="PATH", default=None, help=fleet_key)
    pull_p.add_argument("--sign-key-file", metavar="PATH", default=None, help=store_key)
    pull_p.set_defaults(func=_cmd_pull)
    push_p = sub.add_parser("push", parents=[common], help="copy a store's epochs the replica lacks (one-off backup)")
    push_p.add_argument("store", help="store folder (not open in another process)")
    push_p.add_argument("url", help="s3://bucket/prefix (endpoint and keys: the AWS_* variables)")
    push_p.add_argument("--fleet-key-file", metavar="PATH", default=None, help=fleet_key)
    push_p.add_argument("--sign-key-file", metavar="PATH", default=None, help=store_key)
    push_p.set_defaults(func=_cmd_push)

    for verb, what, func in (("inspect", "list a store's (or an s3:// replica's) epochs, sizes, fingerprints "
                                         "and streams", _cmd_inspect),
                             ("verify", "read and check every record (exit 1 on damage)", _cmd_verify),
                             ("repair", "rebuild the store's index from its segment log (the old index is "
                                        "kept in quarantine/)", _cmd_repair)):
        p = sub.add_parser(verb, parents=[common], help=what)
        p.add_argument("store", help="store folder" + (" or s3://bucket/prefix" if verb == "inspect" else ""))
        p.add_argument("--sign-key-file", metavar="PATH", default=None,
                       help="a signed store's key: a file (chmod 600) holding the key's raw bytes "
                            "(default: $CAPSULE_SIGN_KEY_FILE)")
        if verb == "inspect":
            p.add_argument("--fleet-key-file", metavar="PATH", default=None, help=fleet_key)
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and usage errors; return the status instead
        return exc.code if isinstance(exc.code, int) else 0
    args.debug = getattr(args, "debug", False)
    if args.version:
        print(_version_line())
        return 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except (CapsuleError, ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
