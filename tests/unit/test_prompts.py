"""Precompiled system prompts: validation, the registry, compile() into pinned prefix-store
entries on real backends, and the correctness guarantee (a request reusing a registered prompt's
KV == the same ids prefilled without any store, token for token) on the built-in model and on a
transformers-made checkpoint, through the real Engine."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.support.checkpoint import SPECIAL, checkpoint_backend
from tests.support.engine_run import run_engine
from tests.support.kv import reserve, slot_kv
from zerolayer.config.prompts import PromptEntry, resolve_prompt_files
from zerolayer.config.settings import BUILTIN_MODEL, EngineConfig, ModelConfig
from zerolayer.engine.backend import Backend, ModelInfo
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Sequence
from zerolayer.engine.kv_pages import pages_for
from zerolayer.engine.prefix_store import BLOCK_TOKENS, PrefixStore
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.request_path.prompts import (
    MAX_PROMPT_CHARS,
    CompiledPrompt,
    PromptConfigError,
    PromptRegistry,
    dynamic_variable,
    extends,
    system_ids,
    text_problems,
)
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer, Tokenizer

TOK = ByteTokenizer()
SYSTEM = "You are a terse assistant. Answer in one short sentence and never apologise."

# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("You are a helpful assistant on {date}", "{date}"),
        ("Today is {current_date}.", "{current_date}"),
        ("Hello {{user}}, welcome", "{{user}}"),
        ("Hi {{ user.name }}!", "{{ user.name }}"),
        ("{% if vip %}Be nice{% endif %}", "{% if vip %}"),
        ("Home is ${HOME}", "${HOME}"),
        ("Argument {0} first", "{0}"),
        ("Dear {user.first_name}", "{user.first_name}"),
    ],
)
def test_dynamic_variables_are_found(text: str, found: str) -> None:
    assert dynamic_variable(text) == found
    assert text_problems(text) == [f"dynamic variable {found} not allowed in compiled prompt"]


@pytest.mark.parametrize(
    "text",
    [
        'Answer as JSON like {"answer": 42}.',
        "An empty object is {} and a set is {1, 2}.",
        "Use braces { like this } sparingly.",
        SYSTEM,
    ],
)
def test_braces_that_are_not_variables_pass(text: str) -> None:
    assert dynamic_variable(text) is None
    assert text_problems(text) == []


def test_length_limit_is_inclusive() -> None:
    assert text_problems("a" * MAX_PROMPT_CHARS) == []
    assert text_problems("a" * (MAX_PROMPT_CHARS + 1)) == [
        f"prompt is {MAX_PROMPT_CHARS + 1} characters; the limit is {MAX_PROMPT_CHARS}"
    ]
    # Characters, not bytes: 4096 two-byte characters are allowed.
    assert text_problems("é" * MAX_PROMPT_CHARS) == []


@pytest.mark.parametrize("text", ["", "   ", "\n\t\n"])
def test_empty_prompts_are_rejected(text: str) -> None:
    assert text_problems(text) == ["empty prompt"]


def test_system_ids_are_the_chat_templates_system_part_with_bos() -> None:
    ids = system_ids(TOK, SYSTEM)
    assert ids.dtype == np.int32
    assert ids[0] == ByteTokenizer.BOS
    assert bytes(ids[1:].tolist()).decode() == f"<|system|>\n{SYSTEM}\n"
    # A chat with this system prompt starts with exactly these ids.
    chat = TOK.encode_prompt(TOK.render_chat([{"role": "user", "content": "Hi"}], SYSTEM))
    assert np.array_equal(chat[: len(ids)], ids)


# --------------------------------------------------------------------------- entries and build


def test_entry_needs_exactly_one_source_and_a_valid_id() -> None:
    with pytest.raises(ValueError, match="exactly one of text and file"):
        PromptEntry(id=1, name="a")
    with pytest.raises(ValueError, match="exactly one of text and file"):
        PromptEntry(id=1, name="a", text="x", file="y")
    for bad_id in (0, -1, 2**32):
        with pytest.raises(ValueError):
            PromptEntry(id=bad_id, name="a", text="x")
    with pytest.raises(ValueError):
        PromptEntry(id=1, name="", text="x")
    with pytest.raises(ValueError, match="Extra inputs"):
        PromptEntry.model_validate({"id": 1, "name": "a", "text": "x", "txt": "y"})
    assert PromptEntry(id=2**32 - 1, name="a", text="x").id == 2**32 - 1


def build(entries: list, **kw) -> PromptRegistry:
    kw.setdefault("base_dir", ".")
    return PromptRegistry.build(entries, TOK, **kw)


def test_build_names_the_bad_prompt_and_the_reason() -> None:
    with pytest.raises(PromptConfigError) as err:
        build(
            [
                {"id": 1, "name": "fine", "text": SYSTEM},
                {"id": 7, "name": "dated", "text": "You are a helpful assistant on {date}"},
            ]
        )
    msg = str(err.value)
    assert 'prompt 7 "dated": dynamic variable {date} not allowed in compiled prompt' in msg
    assert "fine" not in msg


def test_build_reports_every_bad_prompt_at_once() -> None:
    with pytest.raises(PromptConfigError) as err:
        build(
            [
                {"id": 1, "name": "empty", "text": "  "},
                {"id": 2, "name": "long", "text": "x" * 5000},
                {"id": 3, "name": "ok", "text": SYSTEM},
                {"id": 0, "name": "zero", "text": SYSTEM + "!"},
            ]
        )
    msg = str(err.value)
    assert 'prompt 1 "empty": empty prompt' in msg
    assert 'prompt 2 "long": prompt is 5000 characters; the limit is 4096' in msg
    assert "prompts[3]: id:" in msg


def test_duplicates_are_rejected() -> None:
    with pytest.raises(PromptConfigError, match='prompt 1 "b": id 1 is also used by prompt 1 "a"'):
        build([{"id": 1, "name": "a", "text": "one"}, {"id": 1, "name": "b", "text": "two"}])
    with pytest.raises(
        PromptConfigError, match='prompt 2 "a": name "a" is also used by prompt 1 "a"'
    ):
        build([{"id": 1, "name": "a", "text": "one"}, {"id": 2, "name": "a", "text": "two"}])
    with pytest.raises(PromptConfigError, match='prompt 2 "b": same text as prompt 1 "a"'):
        build([{"id": 1, "name": "a", "text": "one"}, {"id": 2, "name": "b", "text": "one"}])


def test_token_budget_is_checked_with_the_models_tokenizer() -> None:
    n = len(system_ids(TOK, SYSTEM))
    assert len(build([{"id": 1, "name": "a", "text": SYSTEM}], max_prefix_tokens=n)) == 1
    with pytest.raises(PromptConfigError) as err:
        build([{"id": 1, "name": "a", "text": SYSTEM}], max_prefix_tokens=n - 1)
    assert (
        f'prompt 1 "a": prompt is {n} tokens; the prefix budget is {n - 1} tokens '
        "(engine.max_prefix_tokens)"
    ) in str(err.value)


def test_file_entries(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rel.txt").write_text(SYSTEM + "\n")  # the final line break is dropped
    absolute = tmp_path / "abs.txt"
    absolute.write_text("Absolute prompt.")
    reg = build(
        [
            {"id": 1, "name": "rel", "file": "sub/rel.txt"},
            {"id": 2, "name": "abs", "file": str(absolute)},
        ],
        base_dir=tmp_path,
    )
    assert reg.by_id(1).text == SYSTEM
    assert reg.by_id(2).text == "Absolute prompt."

    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(PromptConfigError) as err:
        build(
            [
                {"id": 3, "name": "bad", "file": "bad.txt"},
                {"id": 4, "name": "gone", "file": "missing.txt"},
            ],
            base_dir=tmp_path,
        )
    msg = str(err.value)
    assert f'prompt 3 "bad": {tmp_path / "bad.txt"}: invalid UTF-8 at byte 3' in msg
    assert f'prompt 4 "gone": cannot read file {tmp_path / "missing.txt"}' in msg


def test_resolve_prompt_files_anchors_relative_paths_at_the_config(tmp_path: Path) -> None:
    data = {
        "prompts": [
            {"id": 1, "name": "a", "file": "a.txt"},
            {"id": 2, "name": "b", "file": "/etc/b.txt"},
            {"id": 3, "name": "c", "text": "x"},
        ]
    }
    resolve_prompt_files(data, tmp_path)
    assert data["prompts"][0]["file"] == str(tmp_path / "a.txt")
    assert data["prompts"][1]["file"] == "/etc/b.txt"
    assert "file" not in data["prompts"][2]


def test_lookup_by_id() -> None:
    reg = build([{"id": 5, "name": "terse", "text": SYSTEM}, {"id": 9, "name": "b", "text": "B."}])
    c = reg.by_id(5)
    assert c is not None and c.name == "terse"
    assert reg.by_id(6) is None and reg.by_id(9).text == "B."
    assert c.pinned_tokens == len(c.ids) - 1
    assert not c.ids.flags.writeable


def test_extends_is_token_for_token() -> None:
    prefix = np.array([256, 10, 11], np.int32)
    assert extends(np.array([256, 10, 11, 12], np.int32), prefix)
    assert extends(prefix, prefix)
    assert not extends(np.array([256, 10], np.int32), prefix)
    assert not extends(np.array([256, 10, 12, 12], np.int32), prefix)


# --------------------------------------------------------------------------- compile()


def kv(tokens: int) -> int:
    """The synthetic backend's KV bytes of a pinned prompt of ``tokens`` (all but its last
    pinned): whole pages of 16 positions, 8 bytes each."""
    return 128 * pages_for(tokens - 1)


def synthetic_store(slots: int = 2, max_context: int = 512, capacity: int = 0) -> PrefixStore:
    return PrefixStore(SyntheticBackend(slots, vocab_size=259, max_context=max_context), capacity)


def test_compile_on_synthetic_backend_and_its_budget() -> None:
    reg = build([{"id": 1, "name": "a", "text": SYSTEM}, {"id": 2, "name": "b", "text": "B."}])
    store = synthetic_store()
    facts = reg.compile(store, chunk=16)
    # Every token but the last is pinned, in pages (kv).
    n1, n2 = len(reg.by_id(1).ids), len(reg.by_id(2).ids)
    assert facts == [
        {"id": 1, "name": "a", "tokens": n1, "kv_bytes": kv(n1)},
        {"id": 2, "name": "b", "tokens": n2, "kv_bytes": kv(n2)},
    ]
    assert reg.compiled and reg.describe() == facts
    assert store.pinned_bytes == kv(n1) + kv(n2) and store.cached_bytes == 0

    small = build(
        [{"id": 1, "name": "a", "text": SYSTEM}, {"id": 2, "name": "b", "text": "B."}],
        budget_bytes=kv(n1) + 7,
    )
    with pytest.raises(PromptConfigError) as err:
        small.compile(synthetic_store())
    total = kv(n1) + kv(n2)
    needs = f'prompt 2 "b": its KV needs {kv(n2)} bytes, {total} bytes with the prompts'
    assert needs in str(err.value)
    assert "(engine.prefix_budget_bytes)" in str(err.value)


class NoPrefixBackend(Backend):
    """A backend like neuron's: slots and steps, no prefix save/load."""

    def __init__(self) -> None:
        self.num_slots = 1
        self.info = ModelInfo("n", 259, 257, 512)

    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        return np.full(len(chunks), -1, np.int32)

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        return np.zeros(batch.size, np.int32)


