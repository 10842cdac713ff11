"""Checkpoint loading: clear errors, sharded weights, tokenizer files, the built-in model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.kv import reserving
from zerolayer.config.settings import BUILTIN_MODEL, EngineConfig, ModelConfig
from zerolayer.engine.backends.cpu import create_cpu_backend
from zerolayer.engine.types import PrefillChunk
from zerolayer.models import builtin
from zerolayer.models.architectures import DecoderConfig
from zerolayer.models.decoder import Decoder
from zerolayer.models.hf_tokenizer import HFTokenizer
from zerolayer.models.loader import ModelLoadError, load_checkpoint, load_model
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
WORDS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "hello", "world", "<unk>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def hf_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.from_hf(cfg), 16)
    return {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()}


def write_tokenizer(directory: Path, bos_post_processor: bool = False) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), 16)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(WORDS[:3])
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
        )
    tok.save(str(directory / "tokenizer.json"))


def write_checkpoint(directory: Path, cfg: dict | None = None, shards: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = cfg or HF_CONFIG
    (directory / "config.json").write_text(json.dumps(cfg))
    tensors = hf_tensors(cfg)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(directory / file))
            weight_map.update({n: file for n in part})
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(directory)
    return directory


def test_loads_single_and_sharded_checkpoints(tmp_path: Path) -> None:
    one = load_checkpoint(write_checkpoint(tmp_path / "one"), max_context=128)
    three = load_checkpoint(write_checkpoint(tmp_path / "three", shards=3), max_context=128)
    assert one.name == "one"
    assert one.max_context == 64  # capped at max_position_embeddings
    for a, b in zip(
        one.model.state_dict().values(), three.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    bf16 = load_model(ModelConfig(path=str(tmp_path / "one"), dtype="bfloat16", name="x"), 32)
    assert bf16.name == "x" and bf16.max_context == 32
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")), 128)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_checkpoint(tmp_path, 128)


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_checkpoint(tmp_path, 128)


def test_missing_config_field(tmp_path: Path) -> None:
    cfg = {k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'hidden_size' is missing"):
        load_checkpoint(tmp_path, 128)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausalLM"),
        ({"architectures": [], "model_type": "gpt2"}, "model_type 'gpt2'"),
    ],
)
def test_unsupported_architecture(tmp_path: Path, fields: dict, named: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, **fields}))
    with pytest.raises(ModelLoadError, match=f"unsupported architecture {named}"):
        load_checkpoint(tmp_path, 128)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    cfg = {**HF_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'yarn'"):
        load_checkpoint(tmp_path, 128)


def test_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    write_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files$"):
        load_checkpoint(tmp_path, 128)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"found pytorch_model\.bin"):
        load_checkpoint(tmp_path, 128)


def test_missing_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shards .* missing: \\['model-00002-of-00002"):
        load_checkpoint(tmp_path, 128)


def test_missing_tensors(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    tensors = hf_tensors(HF_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing from the weights: layers\.1\.mlp\.up_proj"):
        load_checkpoint(tmp_path, 128)


def test_weights_not_matching_config(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "intermediate_size": 48}))
    with pytest.raises(ModelLoadError, match="do not match config.json"):
        load_checkpoint(tmp_path, 128)


def test_missing_tokenizer(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is missing"):
        load_checkpoint(tmp_path, 128)


def test_tokenizer_special_tokens_and_eos_list(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = HFTokenizer(tmp_path)
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 2 and tok.eos_token_ids == frozenset({1, 2})
    assert tok.encode("hello world") == [3, 4]  # no special tokens added
    assert tok.encode("<|begin_of_text|>hello<|eot_id|>") == [0, 3, 2]
    assert tok.decode([0, 3, 4, 2]) == "hello world"
    assert tok.vocab_size == 16
    assert not tok.add_bos  # no flag and no BOS post-processor


def test_add_bos_from_flag_or_post_processor(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    write_tokenizer(tmp_path, bos_post_processor=True)
    assert HFTokenizer(tmp_path).add_bos
    assert HFTokenizer(tmp_path).encode_prompt("hello").tolist() == [0, 3]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert not HFTokenizer(tmp_path).add_bos


def test_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|begin_of_text|>", "add_bos_token": True, "chat_template": TEMPLATE}
        )
    )
    tok = HFTokenizer(tmp_path)
    text = tok.render_chat([{"role": "user", "content": "hello"}], system="world")
    assert text == (
        "<|begin_of_text|><|start|>system\nworld<|eot_id|><|start|>user\nhello<|eot_id|>"
        "<|start|>assistant\n"
    )
    assert tok.render_system("world") == "<|begin_of_text|><|start|>system\nworld<|eot_id|>"
    assert text.startswith(tok.render_system("world"))
    assert tok.encode_prompt(text).tolist()[:1] == [0]
    assert tok.encode_prompt(text).tolist().count(0) == 1  # BOS from the template, not twice


def test_chat_template_file_wins_and_can_raise(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tok = HFTokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}], None) == "[hi]"
    with pytest.raises(ValueError, match="no system role"):
        tok.render_chat([{"role": "user", "content": "hi"}], "sys")


def test_chat_fallback_without_template(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    tok = HFTokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages, "be brief") == ByteTokenizer().render_chat(
        messages, "be brief"
    )


def test_builtin_generated_deterministically_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = builtin.ensure_builtin(str(tmp_path / "a"))
    second = builtin.ensure_builtin(str(tmp_path / "b"))
    assert first.name == second.name == f"builtin-{builtin.config_hash()}"
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()

    def must_not_run(directory: Path) -> None:
        raise AssertionError("the built-in model was regenerated")

    monkeypatch.setattr(builtin, "write_builtin", must_not_run)
    loaded = load_model(ModelConfig(path=BUILTIN_MODEL, data_dir=str(tmp_path / "a")), 4096)
    assert loaded.path == first
    assert loaded.name == builtin.BUILTIN_NAME
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.config.vocab_size == ByteTokenizer.BASE_VOCAB
    assert loaded.max_context == 2048
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.name]  # no temp dirs left


def test_builtin_backend_generates_same_tokens_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # keep the suite's threads
    model_cfg = ModelConfig(path=BUILTIN_MODEL, data_dir=str(tmp_path))
    engine_cfg = EngineConfig(max_batch_size=2, max_context=256, threads=1)
    outputs = []
    for _ in range(2):
        backend, tok = create_cpu_backend(model_cfg, engine_cfg)
        reserving(backend)
        assert calls[-1] == 1  # engine.threads reaches torch
        assert backend.num_slots == 2
        assert backend.info.max_context == 256 and backend.info.eos_token_id == ByteTokenizer.EOS
        prompt = tok.encode_prompt("Hello, world")
        row = SamplingParams(temperature=1.0, seed=7)
        chunk = PrefillChunk(slot=1, tokens=prompt, start=0, last=True, sampling=row)
        outputs.append(int(backend.prefill([chunk])[0]))
    assert outputs[0] == outputs[1]
    assert 0 <= outputs[0] < ByteTokenizer.BASE_VOCAB
