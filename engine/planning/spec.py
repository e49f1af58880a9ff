"""ModelSpec: the dimensions of a decoder-only transformer, and its parameters counted tensor by tensor.

Every estimator in this package reads a ModelSpec. The tensor list below mirrors the Hugging Face
modules (Llama / Mistral / Qwen2 / Qwen3, GPT-2, and the mixture-of-experts Mixtral / Qwen2-MoE /
Qwen3-MoE of moe.py), so the count is exact for those models and the number of tensors (which sets the
optimizer's per-tensor `step` counters) comes out right too. transformers 5 keeps each MoE layer's
experts as two stacked tensors (`experts.gate_up_proj` [E, 2f, h], `experts.down_proj` [E, h, f]).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from engine.planning.moe import declares_experts, moe_fields

MLP_KINDS = ("swiglu", "gelu")  # gate/up/down with SiLU (Llama) | fc/proj with GELU (GPT-2/3)
NORM_KINDS = ("rmsnorm", "layernorm")  # weight | weight and bias
# Families whose window layers mask their window in the kernels (Gemma 2 and 3, gpt-oss): a full-length cache,
# no cap on the context; other families' window is served by capping the context at it.
WINDOW_MASKING_TYPES = ("gemma2", "gemma3_text", "gpt_oss")


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor. `split` says how tensor parallelism shards it (Megatron-LM layout):
    "heads" / "ffn" / "vocab" split over TP ranks, "kv_heads" split until each rank holds one KV
    head (then replicated), "none" replicated (norms, position table, row-parallel biases, routers),
    "experts" split over the GPUs that share the experts (`expert_shards`: EP ranks x expert TP)."""

    name: str
    numel: int
    split: str
    # "embed" (first pipeline stage), "layer" (one per layer), "dense" (one per dense-MLP layer),
    # "moe" (one per MoE layer), "head" (last stage)
    place: str
    # How a serving engine holds it (weight_formats.py): "linear", a linear layer's weight, kept in the
    # --quantization format when one is given; "head", the LM head's matrix (a tied embedding is it), in that
    # format too with --quantize-lm-head, else the model's dtype; "float32", always float32 (the MoE router:
    # engine/layers/moe.py keeps its logits' weight in float32); "dtype", the model's dtype (an untied
    # embedding, norms, biases, routed experts: the engine's fused experts hold float weights).
    storage: str = "dtype"
    in_features: int = 0  # a linear layer's input width (its weight's row length); 0 for other tensors
    row_parallel: bool = False  # a linear layer whose input TP splits (o, down): each rank holds every row


class Projection(NamedTuple):
    """One linear projection of a layer, weight [out_features, in_features]."""

    name: str  # the Hugging Face module name, as PEFT's target_modules match it (GPT's c_fc is "fc")
    target: str  # q, k, v, o, gate, up or down
    in_features: int
    out_features: int
    split: str  # how TP shards the weight (ParamTensor.split)
    row_parallel: bool  # TP splits the input (o, down), not the output
    place: str  # ParamTensor.place: "layer", "dense" (a dense MLP) or "moe" (an MoE layer's shared expert)


# Rope scalings that stretch positions by `factor` for every sequence: a context of the trained length
# times the factor is theirs to serve (vLLM's rule; llama3 and longrope state their own length).
STRETCHING_ROPE_TYPES = ("yarn", "dynamic", "linear")


def position_limit(cfg: dict) -> int:
    """The longest context a config may serve: max_position_embeddings, or for a yarn, dynamic or linear
    rope scaling its factor times the trained length (yarn's original_max_position_embeddings where it
    names one), as vLLM lets --max-model-len reach; the default context stays max_position_embeddings."""
    positions = cfg.get("max_position_embeddings", 2048)
    scaling = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor") or 1.0
    if kind not in STRETCHING_ROPE_TYPES or factor <= 1:
        return positions
    trained = scaling.get("original_max_position_embeddings") if kind == "yarn" else None
    return max(positions, int((trained or positions) * factor))


