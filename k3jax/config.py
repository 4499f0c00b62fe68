"""The model's configuration: every field with its default (`model_config`), checks (`validate`), derived values.

`config.model` is an ml_collections ConfigDict, locked: setting a field it does not have raises (so a typo such as
`m.d_modle = 32` is an error); `with m.unlocked():` adds one deliberately. Experiment configs start from
`model_config()` and change fields; `K3Model` calls `validate` before building anything, so a bad config fails
with a ValueError naming the field.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections

LAYER_TYPES = ("kda", "mla")
RESIDUAL_MODES = ("block", "full", "none")
RESIDUAL_READOUTS = ("layer", "group")
RESIDUAL_BACKWARDS = ("fused", "barrier")
# The dtype the AttnRes sources (the embedding and the closed block sums) are stored in: "compute" is `model.dtype`.
# The partial sum of the current block stays fp32 either way; the read-outs compute in fp32.
RESIDUAL_SOURCE_DTYPES = ("compute", "float32", "bfloat16")
SHORT_CONV_BACKWARDS = ("auto", "fused", "kernel")
KDA_GATES = ("bounded", "softplus")
ATTENTION_IMPLS = ("auto", "cudnn", "xla")
MLA_DECODE_IMPLS = ("auto", "xla", "pallas")
BALANCERS = ("quantile", "none", "aux_loss", "sign")
BALANCER_METHODS = ("exact", "histogram", "article")
# How the routed experts run: "sorted" (the token-slots sorted by expert, grouped GEMMs), "dense" (every expert on
# every token, the unchosen weighted 0), "auto" (dense for a call of few tokens, T <= E <= T·k, else sorted).
MOE_ROUTINGS = ("auto", "sorted", "dense")
DTYPES = ("float32", "bfloat16", "float16")
# What each decoder layer keeps for its backward pass (the jax.checkpoint policy of a layer, by name), the scanned
# groups' layers alike (`k3jax.model.recomputing_scan`): "none" everything (no rematerialisation); "full" only its
# inputs (the rest is recomputed in the backward pass); "save_attention" its inputs and cuDNN attention's output and
# softmax statistics, so the backward pass does not run the attention forward again; "save_mixers" that and the KDA
# kernels' output and residuals, so neither mixer's forward runs again (the most memory: the KDA residuals are
# several times the layer's activations).
REMAT_POLICIES = ("none", "full", "save_attention", "save_mixers")


def model_config() -> ml_collections.ConfigDict:
  """All model fields with defaults (a small dense model); see the configs under experiments/configs/."""
  m = ml_collections.ConfigDict()
  m.vocab_size = 264                      # byte-level: 256 bytes + specials (the tokenizer defines the ids)
  m.d_model = 128
  m.num_layers = 4
  m.layer_pattern = ("kda", "kda", "kda", "mla")  # cycled over the layers
  m.last_layer = "mla"                    # type forced on the last layer; None keeps the pattern's
  m.dtype = "bfloat16"                    # compute dtype; parameters are fp32
  m.norm_eps = 1e-6
  m.tie_embeddings = False
  m.z_loss_coef = 0.0                     # aux["z_loss"] = coef · mean(logsumexp(logits)²)
  m.remat = "none"                        # rematerialisation of each layer: one of REMAT_POLICIES
  # The unrolled layers' policy (`layer_plan`: those outside the scanned groups), None for `remat`'s. Keeping what a
  # scanned layer keeps costs copies into the scan's stacked residuals; an unrolled layer's cost only memory.
  m.remat_unrolled = None
  # Run the repeating group of layers (`layer_plan`) under one jax.lax.scan over stacked parameters. False unrolls
  # every layer: the checkpoint layout of models before scanning (see k3jax.model.scanned_layout) and the scan's
  # reference in the tests; it compiles each layer separately.
  m.scan_layers = True
  m.ffn_hidden = 512                      # dense SiTU-GLU width (layer 0 with MoE on, every layer with it off)

  m.kda = ml_collections.ConfigDict()
  m.kda.num_heads = 2
  m.kda.head_dim = None                   # K = V; None: d_model // num_heads
  m.kda.conv_size = 4
  m.kda.gate = "bounded"                  # bounded: γ_min·σ(·) (the K3 article); softplus: Kimi Linear (ablation)
  m.kda.lower_bound = -5.0                # γ_min of the bounded gate
  m.kda.gate_rank = None                  # None: full-rank decay and output gates (assumed); int: d -> rank -> H·K
  m.kda.backend = "auto"                  # chunk_kda backend
  m.kda.conv_backward = "auto"            # the short conv's backward: one Pallas kernel (auto: on GPU), or as XLA fuses it

  m.mla = ml_collections.ConfigDict()
  m.mla.num_heads = 2
  m.mla.qk_head_dim = None                # None: d_model // num_heads
  m.mla.v_head_dim = None                 # None: qk_head_dim
  m.mla.kv_lora_rank = 64                 # r_kv, the cached latent width
  m.mla.q_lora_rank = None                # None: full-rank W_q
  m.mla.attention_impl = "auto"           # auto: cudnn on GPU in bf16/fp16, xla otherwise
  m.mla.decode_impl = "auto"              # absorbed decode: auto = the Pallas split-K kernel on GPU, xla otherwise
  m.mla.max_documents = 16               # cuDNN packs at most this many documents (and padding) a row; more: blocked

  m.moe = ml_collections.ConfigDict()
  m.moe.enabled = False
  m.moe.num_experts = 8
  m.moe.top_k = 2
  m.moe.num_shared_experts = 1
  m.moe.expert_hidden = 64                # routed expert width, in latent space
  m.moe.shared_hidden = 128               # each shared expert's width, at full d
  m.moe.latent_dim = None                 # ℓ; must be set when enabled
  m.moe.routed_scaling = 1.0
  m.moe.balancer = "quantile"
  m.moe.balancer_eta = 1.0
  m.moe.balancer_method = "exact"        # exact / histogram: the cut-off quantile; article: the K3 article's §4.2
  m.moe.correction_step = 16.0            # article: the largest bias change a step, in cut-off gaps (balancer.update)
  m.moe.load_decay = 0.5                  # article: the newest step's weight in the decayed load
  m.moe.correction_bound = 1.0            # article: |bias| at most this
  m.moe.load_unit = 8.0                   # article: the load deviation (even shares) the step is proportional up to
  m.moe.aux_loss_coef = 1e-2
  m.moe.sign_update_rate = 1e-3
  m.moe.first_dense_layers = 1
  m.moe.routing = "auto"                  # one of MOE_ROUTINGS (docs/design.md, LatentMoE: the decode path)
  m.moe.glu_epilogue = True               # the routed SiTU-GLU in the grouped GEMMs' epilogues where they apply

  m.residual = ml_collections.ConfigDict()
  m.residual.mode = "block"               # block AttnRes, full AttnRes, or none (pre-norm residual)
  m.residual.block_size = 2               # decoder layers per AttnRes block
  m.residual.readout = "layer"            # scanned groups' buffer of sources: read per read-out, or once per group
  m.residual.backward = "fused"           # the read-out's backward as XLA fuses it, or its reductions over the
                                          # tokens behind an optimization barrier (k3jax.ops.attnres)
  m.residual.source_dtype = "float32"     # one of RESIDUAL_SOURCE_DTYPES: the stored sources' dtype
  return m.lock()                         # setting a field it does not have is an error (a typo, not a new field)


def validate(m: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first missing, mistyped or inconsistent field of `config.model`."""
  _positive_int(m, "vocab_size", "d_model", "num_layers", "ffn_hidden")
  _one_of(m, "dtype", DTYPES)
  _positive_float(m, "norm_eps")
  pattern = _get(m, "layer_pattern")
  if isinstance(pattern, str) or not pattern:
    raise ValueError(f"model.layer_pattern must be a non-empty tuple of layer types {LAYER_TYPES}, got {pattern!r}")
  for t in pattern:
    if t not in LAYER_TYPES:
      raise ValueError(f"model.layer_pattern has an unknown layer type {t!r}; known types: {LAYER_TYPES}")
  last = _get(m, "last_layer")
  if last is not None and last not in LAYER_TYPES:
    raise ValueError(f"model.last_layer must be one of {LAYER_TYPES} or None, got {last!r}")
  remat = _get(m, "remat")
  if remat not in REMAT_POLICIES:
    hint = " (True is today's 'full', False 'none')" if isinstance(remat, bool) else ""
    raise ValueError(f"model.remat must be one of {REMAT_POLICIES}, got {remat!r}{hint}")
  if _get(m, "remat_unrolled") not in (None, *REMAT_POLICIES):
    raise ValueError(f"model.remat_unrolled must be None (as model.remat) or one of {REMAT_POLICIES}, "
                     f"got {m.remat_unrolled!r}")
  if not isinstance(_get(m, "scan_layers"), bool):
    raise ValueError(f"model.scan_layers must be a bool, got {m.scan_layers!r}")
  if _get(m, "z_loss_coef") < 0:
    raise ValueError(f"model.z_loss_coef must be >= 0, got {m.z_loss_coef}")
  types = layer_types(m)

  if "kda" in types:
    _positive_int(m, "kda.num_heads", "kda.conv_size")
    kda_head_dim(m)
    _one_of(m, "kda.gate", KDA_GATES)
    if m.kda.gate == "bounded" and not _get(m, "kda.lower_bound") < 0:
      raise ValueError(f"model.kda.lower_bound must be negative for the bounded gate, got {m.kda.lower_bound}")
    _optional_positive_int(m, "kda.gate_rank")
    _one_of(m, "kda.backend", ("auto", "xla", "pallas"))
    _one_of(m, "kda.conv_backward", SHORT_CONV_BACKWARDS)
  if "mla" in types:
    _positive_int(m, "mla.num_heads", "mla.kv_lora_rank", "mla.max_documents")
    mla_head_dims(m)
    _optional_positive_int(m, "mla.q_lora_rank")
    _one_of(m, "mla.attention_impl", ATTENTION_IMPLS)
    _one_of(m, "mla.decode_impl", MLA_DECODE_IMPLS)

  _one_of(m, "residual.mode", RESIDUAL_MODES)
  _positive_int(m, "residual.block_size")
  _one_of(m, "residual.readout", RESIDUAL_READOUTS)
  _one_of(m, "residual.backward", RESIDUAL_BACKWARDS)
  _one_of(m, "residual.source_dtype", RESIDUAL_SOURCE_DTYPES)

  if _get(m, "moe.enabled"):
    validate_moe(m.moe)
    first = _get(m, "moe.first_dense_layers")
    if not isinstance(first, int) or not 0 <= first <= m.num_layers:
      raise ValueError(f"model.moe.first_dense_layers must be an int in [0, num_layers={m.num_layers}], got {first!r}")


