"""The one table of tensor names, dtypes and axes of an exported model.

It drives the ONNX export (input/output names, dynamic axes), the runtime's static buffers and
(later) TensorRT optimization profiles, and it is written into the manifest. Nothing else spells a
tensor name.

Axes are symbols for dynamic dimensions and ints for fixed ones:
  batch     B    sequences in the batch (the runtime drives B = 1)
  tokens    T    new tokens this call: a prompt chunk, 1 for decode, the tree size for verification
  total     P+T  committed positions already in the cache (P) plus the new tokens
  rows      R    rows whose logits are computed: all T for decode and verification, the last for prefill
  capacity  C    rows of a KV cache buffer (the runtime's: max_seq_len)

Inputs                                       Outputs
  input_ids       int64 [B, T]                 logits             float32 [B, R, V]   at the rows logits_rows names
  position_ids    int64 [B, T]                 hidden_states      float32 [B, T, H]   final, post-norm
  attention_mask  bool  [B, T, P+T]            aux_hidden_states  float32 [B, T, k*H] inputs of chosen layers
  logits_rows     int64 [B, R]                 present_key.{i}    float32 [B, Hkv, C, D]  the cache, new rows written
  past_key.{i}    float32 [B, Hkv, C, D]       present_value.{i}  float32 [B, Hkv, C, D]
  past_value.{i}  float32 [B, Hkv, C, D]

attention_mask (contract 3): what each new token may attend to, over the P committed positions
(normally all True) and the T new ones (the tree's ancestor mask; causal for a chain). P is its
width minus T.

KV caches (contract 3): one head-major buffer per layer and K/V, rows [0, P) committed. The graph
writes the new tokens' K/V at rows P..P+T-1 and attends over the P+T valid rows, not the capacity.
Bind the same buffer as past and present and the update is in place (ORT's GroupQueryAttention,
export/gqa.py); a plain session.run returns a new cache of max(C, P+T) rows instead, so an empty
cache grown by feeding each output back also works (ModelIO.feeds).

`logits_rows` (contract 2): a prefill chunk needs the next-token logits of its last row only, and
the vocabulary projection is a large share of a prefill's work (21% of SmolLM2-135M's weights), so
the graph projects only the rows it is asked for.

Heads graphs (HeadsIO) take the target's final hidden state and have no KV:
  hidden_states        float32 [B, T, H]      ->  head_topk_ids       int64   [B, T, N, K]
                                                  head_topk_logprobs  float32 [B, T, N, K]
N heads (Medusa: head n predicts the token n + 2 places after the hidden state's position), the K
most likely tokens of each head's own distribution in descending order with their log-probabilities.

EAGLE head graphs (EagleIO) are one decoder layer with a KV cache of their own; row j of that cache
holds token x_{j+1} read with the feature of position j, and predicts x_{j+2}:
  input_ids       int64 [B, T]          ->  topk_ids        int64   [B, R, K]  draft-vocabulary ids
  position_ids    int64 [B, T]              topk_logprobs   float32 [B, R, K]  log-softmax, descending
  attention_mask  bool  [B, T, P+T]         hidden_states   float32 [B, T, H]  the head's output state
  logits_rows     int64 [B, R]              present_key.0 / present_value.0    the cache, new rows written
  features        float32 [B, T, F]     the target's feature (EAGLE-1: its final state, F = H; EAGLE-3:
                                        three layers' inputs, F = 3H); zeros on rows that read the
                                        head's own state instead
  draft_hidden    float32 [B, T, H]     the head's own output state of the row's parent (a draft level
                                        beyond the first); zeros on rows that read the target's feature
  past_key.0 / past_value.0 float32 [B, Hkv, C, D]
The head's attention_mask says what each new row sees among *all* P cached rows, not only the
committed ones: while a draft tree grows, the rows of earlier levels sit in the cache past the
committed ones, and a new row must see its own ancestors among them and nothing else (the target
graph's mask has the same shape; its runtime only ever sets the past part to all-visible).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specexport.errors import SpecexportError

# -- the tensor names: spelled here and nowhere else (tests/test_io_names.py checks) ---------------------
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS_ROWS = "logits_rows"
LOGITS = "logits"
HIDDEN_STATES = "hidden_states"
AUX_HIDDEN_STATES = "aux_hidden_states"
HEAD_TOPK_IDS = "head_topk_ids"              # Medusa heads graph
HEAD_TOPK_LOGPROBS = "head_topk_logprobs"
FEATURES = "features"                        # EAGLE head graph
DRAFT_HIDDEN = "draft_hidden"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE = "past_key", "past_value", "present_key", "present_value"


def past_names(layer: int) -> tuple[str, str]:
    """(past_key.{layer}, past_value.{layer}): a layer's cache inputs."""
    return f"{PAST_KEY}.{layer}", f"{PAST_VALUE}.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    """(present_key.{layer}, present_value.{layer}): a layer's cache outputs (the same buffers, bound in place)."""
    return f"{PRESENT_KEY}.{layer}", f"{PRESENT_VALUE}.{layer}"


