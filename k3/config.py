"""K3Config: every field of the K3 architecture (report §2), its presets, and the official config.json;
VisionConfig: its `vision_config`, the MoonViT-V2 encoder's (report §2.4).

Field names follow the release's `text_config` keys (see checkpoint-layout.md §3). The nested
`linear_attn_config` of the official file is flattened here with a `kda_` prefix; `to_dict`/`from_dict`
translate. Layer lists are 1-based, exactly as in the official file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field, the value and what is allowed."""


def _pattern_layers(num_layers: int, period: int = 4) -> tuple[list[int], list[int]]:
    """K3's hybrid pattern (§2.1): every `period`-th layer (1-based) and the last layer are Gated MLA."""
    full = [i for i in range(1, num_layers + 1) if i % period == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


def layer_lists(pattern: str) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), 1-based, of a pattern string with one letter per layer: K for KDA, M for
    Gated MLA. "KKKMKKKMKKKMM" is K3's pattern for 13 layers; "MMMMM" all-MLA (full attention), "KKKKK" all-KDA."""
    if not pattern or set(pattern) - {"K", "M"}:
        raise ConfigError(f"layer pattern {pattern!r} is invalid: one letter per layer, K (KDA) or M (Gated MLA)")
    return ([i for i, c in enumerate(pattern, 1) if c == "K"], [i for i, c in enumerate(pattern, 1) if c == "M"])


# The ablation arms (issue 46): settings the config allows that are not K3. Each default is K3's; `K3Config.ablations`
# names every setting that differs. The official keys (`mla_use_nope`, `mla_use_output_gate`, the layer lists) keep
# their meaning; the others are k3's own and are written to config.json only when they differ from K3's.
RESIDUALS = ("attn_res", "plain")
DEFAULT_ROPE_THETA = 10000.0