def validate_moe(moe: ml_collections.ConfigDict, *, root: str = "model.moe") -> None:
  """Raises ValueError naming the first missing, mistyped or inconsistent field of a MoE config: `config.model.moe`
  (`validate` calls this when the MoE is enabled) or the ConfigDict a `LatentMoE` is built from (`root="moe"`)."""
  for f in ("num_experts", "top_k", "expert_hidden", "latent_dim"):
    if _get(moe, f, root) is None:
      what = " (the latent width ℓ)" if f == "latent_dim" else ""
      raise ValueError(f"{root}.{f} must be set for the MoE layer{what}")
  _positive_int(moe, "num_experts", "top_k", "expert_hidden", "latent_dim", root=root)
  if moe.top_k > moe.num_experts:
    raise ValueError(f"{root}.top_k={moe.top_k} exceeds {root}.num_experts={moe.num_experts}")
  shared = _get(moe, "num_shared_experts", root)
  if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
    raise ValueError(f"{root}.num_shared_experts must be an int >= 0, got {shared!r}")
  if shared:
    _positive_int(moe, "shared_hidden", root=root)
  _one_of(moe, "balancer", BALANCERS, root=root)
  _one_of(moe, "balancer_method", BALANCER_METHODS, root=root)
  if moe.get("routing", "auto") not in MOE_ROUTINGS:
    raise ValueError(f"{root}.routing must be one of {MOE_ROUTINGS}, got {moe.routing!r}")
  if not isinstance(moe.get("glu_epilogue", True), bool):
    raise ValueError(f"{root}.glu_epilogue must be a bool, got {moe.glu_epilogue!r}")
  for f, ok, what in (("correction_step", lambda v: v > 0, "> 0"), ("load_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
                      ("correction_bound", lambda v: v > 0, "> 0"), ("load_unit", lambda v: v > 0, "> 0")):
    v = moe.get(f, None)
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v)):
      raise ValueError(f"{root}.{f} must be a number {what}, got {v!r}")


