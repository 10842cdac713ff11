"""benchmarks/scale.py's parts: the Q4_K_M file writer (read back by the gguf package and
accepted by the engine's header check), the fresh prompts, and the table it writes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks import scale
from benchmarks._support import fresh_prompts, llama_files
from benchmarks._support.busy import busy_core
from zerolayer.client.bench.workload import load_file
from zerolayer.models.gguf_import import check_header, read_header

TIED = llama_files.Shape(16, 256, 4, 2, 64, 512, 1024, tied=True)
UNTIED = llama_files.Shape(3, 256, 4, 2, 64, 512, 1024, tied=False)


def test_use_more_bits_is_llama_cpps_rule():
    # first and last eighth, every third layer between (llama-quant.cpp's use_more_bits)
    assert [i for i in range(16) if llama_files.use_more_bits(i, 16)] == [
        0,
        1,
        4,
        7,
        10,
        13,
        14,
        15,
    ]
    assert [i for i in range(32) if llama_files.use_more_bits(i, 32)] == [
        0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31,
    ]  # fmt: skip


@pytest.mark.parametrize("shape", [TIED, UNTIED], ids=["tied", "untied"])
def test_written_file_has_the_q4_k_m_mix(tmp_path, shape):
    path = tmp_path / "m.gguf"
    llama_files.write_model(shape, path, rope_freqs=True)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert ("output.weight" in types) == (not shape.tied)
    assert types["token_embd.weight"] == ("Q6_K" if shape.tied else "Q4_K")
    if not shape.tied:
        assert types["output.weight"] == "Q6_K"
    assert types["rope_freqs.weight"] == "F32"
    for i in range(shape.layers):
        more = "Q6_K" if llama_files.use_more_bits(i, shape.layers) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == more
        assert types[f"blk.{i}.ffn_down.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # gguf's order: in, out
    assert shapes["blk.0.attn_k.weight"] == [shape.hidden, shape.kv_heads * shape.head_dim]
    assert shapes["blk.0.ffn_down.weight"] == [shape.intermediate, shape.hidden]
    matrices = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
    assert matrices == llama_files.file_bytes(shape)
    q = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    w = gguf.quants.dequantize(q.data, q.tensor_type)
    assert w.shape == (shape.intermediate, shape.hidden) and np.isfinite(w).all()
    assert 0.005 < float(w.std()) < 0.05  # the N(0, 0.02) weights, through the blocks
    rope = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    assert rope[0] == 1.0 and rope[-1] == 32.0  # high frequencies kept, low ones divided


def test_the_engine_accepts_the_header(tmp_path):
    path = tmp_path / "m.gguf"
    llama_files.write_model(UNTIED, path)
    check_header(read_header(path), path)  # raises GGUFImportError for a file it refuses


def test_fresh_prompts_are_new_each_round_and_exact(tmp_path):
    path = tmp_path / "m.gguf"
    llama_files.write_model(UNTIED, path)
    ids = fresh_prompts.normal_tokens(path)
    assert len(ids) == UNTIED.vocab - llama_files.SPECIAL_TOKENS  # no control token
    seeds = [fresh_prompts.seed_for("1b", r, 8, 38) for r in range(3)]
    assert len(set(seeds)) == 3 and seeds[0] == fresh_prompts.seed_for("1b", 0, 8, 38)
    rounds = [fresh_prompts.token_prompts(4, 16, ids, s) for s in seeds]
    assert rounds[0] == fresh_prompts.token_prompts(4, 16, ids, seeds[0])  # a rerun: the same
    assert all(a != b for a, b in zip(rounds[0], rounds[1], strict=True))
    assert all(len(p) == 16 and set(p) <= set(ids.tolist()) for r in rounds for p in r)
    file = fresh_prompts.write_prompts(
        tmp_path / "p.jsonl", count=3, length=16, max_tokens=5, ids=ids, seed=seeds[2]
    )
    items = load_file(file, None, np.random.default_rng(0))
    assert [i.prompt_ids for i in items] == rounds[2][:3]
    assert {i.max_tokens for i in items} == {5}
    with pytest.raises(ValueError, match="no token ids"):
        fresh_prompts.token_prompts(1, 4, np.array([], dtype=int), 0)


def _run(tps: float, tpot: float, load: float) -> dict:
    return {
        "output_tokens_per_s": tps, "median_tpot_ms": tpot, "p99_ttft_ms": 2 * tpot,
        "median_ttft_ms": tpot, "prompt_tokens": [128, 128], "failed": 0, "completed": 2,
        "load_average_1m_before": load, "load_average_1m": load + 1,
    }  # fmt: skip


def test_table_shows_every_rounds_range_and_the_roofline_at_one_stream():
    results = {
        "machine": {"cpu": "CPU", "cores": 2, "memory_gib": 23, "python": "3.11", "os": "Linux",
                    "commit": "abc", "date": "today", "load_average_1m": 3.0},
        "bandwidth_gbs": 20.0,
        "peers": {"llama-server": "/bin/llama-server"},
        "args": {"command": "--sizes 1b", "input_len": 128, "output_len": 64, "slots": 32,
                 "context": 512, "threads": 1, "rounds": 2, "modes": {"ZeroLayer": ""}},
        "sizes": {
            "1b": {"file": "f", "file_mib": 765, "parameters": 1.24e9, "block_bytes": 8e8,
                   "servers": {"ZeroLayer": {"start_s": [30.0, 5.0], "peak_rss_mib": 900.0,
                                             "runs": {"1": [_run(10, 100, 2), _run(8, 50, 3)],
                                                      "8": [_run(40, 200, 2), _run(40, 200, 2)]}}}},
            "8b": {"file": "g", "file_mib": 4700, "parameters": 8e9, "block_bytes": 4e9,
                   "servers": {}, "skipped": "2.0 GiB available"},
        },
    }  # fmt: skip
    md = scale.markdown(results)
    rows = [line for line in md.splitlines() if line.startswith("| 1b")]
    assert len(rows) == 2
    one = [c.strip() for c in rows[0].split("|")[1:-1]]
    # 8e8 bytes at 100 ms and 50 ms a token against 20 GB/s: 40% and 80%
    assert one[2:] == ["1", "8.0–10.0", "50–100", "100–200", "128", "900", "30.0 / 5.0",
                       "40–80%", "2.0–3.0 → 3.0–4.0"]  # fmt: skip
    eight = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert eight[3] == "40.0" and eight[9] == ""  # one value when the rounds agree; no roofline
    assert "Skipped: 8b: 2.0 GiB available." in md
    assert "1-minute load average 3.0" in md and "1 thread(s)" in md
    json.dumps(results)  # what --write stores


def test_a_mode_sets_zerolayers_settings_and_openmps_only():
    label, settings = scale.parse_mode("spin:ZEROLAYER_ENGINE__THREADS=2,GOMP_SPINCOUNT=300000")
    assert label == "spin"
    assert settings == {"ZEROLAYER_ENGINE__THREADS": "2", "GOMP_SPINCOUNT": "300000"}
    assert scale.parse_mode("p:OMP_WAIT_POLICY=ACTIVE")[1] == {"OMP_WAIT_POLICY": "ACTIVE"}
    with pytest.raises(SystemExit, match="NAME one of"):
        scale.parse_mode("x:PATH=/bin")


def test_the_busy_core_spins_on_its_cpu_until_the_block_ends():
    cpu = max(os.sched_getaffinity(0))
    with busy_core(cpu) as pid:
        for _ in range(200):  # the child pins itself first thing; wait for it, not for a time
            if os.sched_getaffinity(pid) == {cpu}:
                break
            time.sleep(0.05)
        assert os.sched_getaffinity(pid) == {cpu}
        assert Path(f"/proc/{pid}/stat").read_text().split()[2] in "RS"
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