DYNAMIC_AXES = ("batch", "tokens", "total", "rows", "capacity")
# 2: logits_rows (logits only for the rows asked for); 3: in-place KV caches [B, Hkv, C, D] and
# attention_mask over past + new. Bump on any change here.
CONTRACT_VERSION = 3


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                     # numpy dtype name: "int64", "float32", "bool"
    axes: tuple                    # str symbol (dynamic) or int (fixed) per dimension

    def shape(self, **sizes: int) -> tuple[int, ...]:
        """Concrete shape for the given symbol sizes, e.g. shape(batch=1, tokens=4)."""
        return tuple(sizes[a] if isinstance(a, str) else a for a in self.axes)


@dataclass(frozen=True)
class ModelIO:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    aux_hidden_layers: tuple[int, ...] = ()          # layers whose *inputs* go to aux_hidden_states
    inputs: tuple[TensorSpec, ...] = field(init=False)
    outputs: tuple[TensorSpec, ...] = field(init=False)

    def __post_init__(self):
        kv_axes = ("batch", self.num_kv_heads, "capacity", self.head_dim)
        ins = [
            TensorSpec(INPUT_IDS, "int64", ("batch", "tokens")),
            TensorSpec(POSITION_IDS, "int64", ("batch", "tokens")),
            TensorSpec(ATTENTION_MASK, "bool", ("batch", "tokens", "total")),
            TensorSpec(LOGITS_ROWS, "int64", ("batch", "rows")),
        ]
        outs = [
            TensorSpec(LOGITS, "float32", ("batch", "rows", self.vocab_size)),
            TensorSpec(HIDDEN_STATES, "float32", ("batch", "tokens", self.hidden_size)),
        ]
        if self.aux_hidden_layers:
            width = len(self.aux_hidden_layers) * self.hidden_size
            outs.append(TensorSpec(AUX_HIDDEN_STATES, "float32", ("batch", "tokens", width)))
        for i in range(self.num_layers):
            past_k, past_v = self.past_names(i)
            ins += [TensorSpec(past_k, "float32", kv_axes), TensorSpec(past_v, "float32", kv_axes)]
            new_k, new_v = self.present_names(i)
            outs += [TensorSpec(new_k, "float32", kv_axes), TensorSpec(new_v, "float32", kv_axes)]
        object.__setattr__(self, "inputs", tuple(ins))
        object.__setattr__(self, "outputs", tuple(outs))

    past_names = staticmethod(past_names)
    present_names = staticmethod(present_names)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def past_input_names(self) -> list[str]:
        """past_key.0, past_value.0, past_key.1, ... (the inputs after the four fixed ones)."""
        return [n for i in range(self.num_layers) for n in self.past_names(i)]

    def empty_caches(self, batch: int = 1, capacity: int = 0) -> list:
        """Zero KV caches [B, Hkv, capacity, D], one per past input."""
        import numpy as np

        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        return [np.zeros(shape, np.float32) for _ in range(2 * self.num_layers)]

    def feeds(self, tokens, *, positions=None, mask=None, past=None, past_length=None, rows=None) -> dict:
        """The input dict of one plain session.run on tokens [B, T] (checks and tools; the runtime
        binds its buffers instead). past: the caches (default empty); past_length: their committed
        rows (default: all of them, which is what feeding back each call's present outputs gives).
        Defaults: positions continue the past, a causal mask over the new tokens, logits for every row."""
        import numpy as np

        tokens = np.atleast_2d(np.asarray(tokens, np.int64))
        B, T = tokens.shape
        past = self.empty_caches(B) if past is None else past
        P = past[0].shape[2] if past_length is None else past_length
        positions = P + np.arange(T) if positions is None else positions
        mask = np.tril(np.ones((T, T), bool)) if mask is None else np.asarray(mask, bool)
        attention = np.ones((B, T, P + T), bool)
        attention[:, :, P:] = mask
        rows = np.arange(T) if rows is None else rows
        feeds = {INPUT_IDS: tokens,
                 POSITION_IDS: np.ascontiguousarray(np.broadcast_to(np.asarray(positions, np.int64), (B, T))),
                 ATTENTION_MASK: attention,
                 LOGITS_ROWS: np.ascontiguousarray(np.broadcast_to(np.asarray(rows, np.int64),
                                                                     (B, np.asarray(rows).shape[-1])))}
        feeds.update(zip(self.past_input_names, past))
        return feeds

    def presents(self, outputs: dict) -> list:
        """The caches a session.run returned (name -> array), in past-input order: the next call's past."""
        return [outputs[n] for i in range(self.num_layers) for n in self.present_names(i)]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def spec(self, name: str) -> TensorSpec:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in this model's IO table")

    def shape_ranges(self, *, max_seq_len: int, max_tokens: int, opt_tokens: int = 1) -> dict:
        """(min, opt, max) shape per input, for TensorRT optimization profiles. Batch is 1; the caches
        are the runtime's, max_seq_len rows."""
        lo = {"batch": 1, "tokens": 1, "total": 1, "rows": 1, "capacity": max_seq_len}
        opt = {"batch": 1, "tokens": opt_tokens, "total": max_seq_len // 2, "rows": opt_tokens, "capacity": max_seq_len}
        hi = {"batch": 1, "tokens": max_tokens, "total": max_seq_len, "rows": max_tokens, "capacity": max_seq_len}
        return {t.name: (t.shape(**lo), t.shape(**opt), t.shape(**hi)) for t in self.inputs}

    # -- manifest round trip ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("inputs", "outputs")}
        d["contract"] = CONTRACT_VERSION
        d["aux_hidden_layers"] = list(self.aux_hidden_layers)
        d["inputs"] = [_spec_dict(t) for t in self.inputs]
        d["outputs"] = [_spec_dict(t) for t in self.outputs]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelIO":
        io = cls(
            num_layers=d["num_layers"], num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"],
            hidden_size=d["hidden_size"], vocab_size=d["vocab_size"],
            aux_hidden_layers=tuple(d.get("aux_hidden_layers", ())),
        )
        names = [t.get("name") if isinstance(t, dict) else t for t in d.get("inputs", io.input_names)]
        if d.get("contract", 1) != CONTRACT_VERSION or names != io.input_names:
            raise SpecexportError(f"manifest IO table is graph contract {d.get('contract', 1)}; this version runs "
                                  f"contract {CONTRACT_VERSION} (rebuild with `specexport build`)")
        return io


@dataclass(frozen=True)
class HeadsIO:
    """The IO table of a heads graph (Medusa): see the module docstring."""
    hidden_size: int
    num_heads: int
    top_k: int
    inputs: tuple[TensorSpec, ...] = field(init=False)
    outputs: tuple[TensorSpec, ...] = field(init=False)

    def __post_init__(self):
        per_head = ("batch", "tokens", self.num_heads, self.top_k)
        object.__setattr__(self, "inputs", (TensorSpec(HIDDEN_STATES, "float32", ("batch", "tokens", self.hidden_size)),))
        object.__setattr__(self, "outputs", (TensorSpec(HEAD_TOPK_IDS, "int64", per_head),
                                             TensorSpec(HEAD_TOPK_LOGPROBS, "float32", per_head)))

    input_names = ModelIO.input_names
    output_names = ModelIO.output_names

    def to_dict(self) -> dict:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads, "top_k": self.top_k,
                "inputs": [_spec_dict(t) for t in self.inputs], "outputs": [_spec_dict(t) for t in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadsIO":
        io = cls(hidden_size=d["hidden_size"], num_heads=d["num_heads"], top_k=d["top_k"])
        if [t.get("name") for t in d.get("outputs", [])] != io.output_names:
            raise SpecexportError("manifest heads IO table does not match this version's tensor layout (rebuild it)")
        return io


def _spec_dict(t: TensorSpec) -> dict:
    return {"name": t.name, "dtype": t.dtype, "axes": list(t.axes)}


@dataclass(frozen=True)
class EagleIO:
    """The IO table of an EAGLE head graph: see the module docstring."""
    version: int                     # 1 (EAGLE-1/2) or 3
    hidden_size: int
    feature_width: int               # H (EAGLE-1) or 3H (EAGLE-3)
    num_kv_heads: int
    head_dim: int
    top_k: int                       # ids per row the graph returns (the widest expansion + 1)
    inputs: tuple[TensorSpec, ...] = field(init=False)
    outputs: tuple[TensorSpec, ...] = field(init=False)
    num_layers = 1                   # one decoder layer: past_key.0 / past_value.0

    def __post_init__(self):
        kv_axes = ("batch", self.num_kv_heads, "capacity", self.head_dim)
        per_row = ("batch", "rows", self.top_k)
        object.__setattr__(self, "inputs", (
            TensorSpec(INPUT_IDS, "int64", ("batch", "tokens")),
            TensorSpec(POSITION_IDS, "int64", ("batch", "tokens")),
            TensorSpec(ATTENTION_MASK, "bool", ("batch", "tokens", "total")),
            TensorSpec(LOGITS_ROWS, "int64", ("batch", "rows")),
            TensorSpec(FEATURES, "float32", ("batch", "tokens", self.feature_width)),
            TensorSpec(DRAFT_HIDDEN, "float32", ("batch", "tokens", self.hidden_size)),
            *(TensorSpec(n, "float32", kv_axes) for n in ModelIO.past_names(0))))
        object.__setattr__(self, "outputs", (
            TensorSpec(TOPK_IDS, "int64", per_row),
            TensorSpec(TOPK_LOGPROBS, "float32", per_row),
            TensorSpec(HIDDEN_STATES, "float32", ("batch", "tokens", self.hidden_size)),
            *(TensorSpec(n, "float32", kv_axes) for n in ModelIO.present_names(0))))

    input_names = ModelIO.input_names
    output_names = ModelIO.output_names
    past_names = staticmethod(ModelIO.past_names)
    present_names = staticmethod(ModelIO.present_names)
    spec = ModelIO.spec

    def empty_caches(self, batch: int = 1, capacity: int = 0) -> list:
        import numpy as np

        return [np.zeros((batch, self.num_kv_heads, capacity, self.head_dim), np.float32) for _ in range(2)]

    def feeds(self, tokens, *, features=None, draft_hidden=None, positions=None, mask=None, past=None,
              rows=None) -> dict:
        """The input dict of one plain session.run (checks and tools): tokens [T] at positions [T]
        (default: after the past), features [T, F] and draft_hidden [T, H] (default zeros), mask
        [T, P+T] over every cached row and the new ones (default: all past visible, causal new)."""
        import numpy as np

        tokens = np.asarray(tokens, np.int64).reshape(-1)
        T = len(tokens)
        past = self.empty_caches() if past is None else past
        P = past[0].shape[2]
        if mask is None:
            mask = np.ones((T, P + T), bool)
            mask[:, P:] = np.tril(np.ones((T, T), bool))
        zeros = np.zeros
        return {INPUT_IDS: tokens[None],
                POSITION_IDS: np.asarray(P + np.arange(T) if positions is None else positions, np.int64)[None],
                ATTENTION_MASK: np.asarray(mask, bool)[None],
                LOGITS_ROWS: np.asarray(np.arange(T) if rows is None else rows, np.int64).reshape(1, -1),
                FEATURES: np.asarray(zeros((T, self.feature_width)) if features is None else features,
                                       np.float32)[None],
                DRAFT_HIDDEN: np.asarray(zeros((T, self.hidden_size)) if draft_hidden is None else draft_hidden,
                                           np.float32)[None],
                **dict(zip(self.past_names(0), past))}

    def to_dict(self) -> dict:
        return {"version": self.version, "hidden_size": self.hidden_size, "feature_width": self.feature_width,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "top_k": self.top_k,
                "contract": CONTRACT_VERSION,
                "inputs": [_spec_dict(t) for t in self.inputs], "outputs": [_spec_dict(t) for t in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "EagleIO":
        io = cls(version=d["version"], hidden_size=d["hidden_size"], feature_width=d["feature_width"],
                 num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"], top_k=d["top_k"])
        if [t.get("name") for t in d.get("inputs", [])] != io.input_names or d.get("contract") != CONTRACT_VERSION:
            raise SpecexportError("manifest EAGLE head IO table does not match this version's tensor layout "
                                  "(rebuild it)")
        return io