# The settings each balancer reads (`moe.balancer`, or `moe.balancer_method` under "quantile"). `correction_rate` is
# the article method's first, fixed step (score units), in configs saved before `correction_step` replaced it.
_BALANCER_FIELDS = {"none": (), "aux_loss": ("aux_loss_coef",), "sign": ("sign_update_rate",),
                    "exact": ("balancer_eta",), "histogram": ("balancer_eta",),
                    "article": ("correction_step", "load_decay", "correction_bound", "load_unit", "correction_rate")}


def unread_moe_fields(moe: dict) -> set[str]:
  """The fields of a saved MoE config (`model.moe` as JSON) that a model built from it never reads: all but
  `enabled` when the MoE is off; else the settings of the balancers it does not run (and `balancer_method` unless
  the balancer is "quantile"). Two configs that differ only there train the same model."""
  if not moe.get("enabled", False):
    return set(moe) - {"enabled"}
  quantile = moe.get("balancer") == "quantile"
  active = moe.get("balancer_method") if quantile else moe.get("balancer")
  unread = {f for name, fields in _BALANCER_FIELDS.items() if name != active for f in fields}
  unread -= set(_BALANCER_FIELDS.get(active, ()))
  return (unread | (set() if quantile else {"balancer_method"})) & set(moe)


