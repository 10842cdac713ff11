"""The ``zerolayer`` command: serve, generate, and the operator tools.

Every error a user can cause (a setting, an argument, an unreachable endpoint) ends the command
with one line naming it and a non-zero status; tracebacks only with ``--debug`` or
``ZEROLAYER_DEBUG=1``. ``zerolayer --help`` ends with the commands summary that README.md shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerolayer.cli.compile_check import add_compile_check_subparser
from zerolayer.client.bench import add_bench_subparser
from zerolayer.client.connection import DEFAULT_ENDPOINT, DEFAULT_TIMEOUT_S, Client, ServerError
from zerolayer.config.settings import (
    DEBUG_ENV,
    ConfigError,
    Settings,
    describe_source,
    load_settings,
)
from zerolayer.hooks.keys import add_keys_subparser, positive_int
from zerolayer.ops import openmp

if TYPE_CHECKING:
    import ssl

# One line per command, shown by `zerolayer --help` and copied into README.md ("Commands").
COMMANDS = """\
zerolayer serve [MODEL] [--config FILE] [FLAGS]   run the daemon (no --config: built-in defaults)
    [--host A] [--port N] [--http-port N] [--metrics-port N] [--dtype D] [--max-batch-size N]
    [--max-context N] [--api-key KEY]... [--tls-cert PEM --tls-key PEM] [--log-format text|json]
