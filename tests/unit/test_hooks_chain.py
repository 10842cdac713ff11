"""The hook registry and chain: start-up resolution, ordering, errors, custom and async hooks."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig
from zerolayer.hooks import (
    INTERNAL,
    INVALID_REQUEST,
    RATE_LIMITED,
    CachedResponse,
    Chain,
    Completion,
    HookConfigError,
    HookError,
    Principal,
    RequestContext,
    hook,
)
from zerolayer.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def settings(modules=(), options=None, auth=None, ratelimit=None, cache=None):
    return SimpleNamespace(
        hooks=HooksConfig(modules=list(modules), options=options or {}),
        auth=auth or AuthConfig(),
        ratelimit=ratelimit or RateLimitConfig(),
        cache=cache or CacheConfig(),
    )


def make_ctx(principal=None, prompt=(1, 2, 3), max_tokens=8, temperature=0.0, seed=None):
    return RequestContext(
        principal=principal or Principal("anonymous"),
        model="m",
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        prompt_id=0,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, seed=seed),
        stop_ids=(),
        stop_sequences=(),
        want_text=True,
        state={},
    )


def write_module(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_builtins_in_order_and_disabled_ones_left_out():
    on = Chain.build(settings())
    assert on.names == (
        "zerolayer.hooks.ratelimit.RateLimiter",
        "zerolayer.hooks.cache.ResponseCache",
    )
    assert on.records and not on.is_async and not on.auth_required
    off = Chain.build(
        settings(ratelimit=RateLimitConfig(enabled=False), cache=CacheConfig(enabled=False))
    )
    assert off.names == () and not off.records
    assert off.on_request(make_ctx()) is None
    off.on_done(make_ctx(), Completion(0, 3, 1))


def test_settings_without_hook_sections_use_defaults():
    chain = Chain.build(SimpleNamespace(auth=AuthConfig()))
    assert "zerolayer.hooks.cache.ResponseCache" in chain.names


def test_module_failing_to_import_names_it(tmp_path):
    bad = write_module(tmp_path, "broken_hook", "import no_such_module_zl\n")
    with pytest.raises(HookConfigError, match=r"broken_hook\.py.*failed to import.*no_such"):
        Chain.build(settings([bad]))
    with pytest.raises(HookConfigError, match=r"'zl_missing_hooks_pkg' failed to import"):
        Chain.build(settings(["zl_missing_hooks_pkg"]))


def test_registration_errors_stop_the_build(tmp_path):
    empty = write_module(tmp_path, "empty_hook", "X = 1\n")
    with pytest.raises(HookConfigError, match="registered no hooks"):
        Chain.build(settings([empty]))
    stage = write_module(
        tmp_path,
        "bad_stage",
        """
        from zerolayer.hooks import hook
        @hook("on_reply")
        def f(ctx): pass
        """,
    )
    with pytest.raises(HookConfigError, match="bad_stage.*unknown hook stage 'on_reply'"):
        Chain.build(settings([stage]))
    arity = write_module(
        tmp_path,
        "bad_arity",
        """
        from zerolayer.hooks import hook
        @hook("on_done")
        def audit(ctx): pass
        """,
    )
    with pytest.raises(HookConfigError, match=r"audit cannot be called as on_done"):
        Chain.build(settings([arity]))
    ctor = write_module(
        tmp_path,
        "bad_ctor",
        """
        from zerolayer.hooks import hook
        @hook
        class Needy:
            def __init__(self, settings):
                raise KeyError("needs a secret")
            def on_request(self, ctx): pass
        """,
    )
    with pytest.raises(HookConfigError, match=r"Needy failed to start: KeyError"):
        Chain.build(settings([ctor]))
    with pytest.raises(HookConfigError, match="built in"):
        Chain.build(settings(["zerolayer.hooks.cache"]))


def test_custom_hooks_run_after_builtins_in_listed_order(tmp_path):
    first = write_module(
        tmp_path,
        "first_hook",
        """
        from zerolayer.hooks import hook
        @hook("on_request")
        def tag(ctx):
            ctx.state.setdefault("seen", []).append("first")
        """,
    )
    second = write_module(
        tmp_path,
        "second_hook",
        """
        from zerolayer.hooks import hook, HookError, INVALID_REQUEST
        @hook("on_request")
        def tag(ctx):
            ctx.state.setdefault("seen", []).append("second")
            if ctx.max_tokens > 100:
                raise HookError(INVALID_REQUEST, "too greedy")
        """,
    )
    chain = Chain.build(settings([first, second], cache=CacheConfig(enabled=False)))
    assert "first_hook" in chain.names[-2] and "second_hook" in chain.names[-1]
    ctx = make_ctx()
    assert chain.on_request(ctx) is None
    assert ctx.state["seen"] == ["first", "second"]
    with pytest.raises(HookError) as err:
        chain.on_request(make_ctx(max_tokens=200))
    assert err.value.code == INVALID_REQUEST


def test_a_later_refusal_returns_the_rate_limit_reservation(tmp_path):
    refuser = write_module(
        tmp_path,
        "refuser_hook",
        """
        from zerolayer.hooks import hook, HookError, INVALID_REQUEST
        @hook("on_request")
        def refuse_odd(ctx):
            if ctx.max_tokens % 2:
                raise HookError(INVALID_REQUEST, "odd")
        """,
    )
    chain = Chain.build(
        settings(
            [refuser], ratelimit=RateLimitConfig(default_tpm=100), cache=CacheConfig(enabled=False)
        )
    )
    # Each refused request would hold 3 + 91 = 94 tokens if the reservation leaked.
    for _ in range(3):
        with pytest.raises(HookError) as err:
            chain.on_request(make_ctx(max_tokens=91))
        assert err.value.code == INVALID_REQUEST
    assert chain.on_request(make_ctx(max_tokens=90)) is None
    with pytest.raises(HookError) as err:
        chain.on_request(make_ctx(max_tokens=90))
    assert err.value.code == RATE_LIMITED


def test_a_crashing_hook_becomes_internal_and_on_done_never_raises(tmp_path, caplog):
    crash = write_module(
        tmp_path,
        "crash_hook",
        """
        from zerolayer.hooks import hook
        @hook("on_request")
        def boom(ctx):
            raise ZeroDivisionError("bug")
        @hook("on_done")
        def boom_done(ctx, result):
            raise ZeroDivisionError("bug in done")
        """,
    )
    chain = Chain.build(settings([crash]))
    with pytest.raises(HookError) as err:
        chain.on_request(make_ctx())
    assert err.value.code == INTERNAL and "boom" in err.value.message
    chain.on_done(make_ctx(), Completion(0, 3, 1))
    assert "bug in done" in caplog.text


def test_async_hooks_make_the_chain_async(tmp_path):
    mod = write_module(
        tmp_path,
        "async_hook",
        """
        import asyncio
        from zerolayer.hooks import hook
        DONE = []
        @hook("on_request")
        async def slow(ctx):
            await asyncio.sleep(0)
            ctx.state["async"] = True
        @hook("on_done")
        async def finished(ctx, result):
            await asyncio.sleep(0)
            DONE.append(result.completion_tokens)
        """,
    )
    chain = Chain.build(settings([mod], cache=CacheConfig(enabled=False)))
    assert chain.is_async
    ctx = make_ctx()
    with pytest.raises(RuntimeError, match="on_request_async"):
        chain.on_request(ctx)

    async def run():
        assert await chain.on_request_async(ctx) is None
        chain.on_done(ctx, Completion(0, 3, 7))  # a plain call that starts the async hook
        await chain.aclose()

    asyncio.run(run())
    assert ctx.state["async"] is True
    import sys

    module = next(m for n, m in sys.modules.items() if n.startswith("zerolayer_hook_async_hook"))
    assert module.DONE == [7]


def test_async_on_hello_is_refused(tmp_path):
    mod = write_module(
        tmp_path,
        "async_hello",
        """
        from zerolayer.hooks import hook
        @hook("on_hello")
        async def hello(key): return None
        """,
    )
    with pytest.raises(HookConfigError, match="on_hello hooks must be synchronous"):
        Chain.build(settings([mod]))


def test_custom_on_hello_and_cached_response_short_circuit(tmp_path):
    mod = write_module(
        tmp_path,
        "static_hook",
        """
        import numpy as np
        from zerolayer.hooks import hook, Principal, CachedResponse
        @hook("on_hello")
        def hello(key):
            return Principal("robot") if key == b"beep" else None
        @hook("on_request")
        def canned(ctx):
            return CachedResponse(np.array([9], np.int32), "nine", 1, len(ctx.prompt_ids))
        """,
    )
    chain = Chain.build(settings([mod]))
    assert chain.on_hello(b"beep").name == "robot"
    assert chain.on_hello(b"other") is chain.anonymous()
    hit = chain.on_request(make_ctx())
    assert isinstance(hit, CachedResponse) and hit.text == "nine"


def test_audit_example_writes_one_json_line_per_request(tmp_path):
    log_path = tmp_path / "audit.jsonl"
    example = str(REPO / "examples" / "audit_hook.py")
    chain = Chain.build(settings([example], options={"audit": {"path": str(log_path)}}))
    assert any(name.endswith("AuditLog") for name in chain.names)
    alice = Principal("alice")
    for finish, n in ((0, 4), (3, 2)):
        ctx = make_ctx(principal=alice)
        chain.on_request(ctx)
        chain.on_done(ctx, Completion(finish, 3, n))
    chain.reload()  # reopens the file (logrotate) and keeps appending
    ctx = make_ctx()
    chain.on_request(ctx)
    chain.on_done(ctx, Completion(-1, 3, 0))
    chain.close()
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["principal"], r["finish"], r["completion_tokens"]) for r in lines] == [
        ("alice", "eos", 4),
        ("alice", "cancelled", 2),
        ("anonymous", "error", 0),
    ]
    assert lines[0]["model"] == "m" and lines[0]["prompt_tokens"] == 3


def test_audit_example_by_dotted_name(tmp_path):
    log_path = tmp_path / "audit.jsonl"
    chain = Chain.build(
        settings(["examples.audit_hook"], options={"audit": {"path": str(log_path)}})
    )
    ctx = make_ctx()
    chain.on_request(ctx)
    chain.on_done(ctx, Completion(1, 3, 8))
    chain.close()
    assert json.loads(log_path.read_text())["finish"] == "max_tokens"


def test_hook_decorator_rejects_misuse():
    with pytest.raises(ValueError, match="unknown hook stage"):
        hook("on_everything")
    with pytest.raises(TypeError, match="defines none of"):

        @hook
        class Nothing:
            pass


def test_builds_from_the_daemon_settings():
    from zerolayer.config.settings import Settings

    chain = Chain.build(Settings())
    assert "zerolayer.hooks.ratelimit.RateLimiter" in chain.names and not chain.auth_required


def test_async_chain_refusals_and_crashes_give_back_the_reservation(tmp_path):
    mod = write_module(
        tmp_path,
        "async_refuser",
        """
        import asyncio
        from zerolayer.hooks import INVALID_REQUEST, HookError, hook
        @hook("on_request")
        async def refuse(ctx):
            await asyncio.sleep(0)
            if ctx.max_tokens == 91:
                raise HookError(INVALID_REQUEST, "no")
            if ctx.max_tokens == 92:
                raise ZeroDivisionError("bug")
        """,
    )
    chain = Chain.build(
        settings(
            [mod], ratelimit=RateLimitConfig(default_tpm=100), cache=CacheConfig(enabled=False)
        )
    )
    assert chain.is_async

    async def run() -> list[int]:
        codes = []
        # Each refused request would hold 3 + 91 (or 92) tokens if the reservation leaked.
        for max_tokens in (91, 92, 91):
            with pytest.raises(HookError) as err:
                await chain.on_request_async(make_ctx(max_tokens=max_tokens))
            codes.append(err.value.code)
        assert await chain.on_request_async(make_ctx(max_tokens=90)) is None
        with pytest.raises(HookError) as err:
            await chain.on_request_async(make_ctx(max_tokens=90))
        codes.append(err.value.code)
        await chain.aclose()
        return codes

    assert asyncio.run(run()) == [INVALID_REQUEST, INTERNAL, INVALID_REQUEST, RATE_LIMITED]


def test_a_hook_from_a_file_that_fails_to_start_is_named_by_its_file(tmp_path):
    # Regression: the error named a generated module (zerolayer_hook_audit_hook_47966dc8).
    example = REPO / "examples" / "audit_hook.py"
    missing = tmp_path / "no-such-dir" / "audit.jsonl"
    with pytest.raises(HookConfigError) as exc:
        Chain.build(settings([str(example)], options={"audit": {"path": str(missing)}}))
    assert str(exc.value) == (
        f"hooks.options.audit.path {missing}: No such file or directory (create its directory, "
        "writable by the daemon's user)"
    )
    boom = tmp_path / "boom_hook.py"
    boom.write_text(
        "from zerolayer.hooks import hook\n\n@hook\nclass Boom:\n"
        "    def __init__(self, settings):\n        raise RuntimeError('no')\n\n"
        "    def on_done(self, ctx, result):\n        pass\n"
    )
    with pytest.raises(HookConfigError) as exc:
        Chain.build(settings([str(boom)]))
    assert str(exc.value) == f"hook {boom}:Boom failed to start: RuntimeError: no"