@dataclass
class K3Config:
    # --- backbone -------------------------------------------------------------------------------
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    # --- hybrid attention (1-based layer lists, as in the official file) --------------------------
    kda_layers: list[int] = field(default_factory=lambda: _pattern_layers(93)[0])
    full_attn_layers: list[int] = field(default_factory=lambda: _pattern_layers(93)[1])
    # --- Kimi Delta Attention (§2.1.1) -------------------------------------------------------------
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float = -5.0
    kda_use_full_rank_gate: bool = True
    # --- Gated MLA, NoPE (§2.1.2) ------------------------------------------------------------------
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # "rope" in name only: K3 (mla_use_nope) never rotates these 64 shared key dims
    v_head_dim: int = 128
    mla_use_nope: bool = True  # false: an ablation, RoPE on the qk_rope_head_dim slice of queries and keys
    mla_use_output_gate: bool = True  # false: an ablation, o_proj(o) without the sigmoid output gate
    rope_theta: float = DEFAULT_ROPE_THETA  # the RoPE base, used only when mla_use_nope is false
    # --- FFN: dense first layer, then Stable LatentMoE (§2.3) ---------------------------------------
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    intermediate_size: int = 33792
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    num_shared_experts: int = 2
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_latent: bool = True  # false: an ablation, routed experts in the full hidden width (no latent projection)
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # --- Block Attention Residuals (§2.2) ------------------------------------------------------------
    attn_res_block_size: int = 12
    residual: str = "attn_res"  # "plain": an ablation, h = h + sublayer(norm(h)) instead of Block AttnRes
    # --- multi-token prediction (§4.1.4) ---------------------------------------------------------
    num_nextn_predict_layers: int = 0
    # --- tokens and storage ------------------------------------------------------------------------
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    dtype: str = "bfloat16"
    initializer_range: float = 0.02
    quantization_config: dict | None = None
    # --- native vision (§2.4): the official `vision_config` object, or None for a text-only model ---------
    vision_config: dict | None = None
    media_placeholder_token_id: int | None = None

    # ------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.kda_layers = [int(i) for i in self.kda_layers]
        self.full_attn_layers = [int(i) for i in self.full_attn_layers]
        self.validate()

    # --- derived quantities ----------------------------------------------------------------------------
    def is_kda_layer(self, idx: int) -> bool:
        """0-based layer index; the official rule is `(idx + 1) in kda_layers`."""
        return (idx + 1) in self._kda_set

    def is_moe_layer(self, idx: int) -> bool:
        return (
            self.num_experts > 0
            and idx >= self.first_k_dense_replace
            and (idx - self.first_k_dense_replace) % self.moe_layer_freq == 0
        )

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        """Blocks of layers (the last may be partial); the output site sees this many + 1 (embedding)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def torch_dtype(self):
        import torch

        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.dtype]

    # --- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> None:
            raise ConfigError(f"config field '{name}' = {value!r} is invalid: {allowed}")

        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "kda_head_dim", "kda_short_conv_kernel_size",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "attn_res_block_size",
            "max_position_embeddings",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, v, "must be a positive integer")
        nonneg = [
            "qk_rope_head_dim", "first_k_dense_replace", "num_experts", "num_experts_per_token",
            "num_shared_experts", "num_nextn_predict_layers", "intermediate_size", "moe_intermediate_size",
            "routed_expert_hidden_size", "kda_num_heads", "num_attention_heads",
        ]
        for name in nonneg:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, v, "must be a non-negative integer")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            bad("rms_norm_eps", self.rms_norm_eps, "must be a number in (0, 1)")
        if not (isinstance(self.initializer_range, (int, float)) and self.initializer_range > 0):
            bad("initializer_range", self.initializer_range, "must be a positive number")
        L = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            lst = getattr(self, name)
            out = [i for i in lst if not 1 <= i <= L]
            if out:
                bad(name, out, f"layer numbers are 1-based and must lie in [1, {L}]")
            if len(set(lst)) != len(lst):
                bad(name, lst, "contains repeated layer numbers")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            bad("kda_layers", sorted(both), "these layers are also listed in full_attn_layers")
        missing = set(range(1, L + 1)) - set(self.kda_layers) - set(self.full_attn_layers)
        if missing:
            bad("kda_layers", sorted(missing), "every layer must be in kda_layers or full_attn_layers")
        if self.kda_layers and self.kda_num_heads <= 0:
            bad("kda_num_heads", self.kda_num_heads, "must be positive when kda_layers is not empty")
        if self.full_attn_layers and self.num_attention_heads <= 0:
            bad("num_attention_heads", self.num_attention_heads, "must be positive when full_attn_layers is not empty")
        if self.num_key_value_heads != self.num_attention_heads:
            bad("num_key_value_heads", self.num_key_value_heads,
                f"MLA has one key/value head per query head: must equal num_attention_heads ({self.num_attention_heads})")
        if not self.kda_gate_lower_bound < 0:
            bad("kda_gate_lower_bound", self.kda_gate_lower_bound, "must be negative (the log-decay lies in (lower_bound, 0))")
        if not self.kda_use_full_rank_gate:
            bad("kda_use_full_rank_gate", self.kda_use_full_rank_gate, "K3 uses the full-rank output gate (true)")
        for name in ("mla_use_nope", "mla_use_output_gate", "moe_latent"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "must be true or false")
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and self.rope_theta > 0):
            bad("rope_theta", self.rope_theta, "must be a positive number")
        if not self.mla_use_nope and (self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2):
            bad("qk_rope_head_dim", self.qk_rope_head_dim,
                "RoPE (mla_use_nope false) rotates pairs of dims: must be a positive even number")
        if self.residual not in RESIDUALS:
            bad("residual", self.residual, f"must be one of {list(RESIDUALS)} ('attn_res' is K3's Block AttnRes)")
        if self.first_k_dense_replace > L:
            bad("first_k_dense_replace", self.first_k_dense_replace, f"must be <= num_hidden_layers ({L})")
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            bad("intermediate_size", self.intermediate_size, "must be positive when there are dense layers")
        if self.moe_layer_freq != 1:
            bad("moe_layer_freq", self.moe_layer_freq, "K3 puts an MoE in every layer after the dense ones (1)")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                bad("num_experts_per_token", self.num_experts_per_token, f"must lie in [1, num_experts={self.num_experts}]")
            for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
                if getattr(self, name) <= 0:
                    bad(name, getattr(self, name), "must be positive when num_experts > 0")
        if self.moe_router_activation_func != "sigmoid":
            bad("moe_router_activation_func", self.moe_router_activation_func, "K3's router uses 'sigmoid'")
        if self.num_expert_group != 1 or self.topk_group != 1:
            bad("num_expert_group", (self.num_expert_group, self.topk_group),
                "K3 routes over one group (num_expert_group = topk_group = 1)")
        if self.hidden_act != "situ":
            bad("hidden_act", self.hidden_act, "K3 uses 'situ' (SiTU-GLU)")
        for name in ("activation_situ_beta", "activation_situ_linear_beta", "routed_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                bad(name, v, "must be a positive number")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            bad("dtype", self.dtype, "must be one of 'bfloat16', 'float16', 'float32'")
        if self.vision_config is not None:
            vc = VisionConfig.from_dict(self.vision_config)
            if self.media_placeholder_token_id is None:
                bad("media_placeholder_token_id", None, "a model with vision_config needs the image placeholder token id")
            if vc.text_hidden_size != self.hidden_size:
                bad("vision_config", f"text_hidden_size={vc.text_hidden_size}",
                    f"must equal hidden_size ({self.hidden_size})")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v < self.vocab_size):
                bad(name, v, f"must be a token id in [0, vocab_size={self.vocab_size})")

    # --- ablation arms ------------------------------------------------------------------------------
    def ablations(self) -> list[str]:
        """Every setting of this config that is not K3's architecture (the ablation arms), one line each; empty
        for K3 (any size). `k3 info` prints them and config.json records them under `k3_ablation`."""
        out = []
        if set(self.full_attn_layers) != set(_pattern_layers(self.num_hidden_layers)[1]):
            pattern = "".join("K" if self.is_kda_layer(i) else "M" for i in range(self.num_hidden_layers))
            what = ("all Gated MLA (full attention)" if not self.kda_layers else "all KDA" if not self.full_attn_layers
                    else "a KDA/MLA pattern")
            out.append(f"layers {pattern}: {what}, not K3's (Gated MLA every 4th and the last layer)")
        if not self.mla_use_nope:
            out.append(f"mla_use_nope=false: RoPE (theta {self.rope_theta:g}) on the MLA rope slice, not NoPE")
        if not self.mla_use_output_gate:
            out.append("mla_use_output_gate=false: MLA without its output gate")
        if self.residual != "attn_res":
            out.append(f"residual={self.residual}: plain residuals instead of Block AttnRes")
        if not self.moe_latent:
            out.append("moe_latent=false: a standard MoE, routed experts in the hidden width without the latent "
                       "projection")
        return out

    # --- presets and I/O -----------------------------------------------------------------------
    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_preset(cls, name: str) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        return PRESETS[name]()

    def to_dict(self) -> dict[str, Any]:
        """The official config.json structure: a multimodal wrapper holding `text_config`."""
        text: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name.startswith("kda_") or f.name in ("full_attn_layers", "vision_config",
                                                          "media_placeholder_token_id"):
                continue
            if f.name in _ABLATION_KEYS and getattr(self, f.name) == f.default:
                continue  # k3's own ablation keys appear only where they differ from K3: K3's file is the release's
            if f.name == "rope_theta" and self.mla_use_nope:
                continue  # unused without RoPE
            text[f.name] = getattr(self, f.name)
        text["linear_attn_config"] = {
            "kda_layers": list(self.kda_layers),
            "full_attn_layers": list(self.full_attn_layers),
            "num_heads": self.kda_num_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.kda_short_conv_kernel_size,
            "gate_lower_bound": self.kda_gate_lower_bound,
            "use_full_rank_gate": self.kda_use_full_rank_gate,
        }
        if self.quantization_config is None:
            text.pop("quantization_config")
        out = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "ignore_index": -100,
            "dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }
        if self.vision_config is not None:
            out["vision_config"] = dict(self.vision_config)
            out["media_placeholder_token_id"] = self.media_placeholder_token_id
        if self.ablations():  # for a reader of the file; derived from the keys above, ignored when read
            out["k3_ablation"] = self.ablations()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], strict: bool = False) -> "K3Config":
        """Accepts the official wrapper (`text_config` inside) or a bare text config. Missing keys take the
        release values unless `strict` (a checkpoint's config.json: every key that shapes the model must be
        there). An unknown key that is a near miss of a known one is refused: a misspelt key would otherwise
        be ignored and its default used silently; other unknown keys (transformers' generic fields) are."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        text = d.get("text_config", d)
        if not isinstance(text, dict):
            raise ConfigError("config field 'text_config' must be a JSON object")
        text = dict(text)
        lac = text.pop("linear_attn_config", None) or {}
        if not isinstance(lac, dict):
            raise ConfigError("config field 'linear_attn_config' must be a JSON object")
        _check_keys(d, text, lac, strict)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in text.items() if k in names}
        if kwargs.get("rope_theta", 0) is None:  # transformers may write null for a NoPE model: unused, the default
            del kwargs["rope_theta"]
        rename = {
            "kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers", "num_heads": "kda_num_heads",
            "head_dim": "kda_head_dim", "short_conv_kernel_size": "kda_short_conv_kernel_size",
            "gate_lower_bound": "kda_gate_lower_bound", "use_full_rank_gate": "kda_use_full_rank_gate",
        }
        for src, dst in rename.items():
            if src in lac:
                kwargs[dst] = lac[src]
        if "quantization_config" in d and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = d["quantization_config"]
        if "text_config" in d:  # vision lives beside text_config in the official wrapper
            kwargs["vision_config"] = d.get("vision_config")
            if d.get("vision_config") is not None:
                kwargs["media_placeholder_token_id"] = d.get("media_placeholder_token_id")
        if "tie_word_embeddings" in d and "tie_word_embeddings" not in kwargs:
            kwargs["tie_word_embeddings"] = d["tie_word_embeddings"]
        for k in ("kda_layers", "full_attn_layers"):
            if k in kwargs and not (isinstance(kwargs[k], list)
                                    and all(isinstance(i, int) and not isinstance(i, bool) for i in kwargs[k])):
                raise ConfigError(f"config field '{k}' = {kwargs[k]!r} is invalid: must be a list of 1-based layer numbers")
        if kwargs.get("quantization_config") is not None and not isinstance(kwargs["quantization_config"], dict):
            raise ConfigError(f"config field 'quantization_config' = {kwargs['quantization_config']!r} is invalid: "
                              "must be a JSON object or null")
        # Types: JSON gives ints/floats; reject strings and other surprises with the field's name.
        for f in dataclasses.fields(cls):
            if f.name not in kwargs or kwargs[f.name] is None:
                continue
            v, t = kwargs[f.name], str(f.type)
            if t.startswith("int") and not (isinstance(v, int) and not isinstance(v, bool)):
                raise ConfigError(f"config field '{f.name}' = {v!r} is invalid: must be an integer")
            if t.startswith("float") and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                raise ConfigError(f"config field '{f.name}' = {v!r} is invalid: must be a number")
            if t.startswith("bool") and not isinstance(v, bool):
                raise ConfigError(f"config field '{f.name}' = {v!r} is invalid: must be true or false")
            if t.startswith("str") and not isinstance(v, str):
                raise ConfigError(f"config field '{f.name}' = {v!r} is invalid: must be a string")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> None:
        """Write config.json atomically (a crash never leaves a half-written file)."""
        from k3.files import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, strict: bool = False) -> "K3Config":
        """Read a config.json (or a directory's); errors name the file. `strict`: see from_dict."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"no config file at {path}")
        from k3.files import read_json_file

        d = read_json_file(path, ConfigError)
        try:
            return cls.from_dict(d, strict=strict)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


# --- key checks of config files -----------------------------------------------------------------------------
# The keys that fix the model's shape: a checkpoint's config.json must give them all (their defaults are the
# 2.8T-parameter release, which a file missing them almost certainly is not).
_REQUIRED_TEXT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
                  "intermediate_size", "num_experts", "num_experts_per_token", "moe_intermediate_size",
                  "num_shared_experts", "routed_expert_hidden_size", "attn_res_block_size")
# linear_attn_config key -> field (the official file nests the KDA settings there).
_LAC_KEYS = {"kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers", "num_heads": "kda_num_heads",
             "head_dim": "kda_head_dim", "short_conv_kernel_size": "kda_short_conv_kernel_size",
             "gate_lower_bound": "kda_gate_lower_bound", "use_full_rank_gate": "kda_use_full_rank_gate"}
_REQUIRED_LAC = ("kda_layers", "full_attn_layers", "num_heads", "head_dim")
_WRAPPER_KEYS = ("text_config", "vision_config", "media_placeholder_token_id", "ignore_index", "image_placeholder",
                 "auto_map", "architectures", "model_type", "transformers_version", "linear_attn_config",
                 "k3_ablation")
# k3's own keys of the ablation arms (not in the release's file): written only when they differ from K3's value.
_ABLATION_KEYS = ("residual", "moe_latent")
# Generic fields transformers' PretrainedConfig serializes (unused here); never taken for misspellings.
_GENERIC_KEYS = frozenset("""
    return_dict output_hidden_states output_attentions torchscript torch_dtype use_bfloat16 tf_legacy_loss
    pruned_heads chunk_size_feed_forward is_encoder_decoder is_decoder cross_attention_hidden_size
    add_cross_attention tie_encoder_decoder max_length min_length do_sample early_stopping num_beams num_beam_groups
    diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores return_dict_in_generate
    forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens
    begin_suppress_tokens finetuning_task id2label label2id tokenizer_class prefix sep_token_id
    decoder_start_token_id task_specific_params problem_type _name_or_path use_cache rope_scaling
    head_dim attention_dropout attention_bias _attn_implementation_autoset""".split())


def _check_keys(d: dict, text: dict, lac: dict, strict: bool) -> None:
    import difflib

    fields = [f.name for f in dataclasses.fields(K3Config)]
    groups = [("text_config." if "text_config" in d else "", text, fields + list(_WRAPPER_KEYS)),
              ("linear_attn_config.", lac, list(_LAC_KEYS))]
    if "text_config" in d:
        groups.append(("", d, fields + list(_WRAPPER_KEYS)))
    for where, obj, known in groups:
        for k in obj:
            if k in known or k in _GENERIC_KEYS:
                continue
            near = difflib.get_close_matches(k, known, n=1, cutoff=0.85)
            if near:
                raise ConfigError(f"config key '{where}{k}' is unknown: did you mean '{near[0]}'?")
    if strict:
        missing = [f"text_config.{k}" if "text_config" in d else k for k in _REQUIRED_TEXT if k not in text]
        missing += [f"linear_attn_config.{k}" for k in _REQUIRED_LAC if k not in lac and _LAC_KEYS[k] not in text]
        if missing:
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise ConfigError(f"config lacks required keys {', '.join(missing[:6])}{more}: a checkpoint's config "
                              "must give every size of the model")


# --- the vision encoder (report §2.4; the modules are k3/model/vision.py) ------------------------------------
# What k3.model.vision implements of `activation_func` / `projector_hidden_act` and `pos_emb_interpolation_mode`.
VISION_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_tanh")
VISION_INTERP_MODES = ("bilinear", "bicubic")


@dataclass
class VisionConfig:
    """The release's `vision_config` (checkpoint-layout.md §3); field names are the official keys."""

    vt_hidden_size: int = 1024
    qkv_hidden_size: int = 1536
    vt_intermediate_size: int = 4096
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    patch_size: int = 14
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    norm_type: str = "rmsnorm"
    activation_func: str = "gelu_pytorch_tanh"
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    pos_emb_type: str = "divided_fixed"
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_interpolation_mode: str = "bilinear"

    def __post_init__(self) -> None:
        mk = self.merge_kernel_size
        if isinstance(mk, (list, tuple)):
            self.merge_kernel_size = tuple(mk)
        self.validate()

    # --- presets --------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> "VisionConfig":
        """A small encoder for tests: width 64, 2 layers, 2 heads of 32, MLP 128, LM width 128, 8x8 table."""
        kw: dict[str, Any] = dict(
            vt_hidden_size=64, qkv_hidden_size=64, vt_intermediate_size=128, vt_num_attention_heads=2,
            vt_num_hidden_layers=2, mm_hidden_size=64, text_hidden_size=128,
            init_pos_emb_height=8, init_pos_emb_width=8,
        )
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **changes: Any) -> "VisionConfig":
        return dataclasses.replace(self, **changes)

    # --- derived quantities -----------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_input_size(self) -> int:
        """Width of one pixel-shuffled token: mm_hidden_size x (kh * kw) = 4096 for the release."""
        return self.mm_hidden_size * self.merge_area

    @property
    def pixel_multiple(self) -> tuple[int, int]:
        """Image height/width must be multiples of these (patch x merge kernel = 28 for the release)."""
        kh, kw = self.merge_kernel_size
        return self.patch_size * kh, self.patch_size * kw

    def num_image_tokens(self, height: int, width: int) -> int:
        """LM tokens (placeholders) one height x width image becomes: (H/28) * (W/28) for the release."""
        mh, mw = self.pixel_multiple
        if height <= 0 or width <= 0 or height % mh or width % mw:
            raise ValueError(f"image size {height}x{width} must be a positive multiple of {mh}x{mw} pixels "
                             f"(patch_size {self.patch_size} x merge_kernel_size {list(self.merge_kernel_size)})")
        return (height // mh) * (width // mw)

    # --- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> None:
            raise ConfigError(f"vision_config field '{name}' = {value!r} is invalid: {allowed}")

        positive = [
            "vt_hidden_size", "qkv_hidden_size", "vt_intermediate_size", "vt_num_attention_heads",
            "vt_num_hidden_layers", "patch_size", "mm_hidden_size", "text_hidden_size",
            "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, v, "must be a positive integer")
        mk = self.merge_kernel_size
        if not (isinstance(mk, tuple) and len(mk) == 2
                and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in mk)):
            bad("merge_kernel_size", mk, "must be two positive integers [kh, kw]")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            bad("qkv_hidden_size", self.qkv_hidden_size,
                f"must be divisible by vt_num_attention_heads ({self.vt_num_attention_heads})")
        if self.mm_hidden_size != self.vt_hidden_size:
            bad("mm_hidden_size", self.mm_hidden_size,
                f"the projector reads the ViT output: must equal vt_hidden_size ({self.vt_hidden_size})")
        fixed = {
            "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm",
            "pos_emb_type": "divided_fixed",
        }
        for name, want in fixed.items():
            if getattr(self, name) != want:
                bad(name, getattr(self, name), f"only {want!r} is implemented")
        for name in ("activation_func", "projector_hidden_act"):
            if getattr(self, name) not in VISION_ACTIVATIONS:
                bad(name, getattr(self, name), f"must be one of {sorted(VISION_ACTIVATIONS)}")
        if self.pos_emb_interpolation_mode not in VISION_INTERP_MODES:
            bad("pos_emb_interpolation_mode", self.pos_emb_interpolation_mode,
                f"must be one of {list(VISION_INTERP_MODES)}")
        eps = self.projector_ln_eps
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1):
            bad("projector_ln_eps", eps, "must be a number in (0, 1)")

    # --- (de)serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The official `vision_config` object (merge_kernel_size as a JSON list)."""
        d = dataclasses.asdict(self)
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        """Accepts a `vision_config` object or the whole official config.json (reads its `vision_config`).
        Unknown keys are ignored; missing keys take the release values."""
        if not isinstance(d, dict):
            raise ConfigError(f"vision_config must be a JSON object, got {type(d).__name__}")
        if "vision_config" in d:
            d = d["vision_config"]
            if not isinstance(d, dict):
                raise ConfigError("config field 'vision_config' must be a JSON object")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d or d[f.name] is None:
                continue
            v, t = d[f.name], str(f.type)
            if f.name == "merge_kernel_size":
                if not isinstance(v, (list, tuple)):
                    raise ConfigError(f"vision_config field 'merge_kernel_size' = {v!r} is invalid: "
                                      "must be two positive integers [kh, kw]")
                v = tuple(v)
            elif t.startswith("int") and not (isinstance(v, int) and not isinstance(v, bool)):
                raise ConfigError(f"vision_config field '{f.name}' = {v!r} is invalid: must be an integer")
            elif t.startswith("float") and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                raise ConfigError(f"vision_config field '{f.name}' = {v!r} is invalid: must be a number")
            elif t.startswith("str") and not isinstance(v, str):
                raise ConfigError(f"vision_config field '{f.name}' = {v!r} is invalid: must be a string")
            kwargs[f.name] = v
        return cls(**kwargs)


