"""Grammar engines for structured output, measured side by side: xgrammar, llguidance,
outlines-core on SmolLM2's vocabulary (49152 tokens).

For each of the 50 schemas of benchmarks/json_schemas.py and each engine (in rotating order, so
load on the shared machine falls on all three alike), a child process (killed after --timeout):

- compile: schema text -> the first token mask filled (xgrammar compiles up front, llguidance
  lazily, outlines-core builds a regex DFA index; this counts each the same way);
- walks the schema's instance (compact JSON, tokenized by the model's tokenizer) at 32 rows:
  every step fills 32 rows' bitmasks (one thread, the timed part), checks the instance's next
  token is allowed, and accepts it on every row; at the end EOS must be allowed;
- coverage: the schema compiled and its instance's every token and EOS were allowed.

The engines are not our dependencies (only the winner is, in the cpu extra): run it from a
scratch virtualenv holding the three, e.g.

    python -m venv /tmp/grammar-venv
    /tmp/grammar-venv/bin/pip install torch==2.13.0 tokenizers transformers jsonschema \\
        xgrammar llguidance outlines-core
    /tmp/grammar-venv/bin/python benchmarks/grammar.py --tokenizer DIR [--write]

DIR is a converted checkpoint directory (tokenizer.json, tokenizer_config.json), e.g. the one
``zerolayer.models.gguf_import.ensure_converted`` makes for the default model.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402
from json_schemas import CASES  # noqa: E402

ROWS = 32
ENGINES = ["xgrammar", "llguidance", "outlines-core"]


def _byte_vocab(tok: Any) -> list[bytes]:
    """Each id's bytes for a byte-level BPE vocabulary (GPT-2's byte <-> char map)."""
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    table = dict(zip(chars, chars, strict=True))
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    inverse = {chr(c): b for b, c in table.items()}
    vocab = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        try:
            vocab.append(bytes(inverse[ch] for ch in piece))
        except KeyError:  # a special token: plain text
            vocab.append(piece.encode())
    return vocab


class _Engine:
    """One engine's compile / matcher / fill / accept, on a shared int32 [ROWS, words] mask."""

    def __init__(self, name: str, directory: Path, eos: int) -> None:
        import torch
        from tokenizers import Tokenizer

        self.name, self.eos, self.torch = name, eos, torch
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.vocab = self.tok.get_vocab_size()
        self.words = (self.vocab + 31) // 32
        if name == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo(_byte_vocab(self.tok), xgr.VocabType.RAW, stop_token_ids=[eos])
            self.xgr = xgr
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        elif name == "llguidance":
            import llguidance

            self.llg = llguidance
            text = (directory / "tokenizer.json").read_text()
            self.lltok = llguidance.LLTokenizer(text, eos_token=eos)
        else:
            import outlines_core

            self.oc = outlines_core
            vocab: dict[bytes, list[int]] = {}
            for i, piece in enumerate(_byte_vocab(self.tok)):
                if i != eos and self.tok.id_to_token(i) not in ("<|im_start|>", "<|endoftext|>"):
                    vocab.setdefault(piece, []).append(i)
            self.ocvocab = outlines_core.Vocabulary(eos, vocab)
        self.warm_up()

    def warm_up(self) -> None:
        """Once per tokenizer, as a server would at start-up: whatever an engine precomputes
        over the vocabulary (llguidance's token slices) is not a schema's compile time."""
        mask = self.torch.zeros(1, self.words, dtype=self.torch.int32)
        self.fill(self.matcher(self.compile('{"type": "integer"}')), mask, 0)

    def compile(self, schema: str) -> Any:
        if self.name == "xgrammar":
            return self.compiler.compile_json_schema(schema)
        if self.name == "llguidance":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
            err = self.llg.LLMatcher.validate_grammar(grammar, self.lltok)
            if err:
                raise ValueError(err)
            return grammar
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Index(regex, self.ocvocab)

    def matcher(self, compiled: Any) -> Any:
        if self.name == "xgrammar":
            return self.xgr.GrammarMatcher(compiled)
        if self.name == "llguidance":
            m = self.llg.LLMatcher(self.lltok, compiled)
            if m.is_error():
                raise ValueError(m.get_error())
            return m
        return self.oc.Guide(compiled)

    def fill(self, m: Any, mask: Any, row: int) -> None:
        if self.name == "xgrammar":
            m.fill_next_token_bitmask(mask, row)
        elif self.name == "llguidance":
            import llguidance.torch as lt

            lt.fill_next_token_bitmask(m, mask, row)
        else:
            m.write_mask_into(mask[row].data_ptr(), self.words, 4)

    def accept(self, m: Any, token: int) -> bool:
        if self.name == "xgrammar":
            return bool(m.accept_token(token))
        if self.name == "llguidance":
            return bool(m.consume_token(token)) and not m.is_error()
        try:
            m.advance(token)
        except ValueError:
            return False
        return True