zerolayer models [--json] [--all]                 list servable models (bundled, installed, cached)
zerolayer generate [OPTIONS] PROMPT               stream a completion (chat template unless --raw)
    [--endpoint tcp://H:P | --config FILE] [--raw] [--system TEXT] [--prompt-id N] [--max-tokens N]
    [--temperature T] [--seed N] [--api-key KEY] [--json] [-v] [--timeout S]
    [--endpoint tls://H:P --tls-ca CA [--tls-cert CERT --tls-key KEY]]
zerolayer chat [--endpoint tcp://H:P|http://H:P | --config FILE] [--system TEXT]  interactive chat
zerolayer keys add NAME [--rpm N] [--tpm N] [--cert-name CN] | keys list | keys revoke NAME
zerolayer compile-check [FILE|-] [--config FILE]  validate system prompts for precompilation
zerolayer config [--config FILE] [FLAGS]          print the effective configuration
zerolayer bench [OPTIONS]                         load-test a daemon or an OpenAI-compatible server
    [--endpoint URL] [--protocol P] [--concurrency N | --request-rate R] [--num-requests N]
    [--input FILE | --input-len L --output-len L] [--output FILE] [--plot DIR]
zerolayer bench compare A.json B.json             two bench reports side by side with ratios
zerolayer --debug COMMAND ...                     tracebacks instead of one-line errors"""


# Exceptions whose message is the whole story for an operator (no traceback needed), by the
# module that defines them: a module not imported yet cannot have raised one, so checking costs
# no import (zerolayer.models would pull in torch just to print one line).
_USER_ERRORS = (
    ("zerolayer.daemon", "StartupError"),
    ("zerolayer.engine.backends.neuron", "NeuronBackendError"),
    ("zerolayer.hooks.types", "HookConfigError"),
    ("zerolayer.hooks.keys", "KeysFileError"),
    ("zerolayer.models.loader", "ModelLoadError"),
    ("zerolayer.models.hf_tokenizer", "TokenizerLoadError"),
    ("zerolayer.request_path.prompts", "PromptConfigError"),
    ("zerolayer.ops.tls", "TLSConfigError"),
    ("zerolayer.client.chat", "ChatError"),
)


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, (ServerError, ConnectionError, ValueError)):
        return True  # a server's refusal, an unreachable endpoint, a malformed argument
    return any(
        isinstance(exc, getattr(sys.modules[module], name))
        for module, name in _USER_ERRORS
        if module in sys.modules
    )


# `zerolayer serve` / `zerolayer config` flags → the setting each one sets. A flag wins over the
# environment and the file: it is applied as the ZEROLAYER_* variable of its setting, so a
# SIGHUP re-read and the worker processes of server.workers see it too.
SERVE_FLAGS: tuple[tuple[str, tuple[str, ...], dict[str, Any]], ...] = (
    ("--host", ("server.host", "http.host"), {"metavar": "ADDR", "help": "frame and HTTP address"}),
    ("--port", ("server.port",), {"type": int, "metavar": "N", "help": "frame-protocol port"}),
    ("--http-port", ("http.port",), {"type": int, "metavar": "N", "help": "OpenAI/Anthropic port"}),
    ("--metrics-port", ("metrics.port",), {"type": int, "metavar": "N", "help": "metrics port"}),
    ("--dtype", ("model.dtype",), {"choices": ("auto", "float32", "bfloat16")}),
    ("--max-batch-size", ("engine.max_batch_size",), {"type": int, "metavar": "N"}),
    ("--max-context", ("engine.max_context",), {"type": int, "metavar": "N"}),
    (
        "--api-key",
        ("auth.api_keys",),
        {"action": "append", "metavar": "KEY", "help": "require this key (repeatable; auth on)"},
    ),
    ("--tls-cert", ("tls.cert_file",), {"metavar": "PEM", "help": "TLS certificate chain"}),
    ("--tls-key", ("tls.key_file",), {"metavar": "PEM", "help": "TLS private key"}),
    ("--log-format", ("logging.json_lines",), {"choices": ("text", "json")}),
)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="TOML file (default: none, the built-in defaults, which configs/default.toml lists)",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a .gguf file, a checkpoint directory or a named model (@smollm2, @builtin); "
        "see `zerolayer models`",
    )
    flags = parser.add_argument_group(
        "settings (win over the environment and the file; docs/configuration.md)"
    )
    for flag, keys, kw in SERVE_FLAGS:
        names = " and ".join(keys)
        text = f"{kw['help']} ({names})" if "help" in kw else names
        flags.add_argument(flag, default=None, **{**kw, "help": text})


def flag_environment(args: argparse.Namespace) -> dict[str, str]:
    """The ZEROLAYER_* variables that the given serve flags stand for."""
    env: dict[str, str] = {}

    def put(key: str, value: object) -> None:
        section, name = key.split(".", 1)
        text = value if isinstance(value, str) else json.dumps(value)
        env[f"ZEROLAYER_{section.upper()}__{name.upper()}"] = text

    if args.model is not None:
        put("model.path", args.model)
    for flag, keys, _ in SERVE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if flag == "--log-format":
            value = value == "json"
        for key in keys:
            put(key, value)
        if flag == "--api-key":
            put("auth.enabled", True)
    return env


def _settings(args: argparse.Namespace) -> Settings:
    os.environ.update(flag_environment(args))
    return load_settings(args.config)


def _cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    # Before zerolayer.daemon imports torch: libgomp reads its wait policy once, as it loads.
    openmp.set_defaults()
    from zerolayer.daemon import run

    return run(settings, args.config)


def terminal_safe(text: str) -> str:
    """Control characters (except newline and tab) as \\xNN escapes, so model output cannot
    move the cursor, switch character sets or ring the bell."""
    return "".join(
        ch
        if ch in "\n\t" or not (ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0)
        else f"\\x{ord(ch):02x}"
        for ch in text
    )


def generate_request(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON REQUEST ``generate`` sends: chat ``messages`` (the server applies the model's
    chat template), or with ``--raw`` the ``prompt`` text as it is."""
    request: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.raw:
        request["prompt"] = args.prompt
    else:
        request["messages"] = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        request["system"] = args.system
    if args.prompt_id is not None:
        request["prompt_id"] = args.prompt_id
    if args.seed is not None:
        request["seed"] = args.seed
    return request


def settings_endpoint(settings: Settings) -> str:
    """The frame port of a daemon started with ``settings``, as a client on this host reaches
    it: ``server.host`` (a wildcard address becomes loopback) and ``server.port``, ``tls://``
    when ``tls.cert_file`` is set."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(
        settings.server.host, settings.server.host
    )
    if ":" in host:
        host = f"[{host}]"
    scheme = "tls" if settings.tls.cert_file else "tcp"
    return f"{scheme}://{host}:{settings.server.port}"


def _resolve_endpoint(args: argparse.Namespace) -> None:
    """No --endpoint: the daemon's own settings (--config, ZEROLAYER_* variables, defaults)."""
    if args.endpoint is None:
        args.endpoint = settings_endpoint(load_settings(args.config))


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client TLS context for a ``tls://`` (or ``https://``) endpoint from
    --tls-ca/--tls-cert/--tls-key."""
    https = args.endpoint.startswith("https://")
    if not (args.endpoint.startswith("tls://") or https):
        return None
    from zerolayer.ops.tls import client_context

    return client_context(
        args.tls_ca, args.tls_cert, args.tls_key, alpn=["http/1.1"] if https else None
    )


async def _generate(args: argparse.Namespace) -> int:
    # HELLO always (an empty key when auth is off): its WELCOME proves this is a frame port.
    client = await Client.connect(
        args.endpoint, args.api_key or "", timeout=args.timeout, ssl=_tls(args)
    )
    async with client:
        stream = await client.generate_json(generate_request(args))
        escape = sys.stdout.isatty()
        async for event in stream:
            if not args.json:
                sys.stdout.write(terminal_safe(event.text) if escape else event.text)
                sys.stdout.flush()
        result = stream.result
        assert result is not None
    done = {
        "finish_reason": result.finish_reason,
        "cache": result.cache,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "queue_ms": result.queue_us / 1000,
        "ttft_ms": result.ttft_us / 1000,
        "total_ms": result.total_us / 1000,
    }
    if args.json:
        print(json.dumps({"text": result.text, **done}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if args.verbose:
        print("[" + " ".join(f"{k}={v}" for k, v in done.items()) + "]", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    _resolve_endpoint(args)
    if args.prompt == "-":  # the prompt from stdin, as `echo Hi | zerolayer generate -`
        args.prompt = sys.stdin.read().rstrip("\n")
    return asyncio.run(_generate(args))


def _cmd_chat(args: argparse.Namespace) -> int:
    from zerolayer.client.chat import connect, run_chat

    _resolve_endpoint(args)
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(
            connect(args.endpoint, args.api_key or "", timeout=args.timeout, tls=_tls(args))
        )
        try:
            return run_chat(
                client,
                loop,
                system=args.system,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                escape=terminal_safe if sys.stdout.isatty() else str,
            )
        finally:
            loop.run_until_complete(client.close())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())  # an answer left mid-stream
        loop.close()


def _cmd_config(args: argparse.Namespace) -> int:
    data = _settings(args).model_dump()
    data["auth"]["api_keys"] = ["***"] * len(data["auth"]["api_keys"])  # never print a key
    print(f"configuration: {describe_source(args.config)}", file=sys.stderr)  # stdout: the JSON
    print(json.dumps(data, indent=2))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from zerolayer.models.catalog import list_models

    rows = list_models(load_settings(args.config).model.data_dir, everything=args.all)
    if args.json:
        print(json.dumps([row._asdict() for row in rows], indent=2))
        return 0
    table = [("MODEL", "KIND", "SIZE", "WHERE")] + [
        (r.name, r.kind, _size(r.size_bytes), r.where + (" (converted)" if r.cache else ""))
        for r in rows
    ]
    name_w, kind_w, size_w = (max(len(line[i]) for line in table) for i in range(3))
    for name, kind, size, where in table:
        print(f"{name:<{name_w}}  {kind:<{kind_w}}  {size:>{size_w}}  {where}".rstrip())
    return 0


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerolayer",
        description="ZeroLayer: a self-hosted LLM serving daemon and its tools.",
        epilog="commands:\n" + COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print tracebacks instead of one-line errors (also {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Serve MODEL (default: model.path of the configuration). Precedence, "
        "highest first: these flags, ZEROLAYER_* environment variables, the TOML file of "
        "--config, the built-in defaults (all a bare `serve` needs, from any directory).",
    )
    add_serve_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser(
        "generate",
        help="stream a completion from a running daemon",
        description="Send PROMPT as a chat message (the server applies the model's chat "
        "template) and stream the answer to stdout; control characters are escaped when "
        "stdout is a terminal.",
    )
    gen.add_argument(
        "prompt", metavar="PROMPT", help="the user message (with --raw: the text); - reads stdin"
    )
    gen.add_argument(
        "--endpoint",
        default=None,
        metavar="tcp://H:P",
        help="the daemon's frame port as tcp://HOST:PORT (default: server.host and "
        f"server.port of --config and ZEROLAYER_* variables, else {DEFAULT_ENDPOINT})",
    )
    gen.add_argument(
        "--config", default=None, metavar="FILE", help="the daemon's TOML file (for --endpoint)"
    )
    gen.add_argument(
        "--raw", action="store_true", help="send PROMPT as plain text, without the chat template"
    )
    gen.add_argument(
        "--system", default=None, metavar="TEXT", help="system prompt (chat and --raw)"
    )
    gen.add_argument(
        "--prompt-id",
        type=positive_int,
        default=None,
        metavar="N",
        help="prepend registered system prompt N (listed at the metrics port's /prompts)",
    )
    gen.add_argument(
        "--max-tokens", type=positive_int, default=64, metavar="N", help="tokens to generate (64)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)"
    )
    gen.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed")
    gen.add_argument(
        "--api-key", default=None, metavar="KEY", help="API key, when the daemon has auth on"
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, finish_reason, usage, timings) instead of the text",
    )
    gen.add_argument("-v", "--verbose", action="store_true", help="print the DONE fields to stderr")
    gen.add_argument("--tls-ca", default=None, help="CA file for a tls:// endpoint (else system)")
    gen.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    gen.add_argument("--tls-key", default=None, help="client certificate's key")
    gen.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to connect and to get WELCOME ({DEFAULT_TIMEOUT_S:g})",
    )
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="an interactive chat with a running daemon",
        description="Chat with the daemon's model: answers stream, the conversation is kept; "
        "/system TEXT, /reset, /exit; a message in triple quotes spans lines; Ctrl-C stops an "
        "answer (cancelled on the server), Ctrl-D leaves.",
    )
    chat.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="the daemon's frame port (default: from --config and ZEROLAYER_* variables, as "
        f"generate; else {DEFAULT_ENDPOINT}), or http(s)://H:P: any OpenAI-compatible server "
        "(its /v1/chat/completions)",
    )
    chat.add_argument(
        "--config", default=None, metavar="FILE", help="the daemon's TOML file (for --endpoint)"
    )
    chat.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    chat.add_argument(
        "--max-tokens", type=positive_int, default=512, metavar="N", help="per answer (512)"
    )
    chat.add_argument(
        "--temperature", type=float, default=0.7, metavar="T", help="sampling temperature (0.7)"
    )
    chat.add_argument("--api-key", default=None, metavar="KEY", help="API key (auth on)")
    chat.add_argument(
        "--tls-ca", default=None, help="CA file for a tls:// or https:// endpoint (else system)"
    )
    chat.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    chat.add_argument("--tls-key", default=None, help="client certificate's key")
    chat.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help="connect timeout"
    )
    chat.set_defaults(func=_cmd_chat)

    add_keys_subparser(sub)
    add_compile_check_subparser(sub)
    add_bench_subparser(sub)

    cfg = sub.add_parser(
        "config",
        help="print the effective configuration and exit",
        description="Print the configuration `zerolayer serve` with the same arguments would "
        "run with (flags over environment over file over defaults) as JSON, API keys masked; "
        "stderr says where it comes from, as the daemon's log does.",
    )
    add_serve_flags(cfg)
    cfg.set_defaults(func=_cmd_config)

    models = sub.add_parser(
        "models",
        help="list the models that can be served here, with sizes",
        description="Named models (bundled), models installed by Python packages, and the "
        "converted caches under model.data_dir (default ~/.cache/zerolayer).",
    )
    models.add_argument("--config", default=None, help="TOML file (for model.data_dir)")
    models.add_argument("--json", action="store_true", help="one JSON list")
    models.add_argument(
        "--all",
        action="store_true",
        help="also the converted caches of GGUF files not listed (other checkouts', by path)",
    )
    models.set_defaults(func=_cmd_models)
    return parser


def _report(message: str) -> None:
    """One line on stderr; through the log handler once the daemon set one up (JSON mode)."""
    from zerolayer.ops.logging import installed_handler

    if installed_handler() is not None:
        logging.getLogger("zerolayer").error("%s", message)
    else:
        print(f"zerolayer: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        command: Callable[[argparse.Namespace], int] = args.func  # set by each subparser
        return command(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, ConfigError):
            _report(str(exc))
            return 2
        if _is_user_error(exc):
            _report(("cannot start: " if args.command == "serve" else "") + str(exc))
            return 1
        _report(
            f"unexpected error: {type(exc).__name__}: {exc} (run with --debug or {DEBUG_ENV}=1 "
            "for the traceback)"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