# --- quantization ------------------------------------------------------------------------------------
# The input-activation entry of a checkpoint whose routed experts compute in MXFP8 (report §4.1.4): E4M3
# values with one E8M0 scale per 32 along the contraction dimension, computed at run time.
MXFP8_INPUT_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                           "dynamic": True}


def mxfp4_quantization_config(activations: str | None = None) -> dict:
    """The `quantization_config` of an MXFP4 checkpoint (checkpoint-layout.md §2.7): the release's (routed experts
    in MXFP4, `input_activations` null), or with ``activations="mxfp8"`` the expert inputs in MXFP8, which
    `k3.from_pretrained` then applies to the loaded model (what a QAT run trained with)."""
    if activations not in (None, "mxfp8"):
        raise ConfigError(f"activations={activations!r} is invalid: use None or 'mxfp8'")
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                            "group_size": 32, "scale_dtype": "torch.uint8", "dynamic": False},
                "input_activations": dict(MXFP8_INPUT_ACTIVATIONS) if activations else None,
                "targets": ["Linear"],
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def expert_activation_format(quantization_config: dict | None) -> str | None:
    """'mxfp8' when an MXFP4 checkpoint's config says the expert inputs compute in MXFP8, else None."""
    q = quantization_config or {}
    if q.get("format") != "mxfp4-pack-quantized":
        return None
    groups = q.get("config_groups") or {}
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict)]
    for a in acts:
        if isinstance(a, dict) and a.get("type") == "float" and a.get("num_bits") == 8 and a.get("group_size") == 32:
            return "mxfp8"
    return None


