"""The ``zerolayer bench`` subcommand (and ``zerolayer bench compare A.json B.json``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerolayer.client.bench.endpoint import HTTP_PROTOCOLS, EndpointError
from zerolayer.client.bench.frames import TargetError
from zerolayer.client.bench.workload import WorkloadError

if TYPE_CHECKING:
    from zerolayer.client.bench.options import BenchOptions


def add_bench_subparser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="load-test a daemon or any OpenAI-compatible server and report latency/throughput",
        description="Load generator and report (docs/bench.md). "
        "`zerolayer bench compare A.json B.json` prints two reports side by side.",
    )
    a = bench.add_argument
    a(
        "--endpoint",
        default="tcp://127.0.0.1:7070",
        metavar="URL",
        help="tcp://H:P (frames) or http(s)://H:P",
    )
    a("--protocol", choices=HTTP_PROTOCOLS, default=None, help="API for an http(s) endpoint")
    a(
        "--model",
        default=None,
        metavar="NAME",
        help="model name for HTTP requests (default: GET /v1/models)",
    )
    load = bench.add_argument_group("load shape")
    load.add_argument(
        "--concurrency", type=int, default=None, metavar="N", help="closed loop: N in flight"
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="open loop: requests/s (Poisson)",
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, metavar="K", help="gamma shape (1 = Poisson)"
    )
    load.add_argument("--num-requests", type=int, default=None, metavar="N", help="default 100")
    load.add_argument(
        "--duration", type=float, default=None, metavar="S", help="seconds to send for"
    )
    load.add_argument(
        "--warmup", type=int, default=0, metavar="N", help="unmeasured requests first"
    )
    load.add_argument(
        "--seed", type=int, default=0, metavar="N", help="random prompts and arrival times"
    )
    load.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="N,N,...",
        help="comma list, e.g. 1,8,32,128: one run each",
    )
    inp = bench.add_argument_group("input")
    inp.add_argument("--input", default=None, metavar="FILE", help="JSONL or ShareGPT JSON file")
    inp.add_argument(
        "--dataset", choices=("random",), default="random", help="without --input (default)"
    )
    inp.add_argument(
        "--input-len", default="128", metavar="MEAN[:SPREAD]", help="MEAN[:SPREAD] tokens (random)"
    )
    inp.add_argument(
        "--output-len",
        default=None,
        metavar="MEAN[:SPREAD]",
        help="MEAN[:SPREAD] max_tokens (default 128)",
    )
    inp.add_argument(
        "--prompt-id", type=int, default=0, metavar="ID", help="a registered prompt (frames)"
    )
    inp.add_argument(
        "--system-file", default=None, metavar="FILE", help="system prompt sent with each request"
    )
    inp.add_argument(
        "--request-format", choices=("auto", "binary", "json"), default="auto", help="frames"
    )
    inp.add_argument("--no-text", action="store_true", help="frames: token ids, no text deltas")
    opt = bench.add_argument_group("server")
    opt.add_argument("--api-key", default="", metavar="KEY", help="HELLO key or HTTP bearer key")
    opt.add_argument(
        "--connections", type=int, default=1, metavar="N", help="frame connections to share"
    )
    opt.add_argument("--tls-ca", default=None, metavar="CA", help="tls:// / https://: server CA")
    opt.add_argument("--tls-cert", default=None, metavar="CERT", help="client certificate (mTLS)")
    opt.add_argument("--tls-key", default=None, metavar="KEY", help="client key (mTLS)")
    opt.add_argument("--ignore-eos", action="store_true", help="HTTP: ask to ignore EOS (vLLM)")
    opt.add_argument(
        "--response-cache",
        action="store_true",
        help="let the server answer from its response cache (default: every request bypasses "
        "it: frame option bit 3 / Cache-Control: no-cache)",
    )
    opt.add_argument(
        "--frame-version",
        type=int,
        choices=(1, 2),
        default=2,
        help="frames: the protocol version HELLO asks for (1 for a daemon of an older release; "
        "the requests use no version-2 field either way)",
    )
    opt.add_argument(
        "--metrics-url", default=None, metavar="URL", help="the daemon's Prometheus endpoint"
    )
    out = bench.add_argument_group("report")
    out.add_argument(
        "--slo", default=None, metavar="SPEC", help="goodput limits, e.g. ttft=500ms,tpot=50ms"
    )
    out.add_argument("--output", default=None, metavar="FILE", help="write the JSON report here")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    out.add_argument("--detailed", action="store_true", help="per-token ITLs in the report")
    out.add_argument(
        "--label", default="", metavar="TEXT", help="a name for this run in reports and plots"
    )
    out.add_argument(
        "--max-failure-rate",
        type=float,
        default=0.0,
        metavar="F",
        help="exit 1 when more than this fraction of requests failed (default 0: any failure)",
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr (default on: a live line on a terminal, else a line every 5 s)",
    )
    out.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between progress lines when stderr is not a terminal (default 5)",
    )
    bench.set_defaults(func=_cmd_bench)
    nested = bench.add_subparsers(dest="bench_command", required=False, metavar="compare")
    cmp = nested.add_parser("compare", help="print two JSON reports side by side with ratios")
    cmp.add_argument("reports", nargs=2, metavar="REPORT.json", help="two --output reports")
    cmp.set_defaults(func=_cmd_compare)


def _options(args: argparse.Namespace) -> BenchOptions:
    from zerolayer.client.bench.options import BenchOptions

    return BenchOptions(
        endpoint=args.endpoint,
        protocol=args.protocol,
        model=args.model,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        num_requests=args.num_requests,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        input=args.input,
        input_len=args.input_len,
        output_len=args.output_len,
        prompt_id=args.prompt_id,
        system_file=args.system_file,
        api_key=args.api_key,
        connections=args.connections,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        ignore_eos=args.ignore_eos,
        metrics_url=args.metrics_url,
        slo=args.slo,
        text_deltas=not args.no_text,
        request_format=args.request_format,
        progress=args.progress,
        detailed=args.detailed or bool(args.plot),
        label=args.label,
        use_cache=args.response_cache,
        frame_version=args.frame_version,
        progress_interval_s=args.progress_interval,
    )


def _cmd_compare(args: argparse.Namespace) -> int:
    from zerolayer.client.bench import report

    argv = args.reports
    try:
        a, b = report.load(argv[0]), report.load(argv[1])
    except ValueError as exc:
        print(f"zerolayer bench: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(report.compare(a, b, Path(argv[0]).stem, Path(argv[1]).stem))
    return 0


def verdict(result: dict[str, Any], max_failure_rate: float) -> tuple[int, list[str]]:
    """The exit status of a finished (or interrupted) run and the lines to warn with: cache hits
    (the run measured replays, not the model), failures beyond ``max_failure_rate`` (1), and an
    interruption (130)."""
    from zerolayer.client.bench.report import runs

    lines: list[str] = []
    status = 0
    for run in runs(result):
        level = f" at concurrency {run['max_concurrency']}" if "sweep" in result else ""
        hits = run.get("response_cache_hits", 0)
        if hits:
            lines.append(
                f"warning: {hits} of {run['completed']} answers{level} came from the server's "
                "response cache: their latency and throughput are replays, not the model"
            )
        total = run["completed"] + run["failed"]
        if run["failed"]:
            rate = run["failed"] / total
            lines.append(f"{run['failed']} of {total} requests{level} failed ({rate:.1%}):")
            lines += [f"  {line}" for line in run.get("first_errors", [])]
            if rate > max_failure_rate:
                status = 1
        elif total == 0 and not run.get("interrupted"):
            lines.append(f"no request{level} ended")
            status = 1
    if any(run.get("interrupted") for run in runs(result)):
        lines.append("interrupted: the report covers the requests that ended before Ctrl-C")
        status = 130
    return status, lines


def _cmd_bench(args: argparse.Namespace) -> int:
    from zerolayer.client.bench import plot, report, runner

    try:
        opts = _options(args)
        if args.ignore_eos and not opts.endpoint.startswith(("http://", "https://")):
            print(
                "zerolayer bench: note: the frame protocol has no ignore-EOS option; "
                "streams end at max_tokens or EOS (see finish_reasons in the report)",
                file=sys.stderr,
            )
        if args.sweep_concurrency:
            levels = [int(x) for x in args.sweep_concurrency.split(",") if x.strip()]
            result = asyncio.run(runner.sweep(opts, levels))
            for run in result["sweep"]:
                print(f"--- concurrency {run['max_concurrency']}\n{report.summary(run)}")
        else:
            result = asyncio.run(runner.run(opts))
            print(report.summary(result))
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        if args.plot:
            for path in plot.plot(result, args.plot):
                print(f"wrote {path}", file=sys.stderr)
    except (EndpointError, WorkloadError, TargetError, ValueError, plot.PlotError) as exc:
        print(f"zerolayer bench: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"zerolayer bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before or after the measured part (which reports instead)
        return 130
    status, lines = verdict(result, args.max_failure_rate)
    for line in lines:
        print(f"zerolayer bench: {line}", file=sys.stderr)
    return status
