"""The hook chain: resolved once at start-up into fixed tuples of bound callables.

Chain.build imports the built-in modules (auth, ratelimit, cache), then those named in
``hooks.modules``, constructs hook classes with the settings, checks every hook's signature, and
keeps per stage a tuple of callables. A request then costs a plain for-loop over a tuple: no
import, getattr or dict dispatch.

Sync and async: on_request hooks may be ``async def`` (the Redis stores are). ``Chain.is_async``
tells the server which of ``on_request`` (plain call) or ``on_request_async`` (awaited) to use.
on_done and on_refused are always plain calls for the server: async hooks of those stages run as
tasks on the event loop, tracked until ``aclose``. on_hello hooks must be synchronous.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from zerolayer.config.hooks import HooksConfig
from zerolayer.hooks.registry import STAGES, Registration, forget, registrations
from zerolayer.hooks.types import (
    INTERNAL,
    UNAUTHENTICATED,
    CachedResponse,
    Completion,
    HookConfigError,
    HookError,
    Principal,
    RequestContext,
)

log = logging.getLogger("zerolayer.hooks")

_FILE_MODULE_PREFIX = "zerolayer_hook_"  # sys.modules names of hooks loaded from a .py path
BUILTIN_MODULES = ("zerolayer.hooks.auth", "zerolayer.hooks.ratelimit", "zerolayer.hooks.cache")


def _import(spec: str) -> str:
    """Import a hook module by dotted name or .py path; returns the name it registers under."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).resolve()
        if not path.is_file():
            raise HookConfigError(f"hook module {spec!r}: file {path} not found")
        tag = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        name = f"{_FILE_MODULE_PREFIX}{path.stem}_{tag}"
        if name in sys.modules:
            return name
        forget(name)
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise HookConfigError(f"hook module {spec!r}: {path} is not a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            forget(name)
            raise HookConfigError(
                f"hook module {spec!r} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        return name
    try:
        return importlib.import_module(spec).__name__
    except Exception as exc:
        raise HookConfigError(
            f"hook module {spec!r} failed to import: {type(exc).__name__}: {exc}"
        ) from exc


def _label(target: Any) -> str:
    # A hook loaded from a .py path is named by its file, not by the generated module name.
    if target.__module__.startswith(_FILE_MODULE_PREFIX):
        origin = getattr(sys.modules.get(target.__module__), "__file__", None)
        if origin:
            return f"{origin}:{target.__qualname__}"
    return f"{target.__module__}.{target.__qualname__}"


def _check_signature(fn: Callable[..., Any], stage: str, label: str) -> bool:
    """Raise unless ``fn`` accepts the stage's arguments; returns whether it is async."""
    try:
        inspect.signature(fn).bind(*([None] * STAGES[stage]))
    except TypeError as exc:
        raise HookConfigError(
            f"hook {label} cannot be called as {stage} with {STAGES[stage]} argument(s): {exc}"
        ) from exc
    except ValueError:
        pass  # builtins without a signature: trust them
    is_async = inspect.iscoroutinefunction(fn)
    if is_async and stage in ("on_hello", "on_certificate"):
        raise HookConfigError(f"hook {label}: {stage} hooks must be synchronous")
    return is_async


class Chain:
    """The fixed per-stage call sequences, plus what the server needs to know about them."""

    def __init__(self) -> None:
        self.auth_required = False
        self.records = False
        self.is_async = False
        self.names: tuple[str, ...] = ()  # hook labels in chain order, for logs and docs
        self._anonymous = Principal("anonymous", principal_class="anonymous")
        self._on_hello: tuple[Callable[[bytes], Principal | None], ...] = ()
        self._on_certificate: tuple[Callable[[tuple[str, ...]], Principal | None], ...] = ()
        self._on_request: tuple[Callable[[Any], Any], ...] = ()
        self._on_request_flagged: tuple[tuple[Callable[[Any], Any], bool], ...] = ()
        self._on_refused: tuple[Callable[[Any, HookError], None], ...] = ()
        self._on_done: tuple[Callable[[Any, Any], None], ...] = ()
        self._on_done_flagged: tuple[tuple[Callable[[Any, Any], Any], bool], ...] = ()
        self._reloaders: tuple[Callable[[], None], ...] = ()
        self._appliers: tuple[Callable[[Any], Any], ...] = ()
        self._closers: tuple[Callable[[], Any], ...] = ()
        self._labels: dict[Any, str] = {}
        self._pending: set[asyncio.Task[None]] = set()

    # ---- start-up ------------------------------------------------------------------------------

    @classmethod
    def build(cls, settings: Any) -> Chain:
        """Import and resolve every hook. Raises HookConfigError naming the module or hook."""
        chain = cls()
        hooks_cfg = getattr(settings, "hooks", None) or HooksConfig()
        auth = getattr(settings, "auth", None)
        chain.auth_required = bool(auth is not None and auth.enabled)
        extra = list(hooks_cfg.modules)
        for spec in extra:
            if spec in BUILTIN_MODULES:
                raise HookConfigError(f"hooks.modules: {spec!r} is built in and always loaded")
        if len(set(extra)) != len(extra):
            raise HookConfigError(f"hooks.modules lists a module twice: {extra}")

        stages: dict[str, list[tuple[Callable[..., Any], bool, str]]] = {s: [] for s in STAGES}
        reloaders: list[Callable[[], None]] = []
        appliers: list[Callable[[Any], Any]] = []
        closers: list[Callable[[], Any]] = []
        names: list[str] = []
        for spec in (*BUILTIN_MODULES, *extra):
            regs = registrations(_import(spec))
            if not regs and spec not in BUILTIN_MODULES:
                raise HookConfigError(
                    f'hook module {spec!r} registered no hooks (use @hook("on_request") on a '
                    "function or @hook on a class)"
                )
            for reg in regs:
                chain._add(reg, settings, stages, reloaders, appliers, closers, names)

        def plain(stage: str) -> tuple[Callable[..., Any], ...]:
            return tuple(
                fn if not is_async else chain._spawner(fn, label)
                for fn, is_async, label in stages[stage]
            )

        chain._on_hello = tuple(fn for fn, _, _ in stages["on_hello"])
        chain._on_certificate = tuple(fn for fn, _, _ in stages["on_certificate"])
        chain._on_request_flagged = tuple((fn, a) for fn, a, _ in stages["on_request"])
        chain.is_async = any(a for _, a in chain._on_request_flagged)
        chain._on_request = () if chain.is_async else tuple(f for f, _ in chain._on_request_flagged)
        chain._on_refused = plain("on_refused")
        chain._on_done = plain("on_done")
        chain._on_done_flagged = tuple((fn, a) for fn, a, _ in stages["on_done"])
        chain._reloaders = tuple(reloaders)
        chain._appliers = tuple(appliers)
        chain._closers = tuple(closers)
        # (the spawners registered their own labels above)
        chain._labels.update({fn: label for entries in stages.values() for fn, _, label in entries})
        chain.names = tuple(names)
        log.info("hook chain: %s", ", ".join(names) or "(empty)")
        return chain

    def _add(
        self,
        reg: Registration,
        settings: Any,
        stages: dict[str, list[tuple[Callable[..., Any], bool, str]]],
        reloaders: list[Callable[[], None]],
        appliers: list[Callable[[Any], Any]],
        closers: list[Callable[[], Any]],
        names: list[str],
    ) -> None:
        label = _label(reg.target)
        if reg.stage is not None:
            stages[reg.stage].append(
                (reg.target, _check_signature(reg.target, reg.stage, label), label)
            )
            self.records |= reg.records
            names.append(f"{label}[{reg.stage}]")
            return
        try:
            instance = reg.target(settings)
        except HookConfigError:
            raise
        except Exception as exc:
            raise HookConfigError(
                f"hook {label} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        if getattr(instance, "enabled", True) is False:
            return
        for stage in STAGES:
            method = getattr(instance, stage, None)
            if method is not None:
                stages[stage].append((method, _check_signature(method, stage, label), label))
        reload = getattr(instance, "reload", None)
        if reload is not None:
            reloaders.append(reload)
        apply = getattr(instance, "apply_settings", None)
        if apply is not None:
            appliers.append(apply)
        closer = getattr(instance, "aclose", None) or getattr(instance, "close", None)
        if closer is not None:
            closers.append(closer)
        self.records |= bool(getattr(instance, "records", False))
        names.append(label)

    def _spawner(self, fn: Callable[..., Any], label: str) -> Callable[..., None]:
        """A plain callable that runs the async hook ``fn`` as a tracked task on the loop."""

        def spawn(*args: Any) -> None:
            coro = fn(*args)
            task = asyncio.get_running_loop().create_task(self._guard(coro, label))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        self._labels[spawn] = label
        return spawn

    @staticmethod
    async def _guard(coro: Any, label: str) -> None:
        try:
            await coro
        except Exception:
            log.exception("hook %s failed", label)

    @property
    def per_request(self) -> bool:
        """Whether any hook runs per request; when not, the server skips building a context."""
        return bool(self._on_request_flagged or self._on_done_flagged or self._on_refused)

    # ---- per connection ------------------------------------------------------------------------

    def anonymous(self) -> Principal:
        """The principal of a client when auth is off (shared; never mutate it)."""
        return self._anonymous

    def on_hello(self, key: bytes) -> Principal:
        """Resolve HELLO's key. Raises HookError(UNAUTHENTICATED) when auth is on and no hook
        accepted the key; with auth off an unrecognised key is the anonymous principal."""
        for fn in self._on_hello:
            try:
                principal = fn(key)
            except HookError:
                raise
            except Exception as exc:
                log.exception("hook %s failed", self._labels.get(fn, fn))
                raise HookError(INTERNAL, "authentication hook failed") from exc
            if principal is not None:
                return principal
        if self.auth_required:
            raise HookError(UNAUTHENTICATED, "invalid API key" if key else "missing API key")
        return self._anonymous

    def on_credentials(self, keys: list[bytes], certificate: Principal | None = None) -> Principal:
        """Every credential one client presents (the keys of each header or HELLO, and a
        verified certificate's principal) → its one principal. Each key is resolved on its own,
        so an invalid one is refused (UNAUTHENTICATED) whichever header carried it, even beside
        a valid one; two credentials that are different keys are refused too. With auth off
        every key is the anonymous principal, so nothing is refused."""
        principals = [self.on_hello(key) for key in keys] or [self.on_hello(b"")]
        if certificate is not None and self.auth_required:
            principals.append(certificate)
        first = principals[0]
        if any(other.key_id != first.key_id for other in principals[1:]):
            raise HookError(UNAUTHENTICATED, "the credentials presented are different keys")
        return first

    def on_certificate(self, names: tuple[str, ...]) -> Principal | None:
        """The principal a verified client certificate (its CN and SANs) stands for, or None."""
        for fn in self._on_certificate:
            try:
                principal = fn(names)
            except Exception:
                log.exception("hook %s failed", self._labels.get(fn, fn))
                return None
            if principal is not None:
                return principal
        return None

    # ---- per request ---------------------------------------------------------------------------

    def on_request(self, ctx: RequestContext) -> CachedResponse | None:
        """Run the on_request hooks in order (only when ``not is_async``). Returns a cached answer
        or None (go to the engine); raises HookError to refuse. After a refusal the on_refused
        hooks have run (e.g. the rate limiter gave its reservation back)."""
        fn = None
        try:
            for fn in self._on_request:
                cached: CachedResponse | None = fn(ctx)
                if cached is not None:
                    return cached
        except Exception as exc:
            self._refuse(ctx, fn, exc)
        if self.is_async:  # its _on_request is empty: refuse loudly rather than skip the hooks
            raise RuntimeError("this chain has async hooks: await on_request_async")
        return None

    async def on_request_async(self, ctx: RequestContext) -> CachedResponse | None:
        """on_request for a chain with async hooks (works for any chain)."""
        fn = None
        try:
            for fn, is_async in self._on_request_flagged:
                cached: CachedResponse | None = fn(ctx)
                if is_async:
                    cached = await cached  # type: ignore[misc]  # the hook is async: a coroutine
                if cached is not None:
                    return cached
        except Exception as exc:
            self._refuse(ctx, fn, exc)
        return None

    def _refuse(self, ctx: RequestContext, fn: Any, exc: Exception) -> NoReturn:
        """A hook refused (HookError) or crashed (→ INTERNAL): run on_refused, raise the error."""
        if isinstance(exc, HookError):
            self._refused(ctx, exc)
            raise exc
        err = self._internal(fn, exc)
        self._refused(ctx, err)
        raise err from exc

    def _internal(self, fn: Any, exc: Exception) -> HookError:
        label = self._labels.get(fn, repr(fn))
        log.error("hook %s failed: %s: %s", label, type(exc).__name__, exc, exc_info=exc)
        return HookError(INTERNAL, f"hook {label} failed")

    def _refused(self, ctx: RequestContext, err: HookError) -> None:
        for fn in self._on_refused:
            try:
                fn(ctx, err)
            except Exception:
                log.exception("hook %s failed", self._labels.get(fn, fn))

    def on_done(self, ctx: RequestContext, result: Completion) -> None:
        """Tell every on_done hook how a request that passed on_request ended. Never raises;
        async hooks are started as tasks and finish after this returns."""
        for fn in self._on_done:
            try:
                fn(ctx, result)
            except Exception:
                log.exception("hook %s failed", self._labels.get(fn, fn))

    async def on_done_async(self, ctx: RequestContext, result: Completion) -> None:
        """on_done that returns only when every hook, async ones included, has finished (for
        tests and benchmarks; the server uses on_done)."""
        for fn, is_async in self._on_done_flagged:
            try:
                r = fn(ctx, result)
                if is_async:
                    await r
            except Exception:
                log.exception("hook %s failed", self._labels.get(fn, fn))

    # ---- lifecycle -----------------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: re-read the keys file (and whatever else hooks reload). Never raises; a bad
        file keeps the previous state and is logged."""
        for fn in self._reloaders:
            try:
                fn()
            except Exception:
                log.exception("hook reload failed")

    def apply_settings(self, settings: Any) -> set[str]:
        """SIGHUP with a re-read config: each hook applies what it can change live and returns
        those dotted keys (``ratelimit.default_rpm``, ...). Never raises."""
        applied: set[str] = set()
        for fn in self._appliers:
            try:
                applied.update(fn(settings) or ())
            except Exception:
                log.exception("hook apply_settings failed")
        return applied

    async def drain(self) -> None:
        """Wait for on_done/on_refused tasks still running."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def aclose(self) -> None:
        """Shutdown on the event loop: finish pending hook tasks, then close every hook (Redis
        connections included). What the server calls."""
        await self.drain()
        for fn in self._closers:
            try:
                r = fn()
                if inspect.isawaitable(r):
                    await r
            except Exception:
                log.exception("hook close failed")
        self._closers = ()

    def close(self) -> None:
        """Shutdown without an event loop: closes synchronous hooks only. A chain with async
        hooks must be closed with ``await aclose()`` on its loop."""
        for fn in self._closers:
            if inspect.iscoroutinefunction(fn):
                continue
            try:
                fn()
            except Exception:
                log.exception("hook close failed")
        self._closers = ()