def _window_caps_context(cfg: dict, model_type: str) -> bool:
    """Whether the config's sliding window caps the served context: it is turned on, and the family's
    layers do not mask it themselves."""
    return bool(cfg.get("use_sliding_window", True)) and model_type not in WINDOW_MASKING_TYPES


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int = 2048
    position_limit: int = 0  # the longest context --max-model-len may ask (position_limit()); 0: the above
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    tie_word_embeddings: bool = False
    learned_positions: bool = False  # GPT-2/3 absolute position table of max_position_embeddings rows
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    fused_qkv: bool = False  # GPT-2 Conv1D `c_attn`: one tensor for q, k, v (changes the tensor count only)
    activation: str = "silu"  # Hugging Face name; sets what the MLP keeps for backward (see activations.py)
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # on the embeddings and after attention and MLP (GPT-2 `resid_pdrop`)
    params_override: int | None = None  # a published total that replaces the computed one
    num_experts: int = 0  # routed experts of each MoE layer; 0: a dense model
    experts_per_token: int = 0  # top-k of the router
    expert_ffn_size: int = 0  # hidden units of one expert's SwiGLU MLP
    shared_expert_ffn_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers; the others have a dense MLP of ffn_hidden_size
    # Mistral's sliding window where the config turns it on: the engine attends in full, so it serves
    # no context longer than the window (engine/runner/model_runner.py), and the serving plan does the same.
    # None for WINDOW_MASKING_TYPES, whose window layers mask it: their context is not capped.
    sliding_window: int | None = None
    checkpoint_dtype: str = ""  # the dtype config.json says the weights are stored in ("" where it says none)

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                      "vocab_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.mlp not in MLP_KINDS or self.norm not in NORM_KINDS:
            raise ValueError(f"mlp must be one of {MLP_KINDS} and norm one of {NORM_KINDS}")
        if self.params_override is not None and self.params_override <= 0:
            raise ValueError(f"params must be positive, got {self.params_override}")
        if self.num_experts or self.moe_layers:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.experts_per_token}) must be between 1 and the "
                                 f"number of experts ({self.num_experts})")
            if self.expert_ffn_size <= 0 or self.mlp != "swiglu":
                raise ValueError("experts are SwiGLU MLPs with a positive moe_intermediate_size")
            if not set(self.moe_layers) <= set(range(self.num_layers)):
                raise ValueError(f"MoE layers {self.moe_layers} outside the {self.num_layers} layers")

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict | str | Path) -> ModelSpec:
        """From a Hugging Face config: a dict (e.g. `PretrainedConfig.to_dict()`), a config.json, or its folder."""
        cfg = _load_config(config) if isinstance(config, (str, Path)) else dict(config)
        try:
            return cls._from_config_dict(cfg)
        except KeyError as e:
            raise ValueError(f"config has no {e.args[0]!r}: Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral, "
                             f"Qwen2-MoE and Qwen3-MoE configs are understood") from None

    @classmethod
    def _from_config_dict(cls, cfg: dict) -> ModelSpec:
        model_type = cfg.get("model_type", "llama")
        moe = moe_fields(cfg, model_type) if declares_experts(cfg) else {}
        name = cfg.get("_name_or_path") or model_type
        if model_type == "gpt2" or "n_embd" in cfg:
            hidden, heads = cfg["n_embd"], cfg["n_head"]
            return cls(
                name=name, num_layers=cfg["n_layer"], hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
                vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("n_positions", 1024),
                mlp="gelu", norm="layernorm", tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                learned_positions=True, qkv_bias=True, out_bias=True, mlp_bias=True, fused_qkv=True,
                activation=cfg.get("activation_function", "gelu_new"),  # GPT2Config defaults
                attention_dropout=cfg.get("attn_pdrop", 0.1), hidden_dropout=cfg.get("resid_pdrop", 0.1),
            )
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,  # explicit head_dim wins (Qwen3)
            ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048), position_limit=position_limit(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 and Qwen2-MoE hard-code bias on q, k, v only
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or attention_bias,
            out_bias=attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), activation=cfg.get("hidden_act", "silu"),
            attention_dropout=cfg.get("attention_dropout", 0.0),
            sliding_window=(cfg.get("sliding_window") or None) if _window_caps_context(cfg, model_type) else None,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), **moe,
        )

    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        from engine.planning.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return replace(cls.from_hf_config(PRESETS[name]), name=name)

    @classmethod
    def from_dims(
        cls,
        *,
        layers: int,
        hidden: int,
        heads: int,
        vocab: int,
        kv_heads: int | None = None,
        ffn_hidden: int | None = None,
        head_dim: int | None = None,
        arch: str = "llama",
        tie_embeddings: bool = False,
        max_positions: int = 2048,
    ) -> ModelSpec:
        """From explicit dimensions. `arch` "llama": SwiGLU, RMSNorm, rotary, no biases, FFN 8h/3 by
        default; "gpt": GELU MLP of 4h, LayerNorm, learned positions, biases (GPT-2/3)."""
        if arch == "gpt":
            if kv_heads not in (None, heads) or head_dim not in (None, hidden // heads):
                raise ValueError("the gpt architecture has one KV head per head and head_dim = hidden / heads")
            config = {
                "model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads, "n_inner": ffn_hidden,
                "vocab_size": vocab, "n_positions": max_positions, "tie_word_embeddings": tie_embeddings,
                "activation_function": "gelu_pytorch_tanh", "attn_pdrop": 0.0, "resid_pdrop": 0.0,
            }
        elif arch == "llama":
            config = {
                "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
                "intermediate_size": ffn_hidden or 8 * hidden // 3, "max_position_embeddings": max_positions,
                "tie_word_embeddings": tie_embeddings,
            }
        else:
            raise ValueError(f"arch must be 'llama' or 'gpt', got {arch!r}")
        return replace(cls.from_hf_config(config), name=f"custom {arch}")

    def with_params(self, params: int | None) -> ModelSpec:
        return self if params is None else replace(self, params_override=int(params))

    # ---- parameters ---------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_params(self) -> int:
        """Elements of one routed expert: gate, up and down projections of a SwiGLU MLP, 3hf."""
        return 3 * self.hidden_size * self.expert_ffn_size

    def projections(self) -> list[Projection]:
        """The linear projections of a layer (q/k/v per slice where GPT-2 fuses them into `c_attn`): the
        shapes of the linear layers' weights, and what LoRA adapts."""
        h, f, fs = self.hidden_size, self.ffn_hidden_size, self.shared_expert_ffn_size
        p = [Projection("q_proj", "q", h, self.q_size, "heads", False, "layer"),
             Projection("k_proj", "k", h, self.kv_size, "kv_heads", False, "layer"),
             Projection("v_proj", "v", h, self.kv_size, "kv_heads", False, "layer"),
             Projection("o_proj", "o", self.q_size, h, "heads", True, "layer")]
        if len(self.moe_layers) < self.num_layers:  # a dense MLP in some layer
            up = (("gate_proj", "gate"), ("up_proj", "up")) if self.mlp == "swiglu" else (("fc", "up"),)
            p += [Projection(name, target, h, f, "ffn", False, "dense") for name, target in up]
            p.append(Projection("down_proj", "down", f, h, "ffn", True, "dense"))
        if self.is_moe and fs:
            p += [Projection(f"shared_expert.{name}", target, h, fs, "ffn", False, "moe")
                  for name, target in (("gate_proj", "gate"), ("up_proj", "up"))]
            p.append(Projection("shared_expert.down_proj", "down", fs, h, "ffn", True, "moe"))
        return p

    def param_tensors(self) -> list[ParamTensor]:
        """Every parameter tensor, tied ones once (as `model.parameters()` yields them)."""
        h, norm_tensors = self.hidden_size, 1 if self.norm == "rmsnorm" else 2
        t = [ParamTensor("embed_tokens", self.vocab_size * h, "vocab", "embed",
                         "head" if self.tie_word_embeddings else "dtype")]
        if self.learned_positions:
            t.append(ParamTensor("embed_positions", self.max_position_embeddings * h, "none", "embed"))
        t += [ParamTensor(f"input_norm.{i}", h, "none", "layer") for i in range(norm_tensors)]
        proj = self.projections()
        if self.fused_qkv:  # GPT-2 c_attn; GPT-2 has no GQA, so the whole tensor splits by heads
            out = sum(p.out_features for p in proj[:3])
            t.append(ParamTensor("qkv_proj", h * out, "heads", "layer", "linear", in_features=h))
            if self.qkv_bias:
                t.append(ParamTensor("qkv_proj.bias", out, "heads", "layer"))
            proj = proj[3:]
        for p in proj:
            if p.name == "o_proj" and self.qk_norm:
                t += [ParamTensor("q_norm", self.head_dim, "none", "layer"),
                      ParamTensor("k_norm", self.head_dim, "none", "layer")]
            t.append(ParamTensor(p.name, p.in_features * p.out_features, p.split, p.place, "linear",
                                 in_features=p.in_features, row_parallel=p.row_parallel))
            bias = {"q": self.qkv_bias, "k": self.qkv_bias, "v": self.qkv_bias, "o": self.out_bias}.get(
                p.target, self.mlp_bias and p.place == "dense")
            if bias:  # a row-parallel layer's bias is added after the all-reduce: replicated
                t.append(ParamTensor(f"{p.name}.bias", p.out_features, "none" if p.row_parallel else p.split,
                                     p.place))
            if p.name == "o_proj":
                t += [ParamTensor(f"post_attention_norm.{i}", h, "none", "layer") for i in range(norm_tensors)]
        if self.is_moe:
            e, fe = self.num_experts, self.expert_ffn_size
            t += [ParamTensor("router", e * h, "none", "moe", "float32"),
                  ParamTensor("experts.gate_up_proj", e * 2 * fe * h, "experts", "moe"),
                  ParamTensor("experts.down_proj", e * h * fe, "experts", "moe")]
            if self.shared_expert_ffn_size:
                t.append(ParamTensor("shared_expert_gate", h, "none", "moe"))
        t += [ParamTensor(f"final_norm.{i}", h, "none", "head") for i in range(norm_tensors)]
        if not self.tie_word_embeddings:
            t.append(ParamTensor("lm_head", self.vocab_size * h, "vocab", "head", "head"))
        return t

    def computed_params(self) -> int:
        return self._busiest_stage(1, 1, 1).elements

    @property
    def params(self) -> int:
        return self.params_override or self.computed_params()

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to, i.e.
        embeddings, attention, norms, dense MLPs, routers, shared experts and top-k experts per MoE layer."""
        idle = len(self.moe_layers) * (self.num_experts - self.experts_per_token) * self.expert_params
        return self._scaled(self.computed_params() - idle)

    def stage_params(self, tp: int = 1, pp: int = 1, expert_shards: int | None = None) -> StageParams:
        """Parameters on the busiest GPU of a TP x PP layout (the stage with the most), and the part of
        them that are routed experts, spread over `expert_shards` GPUs (default tp: every TP rank holds
        1/tp of each expert's hidden units, Megatron-LM's and vLLM's default; EP multiplies it).

        Stages own contiguous layers, the first `L mod pp` stages one more; the first stage also holds
        the embeddings, the last the final norm and LM head. With tied embeddings and pp > 1 the last
        stage keeps its own copy of the embedding matrix as the head (Megatron-LM, Shoeybi et al. 2019).
        A `params_override` scales the element counts by override / computed total.
        """
        stage = self._busiest_stage(tp, pp, expert_shards or tp)
        return StageParams(self._scaled(stage.elements), stage.tensors, self._scaled(stage.expert_elements),
                           stage.expert_tensors)

    def params_per_gpu(self, tp: int = 1, pp: int = 1, expert_shards: int | None = None) -> int:
        return self.stage_params(tp, pp, expert_shards).elements

    def param_tensors_per_gpu(self, tp: int = 1, pp: int = 1) -> int:
        """Parameter tensors on that busiest GPU (an optimizer keeps per-tensor counters)."""
        return self.stage_params(tp, pp).tensors

    def largest_module_params(self, tp: int = 1, expert_shards: int | None = None) -> int:
        """Parameters of the largest single module (its own tensors: a Linear's weight and bias, an MoE
        layer's stacked experts), as DeepSpeed's `model_to_params` finds `largest_layer_params`: ZeRO-3
        gathers one module at a time. Per TP rank."""
        modules: dict[str, int] = {}
        for p in self.param_tensors():
            module = "experts" if p.name.startswith("experts.") else p.name.removesuffix(".bias")
            modules[module] = modules.get(module, 0) + self._shard(p, tp, expert_shards or tp)
        return self._scaled(max(modules.values()))

    def _scaled(self, elements: int) -> int:
        if self.params_override is None:
            return elements
        return round(elements * self.params_override / self.computed_params())

    @functools.cache  # plan search asks for the same (tp, pp) thousands of times
    def _busiest_stage(self, tp: int, pp: int, expert_shards: int) -> StageParams:
        stages = []
        for tensors in self._stages(pp):
            experts = [(p, n) for p, n in tensors if p.split == "experts"]
            stages.append(StageParams(
                sum(n * self._shard(p, tp, expert_shards) for p, n in tensors), sum(n for _, n in tensors),
                sum(n * self._shard(p, tp, expert_shards) for p, n in experts), sum(n for _, n in experts)))
        return max(stages)

    def stage_bytes(self, tp: int, pp: int, expert_shards: int | None, bytes_of) -> int:
        """Bytes on the GPU of a TP x PP layout that holds the most, each tensor's shard costing
        `bytes_of(tensor, elements on one GPU)` (a quantized layer's blocks, a float32 router: the busiest stage
        in bytes need not be the one with the most elements). A `params_override` scales it as the counts."""
        shards = expert_shards or tp
        return self._scaled(max(sum(n * bytes_of(p, self._shard(p, tp, shards)) for p, n in tensors)
                                for tensors in self._stages(pp)))

    def extra_tensors_per_gpu(self, tensors: list[ParamTensor], tp: int = 1, pp: int = 1) -> StageParams:
        """Elements and tensors of `tensors` that are not the model's own (LoRA adapters), placed per layer
        as the model's are, on the pipeline stage that holds the most of them; no `params_override` scaling."""
        return max(StageParams(sum(count[p.place] * self._shard(p, tp, tp) for p in tensors),
                               sum(count[p.place] for p in tensors)) for count in self._place_counts(pp))

    def _place_counts(self, pp: int) -> list[dict[str, int]]:
        """How many of each ParamTensor.place each pipeline stage holds: stages own contiguous layers, the
        first `L mod pp` stages one more."""
        base, extra = divmod(self.num_layers, pp)
        counts, start, moe = [], 0, set(self.moe_layers)
        for stage in range(pp):
            layers = range(start, start + base + (stage < extra))
            start = layers.stop
            moe_count = sum(i in moe for i in layers)
            counts.append({"embed": int(stage == 0), "layer": len(layers), "dense": len(layers) - moe_count,
                           "moe": moe_count, "head": int(stage == pp - 1)})
        return counts

    @functools.cache
    def _stages(self, pp: int) -> tuple[tuple[tuple[ParamTensor, int], ...], ...]:
        """Each pipeline stage's tensors and how many of each it holds."""
        stages = []
        for stage, count in enumerate(self._place_counts(pp)):
            tensors = [(p, count[p.place]) for p in self.param_tensors()]
            if stage == pp - 1 and pp > 1 and self.tie_word_embeddings:
                tensors.append((ParamTensor("lm_head", self.vocab_size * self.hidden_size, "vocab", "head", "head"), 1))
            stages.append(tuple(tensors))
        return tuple(stages)

    def _shard(self, p: ParamTensor, tp: int, expert_shards: int) -> int:
        """Elements of `p` on one TP rank; a rank holding a part of the vocabulary holds ceil(V / tp) rows."""
        if p.split == "experts":
            return p.numel // expert_shards
        if p.split == "none" or tp == 1:
            return p.numel
        if p.split == "kv_heads":
            return p.numel * max(1, self.num_kv_heads // tp) // self.num_kv_heads
        if p.split == "vocab":
            return -(-self.vocab_size // tp) * (p.numel // self.vocab_size)
        return p.numel // tp


class StageParams(NamedTuple):
    """Parameter elements and tensors on one GPU, and how many of them are routed experts."""

    elements: int
    tensors: int
    expert_elements: int = 0
    expert_tensors: int = 0


def _load_config(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON config: {e}") from None
