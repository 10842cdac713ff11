"""The ``zerolayer`` command: serve, generate, and the operator tools."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from gateway.client import DEFAULT_ENDPOINT, Client, ServerError
from gateway.codes import FinishReason
from gateway.config import ConfigError, load_settings
from gateway.hooks.keys import add_keys_subparser
from gateway.prompts import add_compile_check_subparser


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"zerolayer: {exc}", file=sys.stderr)
        return 2
    from gateway.daemon import run

    try:
        return run(settings, args.config)
    except Exception as exc:  # a start-up failure: one clear line, no traceback soup
        from gateway.hooks import HookConfigError
        from gateway.models import ModelLoadError
        from gateway.prompts import PromptConfigError

        if isinstance(exc, (HookConfigError, ModelLoadError, PromptConfigError, OSError)):
            print(f"zerolayer: cannot start: {exc}", file=sys.stderr)
            return 1
        raise


async def _generate(args: argparse.Namespace) -> int:
    async with await Client.connect(args.endpoint, args.api_key) as client:
        if args.json:
            request = {
                "max_tokens": args.max_tokens,
                "messages": [{"role": "user", "content": args.prompt}],
                "temperature": args.temperature,
            }
            if args.system:
                request["system"] = args.system
            if args.seed is not None:
                request["seed"] = args.seed
            stream = await client.generate_json(request)
        else:
            stream = await client.generate(
                args.prompt,
                args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                text=True,
            )
        async for event in stream:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        result = stream.result
        assert result is not None
        sys.stdout.write("\n")
        if args.verbose:
            print(
                f"[finish={FinishReason(result.finish_reason).label} "
                f"prompt_tokens={result.prompt_tokens} "
                f"completion_tokens={result.completion_tokens} "
                f"ttft={result.ttft_us / 1000:.1f}ms total={result.total_us / 1000:.1f}ms]",
                file=sys.stderr,
            )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_generate(args))
    except ServerError as exc:
        print(f"zerolayer: server error {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zerolayer: cannot reach {args.endpoint}: {exc}", file=sys.stderr)
        return 1


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"zerolayer: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(settings.model_dump(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerolayer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", default=None, help="TOML file (default configs/default.toml)")
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion from a running daemon")
    gen.add_argument("prompt")
    gen.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="send a JSON chat request")
    gen.add_argument("--system", default=None, help="system prompt (with --json)")
    gen.add_argument("--api-key", default=None, help="API key (sent in HELLO)")
    gen.add_argument("-v", "--verbose", action="store_true", help="print DONE fields")
    gen.set_defaults(func=_cmd_generate)

    add_keys_subparser(sub)
    add_compile_check_subparser(sub)

    cfg = sub.add_parser("config", help="print the effective configuration and exit")
    cfg.add_argument("--config", default=None)
    cfg.set_defaults(func=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
