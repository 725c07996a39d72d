"""``python -m tensorscope``: run, report, install-kernel, diverge, repro, summary, export, sql, env and build-native from a shell.

The headless commands live one per module in ``tensorscope/cli/``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorscope", description="tensorscope: traces of PyTorch programs")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="print the summary of a saved trace or a dataset (run --out)")
    s.add_argument("path")
    from .options import DisplayOptions, add_to_parser

    add_to_parser(s, (DisplayOptions,))
    e = sub.add_parser("export", help="export a saved trace or a dataset")
    e.add_argument("path")
    e.add_argument("--perfetto", metavar="OUT", required=True, help="write Chrome/Perfetto trace-event JSON here")
    q = sub.add_parser("sql", help="run a DuckDB query over a saved trace's or a dataset's tables")
    q.add_argument("path")
    q.add_argument("query")
    sub.add_parser("env", help="torch/CUDA/cuDNN versions, GPUs, arch support, TF32/bf16 settings")
    b = sub.add_parser("build-native", help="build the native C++ hooks now (cached)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    from .cli import diverge, kernel, report, repro, run

    run.add_parser(sub)
    report.add_parser(sub)
    kernel.add_parser(sub)
    diverge.add_parser(sub)
    repro.add_parser(sub)
    return p


def _split_run(argv: list[str]):
    """``run [options] target [script args]``: everything after the target belongs to the script
    (argparse would otherwise take a script's ``--out`` or ``-o`` for ours)."""
    for i, a in enumerate(argv[1:], 1):
        if a.endswith((".py", ".ipynb")) and argv[i - 1] not in ("--out", "-o", "--dataset", "--spill-dir", "--kernel"):
            return argv[:i + 1], argv[i + 1:]
    return argv, []


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build-native"]:
        # Its options (--force, --status ...) belong to build_native_main's own parser;
        # argparse.REMAINDER does not capture options that come first.
        from .native import build_native_main

        return int(build_native_main(argv[1:]) or 0)
    script_args = []
    if argv[:1] == ["run"]:
        argv, script_args = _split_run(argv)
    args = _parser().parse_args(argv)
    from .errors import TensorscopeError

    try:
        if args.cmd == "run":
            from .cli import run

            args.args = list(args.args or []) + script_args
            return run.main(args)
        if args.cmd == "report":
            from .cli import report

            return report.main(args)
        if args.cmd == "diverge":
            from .cli import diverge

            return diverge.main(args)
        if args.cmd == "repro":
            from .cli import repro

            return repro.main(args)
        if args.cmd == "install-kernel":
            from .cli import kernel

            return kernel.main(args)
        if args.cmd == "build-native":
            from .native import build_native_main

            return int(build_native_main(args.rest) or 0)
        if args.cmd == "env":
            from ._env import env

            print(env())
            return 0
        from .io.parquet import METADATA_FILE

        if not os.path.isfile(os.path.join(args.path, METADATA_FILE)) and _is_dataset(args.path):
            return _dataset_command(args)
        from ._trace import load

        t = load(args.path)
        if args.cmd == "summary":
            from .options import parse_namespace

            print(t.summary(parse_namespace(args)[1]).to_text())
        else:
            _export_or_sql(t, args)
        return 0
    except TensorscopeError as e:
        print(f"tensorscope: {e}", file=sys.stderr)
        return 2


def _is_dataset(path: str) -> bool:
    from .io.dataset import has_parts

    return os.path.isdir(path) and (has_parts(path, "ranks") or has_parts(path, "ops"))


def _dataset_command(args: argparse.Namespace) -> int:
    """summary, sql and export of a dataset (``run --out``, ``trace(dataset=)``): the dataset's summary,
    preceded by its trace's own when it holds one trace (a script run headless); SQL over every run
    and rank; Perfetto of its latest run."""
    from ._dataset import open_dataset

    with open_dataset(args.path) as ds:
        if args.cmd == "summary":
            from .options import parse_namespace

            keys = ds.sql("select distinct run, rank, trace_id from ranks").to_dict("records")
            if len(keys) == 1:
                k = keys[0]
                t = ds.trace(int(k["rank"]), k["run"], trace_id=int(k["trace_id"]))
                print(t.summary(parse_namespace(args)[1]).to_text())
            print(ds.summary().to_text())
            if len(keys) > 1:
                print(f"  note: {len(keys)} traces; one of them: tensorscope.open_dataset({args.path!r})"
                      ".trace(rank=R, run=ID, trace_id=N).summary()")
        else:
            _export_or_sql(ds, args)
    return 0


def _export_or_sql(source: Any, args: argparse.Namespace) -> None:
    """``export`` and ``sql`` of a Trace or a Dataset (both have ``to_perfetto`` and ``sql``)."""
    if args.cmd == "export":
        print(source.to_perfetto(args.perfetto))
    else:
        import pandas as pd

        with pd.option_context("display.width", 200, "display.max_columns", 50):
            print(source.sql(args.query).to_string(index=False))


if __name__ == "__main__":
    sys.exit(main())