def test_backend_without_prefix_support_is_refused_only_with_prompts() -> None:
    # A backend that cannot save KV gets no store
    # (zerolayer.engine.backends.factory.build_prefix_store).
    with pytest.raises(
        PromptConfigError, match="precompiled prompts are not supported by the neuron backend"
    ):
        build([{"id": 1, "name": "a", "text": SYSTEM}]).compile(None, backend_name="neuron")
    with pytest.raises(ValueError, match="cannot save and load KV"):
        PrefixStore(NoPrefixBackend(), 1024)
    empty = build([])
    assert empty.compile(None, backend_name="neuron") == []
    assert empty.compiled and len(empty) == 0


def test_prompt_longer_than_the_context_is_refused() -> None:
    reg = build([{"id": 1, "name": "a", "text": SYSTEM}])
    with pytest.raises(PromptConfigError, match="leave no room in the context of 32"):
        reg.compile(synthetic_store(1, max_context=32))


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the built-in model is written once for this module."""
    return tmp_path_factory.mktemp("builtin")


@pytest.fixture(scope="module")
def builtin(builtin_dir: Path):
    from zerolayer.engine.backends.cpu import create_cpu_backend

    engine_cfg = EngineConfig(  # float32 KV, the parity mode: its byte counts are asserted
        max_batch_size=2, max_context=512, prefill_chunk=16, max_step_tokens=64, kv_dtype="float32"
    )
    return create_cpu_backend(
        ModelConfig(path=BUILTIN_MODEL, data_dir=str(builtin_dir)), engine_cfg
    )


def test_compile_on_cpu_backend_pins_the_kv_of_all_but_the_last_token(builtin) -> None:
    backend, tok = builtin
    reg = PromptRegistry.build(
        [{"id": 3, "name": "terse", "text": SYSTEM}], tok, budget_bytes=10**9
    )
    store = PrefixStore(backend, 0)
    facts = reg.compile(store, chunk=16)
    c = reg.by_id(3)
    assert c.pinned_tokens % BLOCK_TOKENS, "this prompt ends mid-block: a pinned tail"
    layers, _, kv_heads, head_dim = backend.cache.k.shape
    held = pages_for(c.pinned_tokens) * 16  # whole pages, the tail's too
    assert c.kv_bytes == 2 * layers * kv_heads * held * head_dim * 4  # float32 k, v
    assert facts == [{"id": 3, "name": "terse", "tokens": len(c.ids), "kv_bytes": c.kv_bytes}]
    # The pinned KV equals a straight prefill of the same ids in one chunk in another slot.
    reserve(backend, 1, 0, len(c.ids) - 1)
    backend.prefill([PrefillChunk(1, c.ids[:-1], 0, False, SamplingParams())])
    assert store.load(np.concatenate([c.ids, [65]]).astype(np.int32), 0) == c.pinned_tokens
    n = c.pinned_tokens
    for pinned, straight in zip(slot_kv(backend, 0, 0, n), slot_kv(backend, 1, 0, n), strict=True):
        assert np.allclose(pinned.numpy(), straight.numpy(), atol=1e-5)
    backend.kv_pages.release(0)
    backend.kv_pages.release(1)
    # One byte under what the prompt needs: refused, naming the prompt.
    tight = PromptRegistry.build(
        [{"id": 3, "name": "terse", "text": SYSTEM}], tok, budget_bytes=c.kv_bytes - 1
    )
    with pytest.raises(PromptConfigError, match='prompt 3 "terse": its KV needs'):
        tight.compile(PrefixStore(backend, 0), chunk=16)


# --------------------------------------------------------------------------- correctness


def registered_and_inline(
    store: PrefixStore,
    tok: Tokenizer,
    c: CompiledPrompt,
    full: np.ndarray,
    max_tokens: int,
    sampling: SamplingParams | None = None,
) -> tuple[list, list]:
    """Outputs of ``full`` with the store holding the registered prompt (and nothing else: its
    LRU capacity is 0) and without any store, greedy unless given."""
    assert extends(full, c.ids), "the prompt's ids must prefix the request's"
    backend = store.backend
    row = sampling or SamplingParams()

    def registered() -> Sequence:
        return Sequence(1, full, max_tokens, row)

    # Alone, then side by side in one batch (different slots, shared steps).
    seq = registered()
    alone = run_engine(backend, tok, [seq], store)[1]
    assert seq.reused == c.pinned_tokens
    inline = run_engine(backend, tok, [Sequence(2, full, max_tokens, row)])[2]
    together = run_engine(backend, tok, [Sequence(2, full, max_tokens, row), registered()], store)
    assert together[1] == alone and together[2] == inline
    return alone, inline


# Seeded sampling at temperature 1 draws from the whole distribution, so it notices a changed
# logit even where greedy output is the same token over and over (as on the built-in model's
# random weights).
SAMPLED = SamplingParams(temperature=1.0, seed=1234)


def requests_for(tok: Tokenizer, c: CompiledPrompt) -> list[np.ndarray]:
    """A binary prompt_id request (prompt ids + user ids) and a JSON chat with the same system."""
    user = np.asarray(tok.encode(" and then some more words here"), np.int32)
    binary = np.concatenate([c.ids, user])
    chat = tok.encode_prompt(
        tok.render_chat([{"role": "user", "content": "What is a haiku?"}], c.text)
    )
    return [binary, chat]


def test_registered_prompt_output_is_identical_to_inline_on_the_builtin_model(builtin) -> None:
    backend, tok = builtin
    text = SYSTEM + " " + "Keep every reply under twenty words. " * 3
    reg = PromptRegistry.build([{"id": 1, "name": "p", "text": text}], tok)
    store = PrefixStore(backend, 0)
    reg.compile(store, chunk=16)
    c = reg.by_id(1)
    assert c.pinned_tokens > 3 * 16  # the prefix spans several chunks
    for full in requests_for(tok, c):
        registered, inline = registered_and_inline(store, tok, c, full, max_tokens=24)
        assert len(registered) == 25 and registered[-1] == ("end", 1)  # max_tokens, no early EOS
        assert registered == inline
        registered, inline = registered_and_inline(store, tok, c, full, 24, SAMPLED)
        assert len(set(registered[:-1])) > 5  # a varied stream, not one repeated token
        assert registered == inline


def test_registered_prompt_output_is_identical_to_inline_on_synthetic() -> None:
    store = synthetic_store()
    reg = build([{"id": 1, "name": "p", "text": SYSTEM}])
    reg.compile(store, chunk=16)
    c = reg.by_id(1)
    for full in requests_for(TOK, c):
        registered, inline = registered_and_inline(store, TOK, c, full, max_tokens=16)
        assert registered == inline and len(registered) == 17


# A tiny Llama checkpoint made with transformers, with a tokenizer.json whose chat template has
# real special tokens (as in tests/unit/test_parity.py, which has no template).


def test_registered_prompt_output_is_identical_to_inline_on_a_transformers_checkpoint(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    backend, tok = checkpoint_backend(tmp_path)
    text = "you are a terse assistant w40 w41 w42 answer in one short sentence " * 4
    reg = PromptRegistry.build([{"id": 2, "name": "t", "text": text.strip()}], tok)
    store = PrefixStore(backend, 0)
    reg.compile(store, chunk=16)
    c = reg.by_id(2)
    # The template's system part: BOS, the role token, the words, the end token; no <unk>.
    assert c.ids[0] == 0 and c.ids[1] == SPECIAL.index("<|system|>")
    assert c.ids[-1] == SPECIAL.index("<|end|>") and 2 not in c.ids.tolist()
    assert c.pinned_tokens > 2 * 16
    for full in requests_for(tok, c):
        registered, inline = registered_and_inline(store, tok, c, full, max_tokens=20)
        assert len(registered) >= 2
        assert registered == inline
        registered, inline = registered_and_inline(store, tok, c, full, 20, SAMPLED)
        assert registered == inline


# --------------------------------------------------------------------------- GET /prompts


def test_prompts_are_listed_on_the_metrics_port() -> None:
    from zerolayer.ops.health import start_http_server
    from zerolayer.ops.metrics import Metrics
    from zerolayer.ops.readiness import Health

    reg = build([{"id": 9, "name": "b", "text": "B."}, {"id": 4, "name": "a", "text": SYSTEM}])
    reg.compile(synthetic_store(1))
    handle = start_http_server("127.0.0.1", 0, Metrics(), Health(), reg.describe)
    plain = start_http_server("127.0.0.1", 0, Metrics(), Health())
    try:
        ids4, ids9 = reg.by_id(4).ids, reg.by_id(9).ids
        url = f"http://127.0.0.1:{handle.port}/prompts"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.headers["Content-Type"] == "application/json"
            body = json.loads(resp.read())
        assert body == {
            "prompts": [
                {"id": 4, "name": "a", "tokens": len(ids4), "kv_bytes": kv(len(ids4))},
                {"id": 9, "name": "b", "tokens": len(ids9), "kv_bytes": kv(len(ids9))},
            ]
        }
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{plain.port}/prompts", timeout=10)
        assert err.value.code == 404
    finally:
        handle.close()
        plain.close()


# --------------------------------------------------------------------------- end to end