def saved_model_fields(d: dict) -> dict:
  """A model config saved as JSON (a dict) before the fields it lacks existed, with the values that rebuild the model it
  was trained as: `scan_layers` False (its checkpoints hold every layer unrolled), `remat` by name (True "full", False
  "none"), `remat_unrolled` None (as `remat`), `residual.readout` "layer" (each read-out read the buffer),
  `residual.backward` and `kda.conv_backward` "fused", `residual.source_dtype` "float32" (the sources were stored in
  fp32), `moe.load_unit` 1 (the article balancer's unit before it was a setting), `moe.glu_epilogue` False (the
  SiTU-GLU between the grouped GEMMs). Options removed since, each computing what remains: `scan_alike_layers` (the
  same layers and parameters) and `residual.forward` are dropped, `residual.backward="kernel"` is read as "fused",
  `remat="save_kda_out"` as "full" (it kept the KDA output, which spared no kernel: their backward reads residuals
  only their forward writes)."""
  d = dict(d)
  d.setdefault("scan_layers", False)
  d.setdefault("remat_unrolled", None)
  d.pop("scan_alike_layers", None)
  if "kda" in d:
    d["kda"] = {"conv_backward": "fused", **d["kda"]}
  if "residual" in d:
    residual = {"readout": "layer", "backward": "fused", "source_dtype": "float32", **d["residual"]}
    residual.pop("forward", None)
    if residual["backward"] == "kernel":
      residual["backward"] = "fused"
    d["residual"] = residual
  if isinstance(d.get("moe"), dict) and d["moe"]:
    d["moe"] = {"load_unit": 1.0, "glu_epilogue": False, **d["moe"]}
  if isinstance(d.get("remat"), bool) or d.get("remat") == "save_kda_out":
    d["remat"] = "none" if d["remat"] is False else "full"
  return d