def _allowed(mask: Any, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def _run_case(engine: str, directory: str, eos: int, schema: dict, instance: Any, out: Any) -> None:
    """In a child process: one engine on one schema; sends a result dict through ``out``."""
    result: dict[str, Any] = {"engine": engine, "compiled": False, "valid_path": False}
    try:
        e = _Engine(engine, Path(directory), eos)
        mask = e.torch.zeros(ROWS, e.words, dtype=e.torch.int32)
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = e.compile(text)
        matchers = [e.matcher(compiled) for _ in range(ROWS)]
        e.fill(matchers[0], mask, 0)
        result["compile_ms"] = (time.perf_counter() - t0) * 1e3
        result["compiled"] = True
        ids = e.tok.encode(
            json.dumps(instance, separators=(",", ":")), add_special_tokens=False
        ).ids
        step_ms = []
        ok = True
        for token in [*ids, eos]:
            t0 = time.perf_counter()
            for row, m in enumerate(matchers):
                e.fill(m, mask, row)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if not _allowed(mask, 0, token):
                ok = False
                result["refused_at"] = len(step_ms) - 1
                break
            if token != eos and not all(e.accept(m, token) for m in matchers):
                ok = False
                break
        result["valid_path"] = ok
        result["steps"] = len(step_ms)
        result["mask_ms_per_step"] = statistics.median(step_ms)
    except Exception as exc:  # the engine refused the schema: counted, with its reason
        result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out.send(result)


def _measure(
    engine: str, directory: str, eos: int, schema: dict, instance: Any, timeout: float
) -> dict:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_case, args=(engine, directory, eos, schema, instance, child))
    proc.start()
    got = parent.poll(timeout)
    result = (
        parent.recv()
        if got
        else {
            "engine": engine,
            "compiled": False,
            "valid_path": False,
            "error": f"timeout after {timeout:.0f} s",
        }
    )
    proc.kill()
    proc.join()
    return result


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = _report.parser(__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="checkpoint directory with tokenizer.json")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per engine and schema")
    ap.add_argument("--limit", type=int, default=len(CASES), help="first N schemas only")
    args = ap.parse_args()
    directory = Path(args.tokenizer)
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    eos_text = cfg.get("eos_token")
    eos_text = eos_text.get("content") if isinstance(eos_text, dict) else eos_text
    eos = int(vocab[eos_text])
    versions = {}
    for name, mod in (
        ("xgrammar", "xgrammar"),
        ("llguidance", "llguidance"),
        ("outlines-core", "outlines_core"),
    ):
        from importlib.metadata import version

        versions[name] = version(mod)
    machine = _report.machine()
    per_case: list[dict] = []
    for n, (name, schema, instance) in enumerate(CASES[: args.limit]):
        order = ENGINES[n % 3 :] + ENGINES[: n % 3]
        for engine in order:
            r = _measure(engine, str(directory), eos, schema, instance, args.timeout)
            r["schema"] = name
            per_case.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    summary = {}
    rows = []
    for engine in ENGINES:
        rs = [r for r in per_case if r["engine"] == engine]
        compiled = [r for r in rs if r["compiled"]]
        valid = [r for r in rs if r["valid_path"]]
        compile_ms = [r["compile_ms"] for r in compiled]
        mask_ms = [r["mask_ms_per_step"] for r in compiled if "mask_ms_per_step" in r]
        s = {
            "version": versions[engine],
            "schemas": len(rs),
            "compiled": len(compiled),
            "covered": len(valid),
            "compile_ms_median": statistics.median(compile_ms) if compile_ms else None,
            "compile_ms_p90": _pct(compile_ms, 0.9),
            "compile_ms_max": max(compile_ms, default=None),
            "mask_ms_per_step_32_rows_median": statistics.median(mask_ms) if mask_ms else None,
            "mask_ms_per_step_32_rows_p90": _pct(mask_ms, 0.9),
            "failures": {
                r["schema"]: r.get("error", f"refused the instance at token {r.get('refused_at')}")
                for r in rs
                if not r["valid_path"]
            },
        }
        summary[engine] = s
        rows.append(
            [
                f"{engine} {s['version']}",
                f"{s['covered']}/{s['schemas']}",
                f"{s['compile_ms_median']:.1f}" if compile_ms else "-",
                f"{s['compile_ms_p90']:.1f}" if compile_ms else "-",
                f"{s['mask_ms_per_step_32_rows_median']:.2f}" if mask_ms else "-",
                f"{s['mask_ms_per_step_32_rows_p90']:.2f}" if mask_ms else "-",
            ]
        )
    md = "\n".join(
        [
            "## Grammar engines for structured output (`benchmarks/grammar.py`)",
            "",
            f"{len(per_case) // 3} JSON Schemas of varied shape (benchmarks/json_schemas.py) on "
            f"SmolLM2-135M-Instruct's vocabulary ({len(vocab)} tokens). Compile = schema text to "
            "the "
            "first token mask filled, caches off. Mask = one decode step's bitmasks for 32 rows, "
            "filled one after another on one thread, along each schema's instance (compact JSON). "
            "Covered = compiled, and every token of the instance and EOS allowed. Each engine ran "
            "with its default JSON options; the engines ran in rotating order per schema, each in "
            "its own child process, on a machine shared with other engineers' jobs (2 cores), so "
            "the times carry their load.",
            "",
            _report.table(
                [
                    "engine",
                    "covered",
                    "compile ms (median)",
                    "compile ms (p90)",
                    "mask ms/step, 32 rows (median)",
                    "(p90)",
                ],
                rows,
            ),
            "",
            "Not covered: "
            + "; ".join(
                f"{e}: " + ", ".join(f"{k} ({v[:80]})" for k, v in summary[e]["failures"].items())
                for e in ENGINES
                if summary[e]["failures"]
            )
            if any(summary[e]["failures"] for e in ENGINES)
            else "Every schema covered by every engine.",
            "",
            _report.machine_line(machine),
        ]
    )
    _report.publish(
        args, "grammar", {"machine": machine, "summary": summary, "cases": per_case}, md
    )


if __name__ == "__main__":
    main()