# --- presets ------------------------------------------------------------------------------------------
def _k3() -> K3Config:
    """The release configuration (checkpoint-layout.md §3), exactly."""
    return K3Config(
        vision_config=VisionConfig().to_dict(),
        media_placeholder_token_id=163605,
        quantization_config=mxfp4_quantization_config(),
    )


def _k3_mini() -> K3Config:
    """The model we train on one H200: K3's topology at ~2B total / ~0.3B active parameters."""
    L = 13
    kda, full = _pattern_layers(L)
    return K3Config(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=L, kda_layers=kda, full_attn_layers=full,
        kda_num_heads=8, kda_head_dim=128,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=4096, num_experts=128, num_experts_per_token=8, moe_intermediate_size=768,
        num_shared_experts=2, routed_expert_hidden_size=512, attn_res_block_size=4,
        num_nextn_predict_layers=1, max_position_embeddings=131072,
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


def _tiny() -> K3Config:
    """For CPU development and tests; big enough to learn something on 2 cores in minutes."""
    L = 5
    kda, full = _pattern_layers(L)
    return K3Config(
        vocab_size=4096, hidden_size=128, num_hidden_layers=L, kda_layers=kda, full_attn_layers=full,
        kda_num_heads=2, kda_head_dim=64,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        intermediate_size=384, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
        num_shared_experts=2, routed_expert_hidden_size=64, attn_res_block_size=2,
        num_nextn_predict_layers=1, max_position_embeddings=65536, dtype="float32",
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


PRESETS = {"k3": _k3, "k3-mini": _k3_mini, "tiny": _tiny}