def layer_types(m) -> tuple[str, ...]:
  """The type of every decoder layer: `layer_pattern` cycled, then `last_layer` on the last one."""
  pattern, n = tuple(m.layer_pattern), m.num_layers
  types = [pattern[i % len(pattern)] for i in range(n)]
  if m.last_layer is not None:
    types[-1] = m.last_layer
  return tuple(types)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How the decoder runs its layers: `num_groups` repeats of a group of `group_size` consecutive layers from
  layer `start` on under one scan (group g holds layers start + g·group_size + j, j < group_size), every other
  layer (`unrolled`, in order) one by one. Positions j of all groups share a layer type and FFN kind."""
  unrolled: tuple[int, ...]
  start: int
  group_size: int
  num_groups: int

  def position(self, j: int) -> tuple[int, ...]:
    """The layers at position j of the groups, in order."""
    return tuple(self.start + g * self.group_size + j for g in range(self.num_groups))

  @property
  def end(self) -> int:
    """One past the last scanned layer."""
    return self.start + self.num_groups * self.group_size


def layer_plan(m) -> LayerPlan:
  """The scanned groups: the longest run of whole repeats of a group of `len(layer_pattern)` consecutive layers
  in which every position keeps its layer type and FFN kind (dense or MoE), when it repeats at least twice and
  `scan_layers` is on. Of runs with as many groups, one starting at a multiple of the pattern's length (its
  group reads as the pattern), else the earliest. The layers before it (a dense first layer, a remainder) and
  after it (a forced `last_layer`) are unrolled.

  E.g. 12 layers of (kda, kda, kda, mla), layer 0 dense: layers 0-3 unrolled, then 2 groups over layers 4-11."""
  n, p = m.num_layers, len(m.layer_pattern)
  kinds = [(t, uses_moe(m, i)) for i, t in enumerate(layer_types(m))]
  best = (1, False, 0)  # (groups, aligned, -start): more groups first, then aligned, then earlier
  for s in range(n - 2 * p + 1) if m.scan_layers else ():
    groups = 1
    while s + (groups + 1) * p <= n and kinds[s + groups * p:s + (groups + 1) * p] == kinds[s:s + p]:
      groups += 1
    best = max(best, (groups, s % p == 0, -s))
  groups, _, start = best[0], best[1], -best[2]
  if groups < 2:
    return LayerPlan(tuple(range(n)), n, p, 0)
  end = start + groups * p
  return LayerPlan(tuple(range(start)) + tuple(range(end, n)), start, p, groups)


def uses_moe(m, layer: int) -> bool:
  return bool(m.moe.enabled) and layer >= m.moe.first_dense_layers


def compute_dtype(m):
  return jnp.dtype(m.dtype)


def residual_source_dtype(m):
  """The dtype the AttnRes sources are stored in (`residual.source_dtype`; "compute": `model.dtype`)."""
  name = m.residual.source_dtype
  return compute_dtype(m) if name == "compute" else jnp.dtype(name)


def kda_head_dim(m) -> int:
  return _head_dim(m, "kda.num_heads", m.kda.head_dim, "kda.head_dim")


def mla_head_dims(m) -> tuple[int, int]:
  """(qk_head_dim, v_head_dim)."""
  qk = _head_dim(m, "mla.num_heads", m.mla.qk_head_dim, "mla.qk_head_dim")
  v = qk if m.mla.v_head_dim is None else m.mla.v_head_dim
  if not isinstance(v, int) or v <= 0:
    raise ValueError(f"model.mla.v_head_dim must be a positive int or None, got {v!r}")
  return qk, v


def _head_dim(m, heads_field, head_dim, head_dim_field) -> int:
  heads = _get(m, heads_field)
  if head_dim is None:
    if m.d_model % heads:
      raise ValueError(f"model.{heads_field}={heads} does not divide model.d_model={m.d_model}; choose a divisor "
                       f"or set model.{head_dim_field} explicitly")
    return m.d_model // heads
  if not isinstance(head_dim, int) or head_dim <= 0:
    raise ValueError(f"model.{head_dim_field} must be a positive int or None, got {head_dim!r}")
  return head_dim


def _get(m, dotted: str, root: str = "model"):
  node = m
  for part in dotted.split("."):
    if part not in node:
      raise ValueError(f"{root}.{dotted} is missing from the config (see k3jax.config.model_config for every field)")
    node = node[part]
  return node


def _positive_int(m, *fields, root: str = "model"):
  for f in fields:
    v = _get(m, f, root)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise ValueError(f"{root}.{f} must be a positive int, got {v!r}")


def _optional_positive_int(m, field):
  v = _get(m, field)
  if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
    raise ValueError(f"model.{field} must be a positive int or None, got {v!r}")


def _positive_float(m, field):
  v = _get(m, field)
  if not isinstance(v, (int, float)) or v <= 0:
    raise ValueError(f"model.{field} must be a positive number, got {v!r}")


def _one_of(m, field, choices, root: str = "model"):
  v = _get(m, field, root)
  if v not in choices:
    raise ValueError(f"{root}.{field} must be one of {choices}, got {v!r}")
