"""What differs between the decoder families ``zerolayer.models.decoder`` runs, and a checkpoint's
numbers.

``ARCHITECTURES`` describes each family by the few structural switches it needs (an
``Architecture``: QK-norm, the RMSNorm +1 offset, scaled embeddings, norms around attention and
MLP, fused checkpoint matrices, q/k biases) plus the names it goes by in a Hugging Face
``config.json`` and a GGUF file. ``DecoderConfig`` holds one checkpoint's sizes and settings
(rope per layer type, sliding windows per layer, attention scale, softcaps), read from its
``config.json`` by ``DecoderConfig.from_hf``; whatever a family's config can say that the
decoder does not compute faithfully is a ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Architecture:
    """One decoder family: how it differs from Llama, and its names."""

    model_type: str  # config.json "model_type"
    hf_class: str  # config.json "architectures" entry (the *ForCausalLM class)
    gguf_arch: str | None  # GGUF "general.architecture"; None: no GGUF form of its own
    qkv_bias: bool | None = None  # q/k/v biases: None = config's attention_bias (o too)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + weight) (Gemma: 1)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too, before the residual add
    fused: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    gguf_permuted_qk: bool = False  # llama.cpp permutes q/k rows for its rope (llama arch)
    act_key: str = "hidden_act"  # the config key naming the MLP activation
    default_act: str = "silu"
    # Per layer type (full / sliding), by default: None = every layer full attention unless
    # config.json lists layer_types; an int n = every n-th layer full, the others sliding.
    sliding_pattern: int | None = None
    all_sliding: bool = False  # a config sliding_window applies to every layer (Mistral, Phi-3)


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", "llama", gguf_permuted_qk=True),
        Architecture("mistral", "MistralForCausalLM", None, all_sliding=True),
        Architecture("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Architecture("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
        Architecture(
            "gemma3_text",
            "Gemma3ForCausalLM",
            "gemma3",
            qk_norm=True,
            norm_offset=1.0,
            embed_scale=True,
            sandwich_norms=True,
            act_key="hidden_activation",
            default_act="gelu_pytorch_tanh",
            sliding_pattern=6,
        ),
        Architecture("phi3", "Phi3ForCausalLM", "phi3", fused=True, all_sliding=True),
    )
}
BY_HF_CLASS = {a.hf_class: a for a in ARCHITECTURES.values()}
BY_GGUF_ARCH = {a.gguf_arch: a for a in ARCHITECTURES.values() if a.gguf_arch}


def find_architecture(cfg: dict[str, Any]) -> Architecture:
    """The family of a config.json, by its ``architectures`` list or ``model_type``."""
    for name in cfg.get("architectures") or ():
        if name in BY_HF_CLASS:
            return BY_HF_CLASS[name]
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # a Gemma 3 text-only export may say the multimodal type
        model_type = "gemma3_text"
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    names = cfg.get("architectures") or []
    found = ", ".join(names) if names else f"model_type {model_type!r}"
    raise ValueError(
        f"unsupported architecture {found}; supported: "
        + ", ".join(f"{a.hf_class} ({a.model_type})" for a in ARCHITECTURES.values())
    )


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    model_type: str = "llama"  # a key of ARCHITECTURES
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" (no scaling), "linear" or "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    rope_local_theta: float | None = None  # sliding layers' own (unscaled) rope base (Gemma 3)
    # Per-pair divisors of the full layers' frequencies, as a GGUF's rope_freqs.weight holds
    # them (llama.cpp writes Llama 3.1's llama3 scaling so): config.json's rope_freq_factors.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # keys a sliding layer's query sees: q - k < window
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; () = all FULL
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5 (else head_dim)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"unknown model_type {self.model_type!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(self.layer_types)} layers, the model has "
                f"{self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ValueError(f"unsupported layer types {bad}; supported: {FULL}, {SLIDING}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.model_type]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def attention_scale(self) -> float:
        scale: float = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        return scale

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DecoderConfig:
        """Build from the fields of a Hugging Face ``config.json`` of a supported family.

        Rope settings are read from ``rope_theta`` + ``rope_scaling`` (transformers 4.x files)
        or from ``rope_parameters`` (transformers 5.x files, per layer type for Gemma 3).
        """
        arch = find_architecture(cfg)
        act = cfg.get(arch.act_key) or cfg.get("hidden_act") or arch.default_act
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention is not supported (a decoder is causal)")

        full, local = _rope_settings(cfg)
        rotary = float(full.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if rotary != 1.0:
            raise ValueError(f"partial rotary embeddings (factor {rotary}) are not supported")
        rope_type = full.get("rope_type", full.get("type", "default")) or "default"
        local_theta = 10000.0 if arch.sliding_pattern else None  # Gemma 3's default local base
        if local is not None:
            local_type = local.get("rope_type", local.get("type", "default")) or "default"
            if local_type != "default":
                raise ValueError(f"unsupported rope scaling {local_type!r} of sliding layers")
            local_theta = float(local.get("rope_theta", 10000.0))

        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if types:
            layer_types = tuple(str(t) for t in types)
        elif arch.sliding_pattern:
            pattern = int(cfg.get("sliding_window_pattern") or arch.sliding_pattern)
            layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
        elif arch.all_sliding and window:
            layer_types = (SLIDING,) * layers
        elif cfg.get("use_sliding_window") and window:  # Qwen2 files written by transformers 4
            first = int(cfg.get("max_window_layers", layers))
            layer_types = tuple(SLIDING if i >= first else FULL for i in range(layers))
        else:
            layer_types = ()
        if SLIDING not in layer_types:
            layer_types, window = (), None

        qkv_bias = bool(cfg.get("attention_bias", False))
        o_bias = qkv_bias
        if arch.qkv_bias is not None:
            qkv_bias, o_bias = arch.qkv_bias, False

        def optional(key: str) -> float | None:
            value = cfg.get(key)
            return None if value is None else float(value)

        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            model_type=arch.model_type,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(full.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            rope_factor=float(full.get("factor", 1.0)),
            rope_low_freq_factor=float(full.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(full.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(full.get("original_max_position_embeddings", 8192)),
            rope_local_theta=local_theta,
            rope_freq_factors=_freq_factors(cfg.get("rope_freq_factors")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(act),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            query_pre_attn_scalar=optional("query_pre_attn_scalar"),
            attn_logit_softcapping=optional("attn_logit_softcapping"),
            final_logit_softcapping=optional("final_logit_softcapping"),
        )


def _freq_factors(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int | float) for v in value):
        raise ValueError("rope_freq_factors must be a list of numbers")
    return tuple(float(v) for v in value)


def _rope_settings(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(full layers' rope fields, sliding layers' own rope fields or None), from either the
    4.x keys (rope_theta, rope_scaling, rope_local_base_freq) or 5.x ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):  # per layer type
        local = params.get(SLIDING)
        return dict(params[FULL]), dict(local) if isinstance(local, dict) else None
    full: dict[str, Any] = {"rope_theta": cfg.get("rope_theta", 10000.0)}
    if isinstance(params, dict):
        full.update(params)
    else:
        full.update(cfg.get("rope_scaling") or {})
    local_base = cfg.get("rope_local_base_freq")
    return full, None if local_base is None else {"rope_theta": local_base}
