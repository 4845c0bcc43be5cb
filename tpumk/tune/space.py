"""Tuning spaces: which knobs `tpumk tune` searches, over which values, under which constraints.

A space is a TOML file (schema and examples: tuning_spaces/README.md):

    [space]            name, description
    [knobs.<knob>]     a searched TuningConfig knob: type = "int" (low, high, step),
                       "pow2" (powers of two from low to high), "categorical" (choices) or
                       "computed" (function: choices computed from the build, see COMPUTED)
    [fixed]            knob = value, held for every trial
    [[constraints]]    expr over knobs and model/target facts, why

Knobs neither searched nor fixed keep their TuningConfig defaults. Every candidate value is
checked against TuningConfig's validation when the file loads, and the TuningConfig default of
each searched knob is always one of its candidates (added when the file leaves it out), so the
default configuration is a legal trial the tuner can measure first.

A computed knob's choices depend on the build (model, devices): `TuningSpace.for_build(spec)`
turns it into a categorical knob of the choices its function computes, or leaves it out of the
search when the build has fewer than two. The tuner binds its space to the study's build first.

Constraints are cheap prefilters, checked before a trial is planned; the plan stays the
authority on what builds. They are a small arithmetic language parsed with `ast` and evaluated
by walking the tree (never `eval`): numbers, names, + - * / // % **, chained comparisons,
and/or/not, parentheses and min/max/abs. A name is a TuningConfig knob (with the trial's value,
searched or not) or one of FACTS (from `space_facts`).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tpumk.errors import ConfigError, PlanError, one_line
from tpumk.tomlfile import read_toml
from tpumk.plan.knobs import ALL_REDUCE_WIRES, AUTO_RING_DEPTH, TuningConfig

if TYPE_CHECKING:  # optuna is imported lazily: loading a space should not pay for it
    import optuna

    from tpumk.plan.spec import BuildSpec

SPACES_DIR = Path(__file__).resolve().parents[2] / "tuning_spaces"
DEFAULT_SPACE_PATH = SPACES_DIR / "default.toml"

KNOB_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TuningConfig))
_INT_KNOBS = frozenset(f.name for f in dataclasses.fields(TuningConfig) if f.type in ("int", int))
KINDS = ("int", "pow2", "categorical", "computed")
_KIND_KEYS = {"int": ("type", "low", "high", "step"), "pow2": ("type", "low", "high"),
              "categorical": ("type", "choices"), "computed": ("type", "function")}
_TOP_KEYS = ("space", "knobs", "fixed", "constraints")

# Every fact `space_facts` gives, with what it is (tuning_spaces/README.md lists the same).
FACTS: dict[str, str] = {
    # target (per TensorCore = one JAX device)
    "vmem_bytes": "VMEM capacity of the target, bytes",
    "hbm_bytes": "HBM capacity of the target, bytes",
    "hbm_bandwidth": "HBM bandwidth of the target, bytes per second",
    "bf16_flops": "bf16 peak of the target, FLOP/s",
    "num_mxus": "matrix units of the target",
    "mxu_size": "columns of one matrix unit (128 or 256)",
    "devices": "devices (TensorCores) one step spans; the model facts below are one device's share",
    # model (on many devices: what one device computes, tpumk.plan.sharding.ShardingPlan.local_config)
    "num_layers": "transformer layers",
    "num_dense_layers": "layers with a dense FFN",
    "num_moe_layers": "mixture-of-experts layers",
    "num_attention_layers": "softmax-attention layers (the qkv / o families stream in these; the KV cache holds one "
                            "layer each): num_layers but for a hybrid's linear layers",
    "num_linear_layers": "a hybrid's linear-attention layers (Gated DeltaNet, KDA: their lin_* families take auto "
                         "tiles, no knobs; each keeps a state pool entry per sequence), else 0",
    "has_dense_layers": "1 if any layer has a dense FFN (the gate_up / down families stream), else 0",
    "has_shared_expert": "1 if MoE layers have a shared expert (the shared_* families stream), else 0",
    "is_moe": "1 for a mixture-of-experts model, else 0",
    "hidden_size": "hidden size H (input dim of qkv, gate_up and lm_head)",
    "num_q_heads": "query heads",
    "num_kv_heads": "key/value heads",
    "head_dim": "head dimension",
    "q_size": "num_q_heads * head_dim (input dim of o)",
    "kv_size": "num_kv_heads * head_dim (lanes of one KV-cache row; MLA: see kv_row_lanes)",
    "is_mla": "1 for a multi-head latent attention model (DeepSeek-V3, Kimi K2), else 0",
    "kv_caches": "paged caches the attention streams: 2 (K and V), 1 for MLA (the latent cache) or a 1-byte "
                 "cache (--kv-dtype: one packed array)",
    "kv_row_lanes": "VMEM lanes of one cache row: kv_size; MLA: kv_lora_rank + qk_rope_head_dim in whole "
                    "128-lane tiles; a 1-byte cache: its packed row's lanes per token (codes and exponent bytes, "
                    "tpumk.model.kv_quant.PagedLayout)",
    "kv_code_bytes": "bytes per element of a cache row: 1 with --kv-dtype fp8 / int8, else dtype_bytes",
    "o_rows": "input dim of the o matrix: q_size; MLA: every head's value lanes as the kernel lays them out "
              "(tpumk.plan.geometry.mla_dims)",
    "ffn_size": "dense FFN width (intermediate size); 0 without dense layers",
    "vocab_size": "vocabulary size (lm_head columns)",
    "num_experts": "routed experts per MoE layer (0 for a dense model); routing is over all of them",
    "experts_per_device": "routed experts one device owns (num_experts on one device, 0 for a dense model)",
    "top_k": "experts each token picks",
    "expert_ffn_size": "FFN width of one routed expert",
    "num_shared_experts": "shared experts per MoE layer",
    "shared_expert_ffn_size": "FFN width of one shared expert",
    "dtype_bytes": "bytes per weight (2 for bfloat16, 4 for float32)",
    "ring_code_bytes": "VMEM bytes per element of a ring tile: 1 with quantized ring matrices (int8, fp8), else dtype_bytes",
    "expert_code_bytes": "VMEM bytes per element of an expert chunk: 1 with quantized experts (int4 takes a byte "
                         "in VMEM), else dtype_bytes",
    "weight_bytes": "bytes of the weights one device holds (all of them on one device)",
    "step_weight_bytes": "weight bytes one decode step reads per device (MoE: expected distinct experts it owns)",
    # shapes of the step
    "batch": "sequences per step",
    "context": "KV-cache capacity per sequence, tokens",
    "q_len": "new tokens per sequence per step",
    "rows": "batch * q_len: token rows one step computes",
    "page_size": "tokens per KV-cache page",
    "pages_per_seq": "KV-cache pages per sequence (ceil(context / page_size))",
    "kv_auto_tile_pages": "pages in about 256 tokens (a fixed size for constraints: kv_tile_pages = 0 is chosen by the plan's timeline model)",
}
assert not set(FACTS) & set(KNOB_NAMES), "a fact may not shadow a knob"

_FUNCS = {"min": min, "max": max, "abs": abs}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_}
_MAX_EXPONENT = 64  # `**` takes only a constant exponent, at most this large (checked on load)
# Every intermediate value of a constraint stays within this many bits (ints) or is finite
# (floats): with constant exponents alone, `((x ** 64) ** 64) ** 64` still grows without bound,
# so the bound is also checked during evaluation, before a power or product is computed.
_MAX_BITS = 1024
_MAX_NODES = 1000  # nodes of one constraint's tree (the evaluation walks each once)
# Python's parser builds the tree recursively (a chain `a + a + ... + a` of a few thousand terms
# exhausts its recursion limit), and the checks and the evaluation recurse too: the text is
# bounded before it is parsed, the tree's depth before it is walked.
_MAX_CHARS = 2000
_MAX_DEPTH = 200
# An int knob's range is searched by Optuna's IntDistribution and checked at a few candidates,
# never listed, but its candidates must stay countable and its bounds sane integers.
MAX_INT_CANDIDATES = 1_000_000
# A bound space's grid up to this many points is walked before a study starts, so constraints
# that admit no configuration are refused in one line (tpumk tune) rather than spent trial by trial.
MAX_GRID_CHECK = 4096
MAX_KNOB_VALUE = 2**53  # exact in a float, far above any real knob value (bytes of a tile, pages)


# ---------------------------------------------------------------------- knobs
@dataclass(frozen=True)
class Knob:
    """One searched knob. int: low..high by step; pow2: powers of two in [low, high];
    categorical: choices; computed: choices that `function` (a name in COMPUTED) computes from
    the build, known only once the space is bound to one (TuningSpace.for_build). `default`
    (the TuningConfig default; for a bound computed knob the choice its auto makes) is always
    among values()."""

    name: str
    kind: str
    low: int | None = None
    high: int | None = None
    step: int = 1
    choices: tuple[Any, ...] = ()
    default: Any = None
    function: str = ""

    def _unbound(self) -> ConfigError:
        return ConfigError(f"knob '{self.name}': its choices are computed from the build by '{self.function}': "
                           "bind the space to a build first (TuningSpace.for_build)")

    def values(self) -> list[Any]:
        if self.kind == "computed":
            raise self._unbound()
        if self.kind == "int":  # at most MAX_INT_CANDIDATES (load_space checks)
            return list(range(self.low, self.high + 1, self.step))
        if self.kind == "pow2":
            vals = [1 << e for e in range(self.low.bit_length() - 1, self.high.bit_length())]
            return sorted(set(vals) | {self.default}) if self.default is not None else vals
        vals = list(self.choices)
        if self.default is not None and self.default not in vals:
            vals.append(self.default)
        return vals

    def size(self) -> int:
        if self.kind == "int":
            return (self.high - self.low) // self.step + 1
        return len(self.values())

    def contains(self, value: Any) -> bool:
        """`value` is one of this knob's candidates (of the candidate's type: True is not 1)."""
        if self.kind == "int":
            return _is_int(value) and self.low <= value <= self.high and (value - self.low) % self.step == 0
        return any(type(value) is type(c) and value == c for c in self.values())

    def describe(self) -> str:
        """The candidates, for a message: '4 to 12 by 4', 'one of 0, 3'."""
        if self.kind == "int":
            return f"{self.low} to {self.high}" + (f" by {self.step}" if self.step != 1 else "")
        return "one of " + ", ".join(map(repr, self.values()))

    def distribution(self) -> "optuna.distributions.BaseDistribution":
        from optuna.distributions import CategoricalDistribution, IntDistribution

        if self.kind == "computed":
            raise self._unbound()
        if self.kind == "int":
            return IntDistribution(self.low, self.high, step=self.step)
        return CategoricalDistribution(self.values())

    def suggest(self, trial: "optuna.trial.BaseTrial") -> Any:
        if self.kind == "computed":
            raise self._unbound()
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high, step=self.step)
        return trial.suggest_categorical(self.name, self.values())


# ---------------------------------------------------------------------- computed choices
@dataclass(frozen=True)
class ComputedChoices:
    """A named function of the build giving one knob's choices: `compute(spec)` returns the
    candidates and the one the knob's TuningConfig default (its auto) stands for."""

    knob: str
    doc: str
    compute: Callable[["BuildSpec"], tuple[list[Any], Any]]


def _expert_parallel_choices(spec: "BuildSpec") -> tuple[list[int], int | None]:
    from tpumk.plan.sharding import expert_parallel_choices, plan_sharding

    choices = expert_parallel_choices(spec.model, spec.devices)
    if len(choices) < 2:
        return choices, None
    try:
        auto = plan_sharding(spec.model, spec.devices).expert_parallel
    except PlanError:  # the build cannot split whatever the knob: every trial is pruned with the plan's reason
        return [], None
    return choices, auto


def _all_reduce_choices(spec: "BuildSpec") -> tuple[list[str], str | None]:
    from tpumk.plan.geometry import AllReduceGeometry
    from tpumk.plan.plan import all_reduce_geometry

    n = spec.devices
    if n <= 2 or spec.target.chip == "v5e":  # one schedule serves: the direct push, or (v5e) doubling
        return [], None
    choices = (["direct", "rsag"] + (["doubling"] if n & (n - 1) == 0 else [])
               + (["hierarchical"] if AllReduceGeometry.pairs_cores(spec.target.chip, n) else []))
    auto = all_reduce_geometry(spec.target.chip, n, spec.batch * spec.q_len, spec.model.hidden_size,
                               dtype=spec.tuning.all_reduce_wire).schedule
    return choices, auto


def _all_reduce_wire_choices(spec: "BuildSpec") -> tuple[list[str], str | None]:
    if spec.devices <= 1:  # no all-reduce
        return [], None
    return list(ALL_REDUCE_WIRES), TuningConfig().all_reduce_wire


def _mla_projection_choices(spec: "BuildSpec") -> tuple[list[str], str | None]:
    from tpumk.plan.plan import make_plan

    if not (spec.model.is_mla and spec.devices > 1):  # q_a / kv_a are whole on one device
        return [], None
    try:  # auto: the form the plan's timeline model takes
        plan = make_plan(spec.replace(tuning=spec.tuning.replace(mla_projections="auto")))
    except PlanError:
        return ["replicated", "split"], None
    return ["replicated", "split"], "split" if plan.latent_split else "replicated"


# The most drafts a round a chain drafter (eagle3, mtp) is tuned over, unless its own block is more:
# each draft is one more pass, and at any acceptance rate below 1 the later ones rarely survive.
CHAIN_BLOCK_CHOICES = 8


def _draft_block_choices(spec: "BuildSpec") -> tuple[list[int], int | None]:
    if spec.draft is None:  # no speculative round
        return [], None
    d = spec.draft.drafter
    most = d.max_block if d.kind not in ("eagle3", "mtp") else min(d.max_block, max(CHAIN_BLOCK_CHOICES, d.block))
    return list(range(1, most + 1)), d.block


COMPUTED: dict[str, ComputedChoices] = {
    "all_reduce_choices": ComputedChoices(
        "all_reduce",
        "the in-kernel all-reduce schedules the build's chip routes over its devices "
        "(tpumk.plan.geometry.AllReduceGeometry; hierarchical where devices pair up as one chip's "
        "TensorCores); none on one or two devices, or on v5e (doubling only)",
        _all_reduce_choices),
    "expert_parallel_choices": ComputedChoices(
        "expert_parallel",
        "expert groups that split a MoE model's experts over the build's devices "
        "(tpumk.plan.sharding.expert_parallel_choices); none on one device or for a dense model",
        _expert_parallel_choices),
    "all_reduce_wire_choices": ComputedChoices(
        "all_reduce_wire",
        "what the in-kernel all-reduce carries on many devices: float32 partial sums (exact) or bfloat16 "
        "(half the bytes, sums still float32 in a fixed order); none on one device",
        _all_reduce_wire_choices),
    "mla_projection_choices": ComputedChoices(
        "mla_projections",
        "an MLA model's q_a / kv_a on many devices: replicated, or split by output columns with the latent "
        "all-gathered in the kernel once per layer; none on one device or for other models",
        _mla_projection_choices),
    "draft_block_choices": ComputedChoices(
        "draft_block",
        "a round build's drafts per round (--draft): 1 to what the drafter can propose (the dflash family's "
        f"block slots; eagle3 and mtp chains up to {CHAIN_BLOCK_CHOICES} or their own block); none without --draft",
        _draft_block_choices),
}


_QKV_KNOBS = ("qkv_tile_rows", "qkv_tile_cols")
_DENSE_FFN_KNOBS = ("gate_up_tile_rows", "gate_up_tile_cols", "down_tile_rows", "down_tile_cols")
_SHARED_KNOBS = ("shared_gate_up_tile_rows", "shared_gate_up_tile_cols", "shared_down_tile_rows",
                 "shared_down_tile_cols")
_EXPERT_KNOBS = ("expert_slots", "expert_chunk", "expert_parallel")
_COLLECTIVE_KNOBS = ("all_reduce", "all_reduce_wire")


def unused_knobs(spec: "BuildSpec") -> dict[str, str]:
    """Knobs that have no effect on this build's kernel, with why; `TuningSpace.for_build`
    leaves them out of the search (they keep their TuningConfig defaults), so a space file may
    list every knob and a study searches only what its build has (tpumk.plan.plan reads a
    family's tile knobs only when the family streams, the expert knobs only for MoE layers,
    the collective knobs only on many devices):
    - an MLA model streams no fused qkv matrix (its q path, kv_a and the per-head W_UK / W_UV
      families take auto tiles shaped from tile_bytes); a hybrid's linear-attention families
      (lin_*) have no knobs either (auto tiles from tile_bytes), and its attention layers keep
      the qkv / o knobs;
    - a model whose every layer is MoE streams no dense FFN (gate_up / down);
    - a dense model has no experts (expert_slots, expert_chunk, expert_parallel, shared_*), a
      MoE model without a shared expert no shared_* families;
    - one device has no all-reduce and nothing to split (all_reduce, all_reduce_wire,
      expert_parallel, mla_projections); mla_projections is for MLA models only."""
    cfg = spec.model
    why: dict[str, str] = {}

    def drop(names, reason: str) -> None:
        for n in names:
            why.setdefault(n, reason)

    if cfg.is_mla:
        drop(_QKV_KNOBS, "an MLA model has no qkv family: its MLA families take auto tiles from tile_bytes")
    if not any(cfg.pattern.is_dense(i) for i in range(cfg.num_layers)):
        drop(_DENSE_FFN_KNOBS, "every layer is MoE: no dense FFN family")
    if not cfg.is_moe:
        drop(_EXPERT_KNOBS + _SHARED_KNOBS, "a dense model has no experts")
    elif not cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size:
        drop(_SHARED_KNOBS, "no shared expert")
    if spec.devices == 1:
        drop(_COLLECTIVE_KNOBS + ("expert_parallel", "mla_projections"), "one device: no all-reduce, nothing to split")
    if not cfg.is_mla:
        drop(("mla_projections",), "not an MLA model")
    if spec.draft is None:
        drop(("draft_block",), "no --draft: no speculative round")
    return why


# ---------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class Constraint:
    """A condition every trial's configuration must meet: `expr` over knobs and facts.

    Parsed and checked on construction (ConfigError naming the expression if it is not in the
    language or reads an unknown name); `names` are the names it reads, in order."""

    expr: str
    why: str
    names: tuple[str, ...] = field(init=False, compare=False)
    _tree: ast.Expression = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        tree, names = _compile(self.expr)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "_tree", tree)

    def holds(self, env: dict[str, Any], deadline: float | None = None) -> bool:
        """Whether the condition holds under `env`. Its cost is bounded (constant exponents
        of at most 64, every intermediate within 1024 bits or a finite float, and `deadline`,
        a time.monotonic() instant, checked at every node); a configuration for which it cannot
        be evaluated (division by zero, a value out of those bounds, past the deadline) raises
        ConstraintError naming the expression, the error and the values it read."""
        try:
            return bool(_eval(self._tree.body, env, deadline))
        except KeyError as e:
            raise ConfigError(f"constraint '{self.expr}': no value for '{e.args[0]}'") from None
        except (ArithmeticError, ValueError, TypeError, RecursionError) as e:
            used = ", ".join(f"{n}={env.get(n)!r}" for n in self.names)
            why = str(e) or type(e).__name__
            raise ConstraintError(f"constraint '{self.expr}' cannot be evaluated: {why} (with {used})") from None


class ConstraintError(ConfigError):
    """A constraint that cannot be evaluated for one configuration (the trial is pruned)."""


def _compile(expr: str) -> tuple[ast.Expression, tuple[str, ...]]:
    flat = " ".join(expr.split())  # TOML multi-line strings may wrap a long expression
    if len(flat) > _MAX_CHARS:
        raise ConfigError(f"constraint '{flat[:80]}...': longer than {_MAX_CHARS} characters "
                          f"({len(flat):,})")
    try:
        tree = ast.parse(flat, mode="eval")
    except SyntaxError as e:
        raise ConfigError(f"constraint '{flat}': invalid syntax ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise ConfigError(f"constraint '{flat[:80]}...': nested too deeply to parse") from None
    except ValueError as e:  # a character Python's parser refuses (a lone surrogate)
        raise ConfigError(f"constraint {flat[:80]!r}: invalid text ({one_line(e)})") from None
    names: list[str] = []

    def bad(node: ast.AST, what: str) -> ConfigError:
        text = ast.get_source_segment(flat, node) or type(node).__name__
        return ConfigError(f"constraint '{flat}': {what} '{text}' is not allowed "
                           f"(numbers, knob and fact names, + - * / // % **, comparisons, "
                           f"and/or/not, min/max/abs)")

    def check(node: ast.AST) -> None:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise bad(node, "the constant")
        elif isinstance(node, ast.Name):
            if node.id not in KNOB_NAMES and node.id not in FACTS:
                raise ConfigError(
                    f"constraint '{flat}': unknown name '{node.id}' "
                    f"(knobs: {', '.join(KNOB_NAMES)}; facts: {', '.join(FACTS)})")
            if node.id not in names:
                names.append(node.id)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            if isinstance(node.op, ast.Pow):
                e = _constant_exponent(node.right)
                if e is None or abs(e) > _MAX_EXPONENT:
                    raise ConfigError(
                        f"constraint '{flat}': the exponent "
                        f"'{ast.get_source_segment(flat, node.right) or '?'}' is not allowed "
                        f"(an exponent must be a number from -{_MAX_EXPONENT} to {_MAX_EXPONENT})")
            check(node.left)
            check(node.right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            check(node.operand)
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                check(v)
        elif isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            check(node.left)
            for c in node.comparators:
                check(c)
        elif isinstance(node, ast.Call):
            fn = node.func.id if isinstance(node.func, ast.Name) else None
            if fn not in _FUNCS or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise bad(node, "the call")
            want = (1, 1) if fn == "abs" else (2, 64)
            if not want[0] <= len(node.args) <= want[1]:
                raise ConfigError(f"constraint '{flat}': {fn}() takes "
                                  f"{'one argument' if fn == 'abs' else 'two or more arguments'}")
            for a in node.args:
                check(a)
        else:
            raise bad(node, "the expression")

    if sum(1 for _ in ast.walk(tree.body)) > _MAX_NODES:
        raise ConfigError(f"constraint '{flat[:80]}...': longer than {_MAX_NODES} terms")
    if _depth(tree.body) > _MAX_DEPTH:
        raise ConfigError(f"constraint '{flat[:80]}...': nested deeper than {_MAX_DEPTH} levels "
                          f"(a chain of operators nests one level per operator)")
    check(tree.body)
    if not (isinstance(tree.body, (ast.Compare, ast.BoolOp))
            or (isinstance(tree.body, ast.UnaryOp) and isinstance(tree.body.op, ast.Not))):
        raise ConfigError(f"constraint '{flat}': expected a condition (a comparison, "
                          f"possibly combined with and/or/not)")
    return tree, tuple(names)


def _depth(root: ast.AST) -> int:
    """The depth of a tree, walked without recursion (the tree may be deeper than Python's stack)."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _constant_exponent(node: ast.AST) -> int | float | None:
    """The value of an exponent that is a number literal (possibly signed), else None."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        sign = -sign if isinstance(node.op, ast.USub) else sign
        node = node.operand
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def _bits(x: Any) -> float:
    """Bits of magnitude of a number: an int's bit length, a float's binary exponent."""
    if isinstance(x, bool):
        return 1
    if isinstance(x, int):
        return x.bit_length()
    if isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError(f"the value {x} is not finite")
        return math.frexp(x)[1]
    raise TypeError(f"the value {x!r} is not a number")


def _bounded(x: Any) -> Any:
    if _bits(x) > _MAX_BITS:
        raise ValueError(f"an intermediate value exceeds 2**{_MAX_BITS}")
    return x


def _eval(node: ast.AST, env: dict[str, Any], deadline: float | None = None) -> Any:
    if deadline is not None and time.monotonic() > deadline:
        raise ValueError("out of time (the trial's timeout)")
    if isinstance(node, ast.Constant):
        return _bounded(node.value)
    if isinstance(node, ast.Name):
        return _bounded(env[node.id])
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env, deadline), _eval(node.right, env, deadline)
        # Refuse before computing what would exceed the bound (a product has at most the sum
        # of the bits of its factors; a power at most the base's bits times the exponent).
        if isinstance(node.op, ast.Pow):
            if abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is above {_MAX_EXPONENT}")
            if _bits(left) * max(abs(right), 1) > _MAX_BITS and abs(left) > 1:
                raise ValueError(f"an intermediate value exceeds 2**{_MAX_BITS}")
        elif isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > _MAX_BITS + 1:
            raise ValueError(f"an intermediate value exceeds 2**{_MAX_BITS}")
        value = _BINOPS[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative base to a fractional power
            raise ValueError(f"{left} ** {right} is not a real number")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp):
        return _bounded(_UNARY[type(node.op)](_eval(node.operand, env, deadline)))
    if isinstance(node, ast.BoolOp):  # short-circuit, Python semantics: `x or y` gives x or y
        value = None
        for v in node.values:
            value = _eval(v, env, deadline)
            if isinstance(node.op, ast.And) != bool(value):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, deadline)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env, deadline)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        return _FUNCS[node.func.id](*(_eval(a, env, deadline) for a in node.args))
    raise TypeError(f"unexpected node {type(node).__name__}")  # _compile admits no other node


# ---------------------------------------------------------------------- the space
@dataclass(frozen=True)
class TuningSpace:
    name: str
    source: str
    knobs: dict[str, Knob]
    fixed: dict[str, Any]
    constraints: tuple[Constraint, ...]
    description: str = ""
    build: dict[str, Any] | None = None  # the build a computed knob's choices were computed for
    origin: "TuningSpace | None" = field(default=None, repr=False)  # the space as loaded, before for_build
    # knobs of the file for_build left out of this build's search, with why (no effect on its kernel,
    # or fewer than two computed choices)
    dropped: dict[str, str] = field(default_factory=dict)

    def for_build(self, spec: "BuildSpec") -> "TuningSpace":
        """This space for one build: every computed knob becomes a categorical knob of the
        choices its function computes for `spec`, defaulting to the choice its auto makes (so
        the default configuration plans as TuningConfig() does), or leaves the search when
        there are fewer than two (it keeps its TuningConfig default); a knob with no effect on
        this build's kernel (`unused_knobs`: MoE knobs of a dense model, ...) leaves the search
        too. `dropped` says which left and why. A space with neither is returned as it is."""
        src = self.origin or self
        unused = unused_knobs(spec)
        if not any(k.kind == "computed" or k.name in unused for k in src.knobs.values()):
            return src
        build = {k: v for k, v in spec.to_dict().items() if k != "tuning"}
        if self.build == build:
            return self
        knobs: dict[str, Knob] = {}
        dropped: dict[str, str] = {}
        for name, knob in src.knobs.items():
            if name in unused:  # no effect on this build: every value would compile the same kernel
                dropped[name] = unused[name]
                continue
            if knob.kind != "computed":
                knobs[name] = knob
                continue
            choices, auto = COMPUTED[knob.function].compute(spec)
            if len(choices) < 2:  # nothing to choose for this build: no trial spent on it
                dropped[name] = "nothing to choose for this build"
                continue
            for v in choices:
                try:
                    TuningConfig(**{**src.fixed, name: v})
                except ConfigError as e:
                    raise ConfigError(f"{src.source}: knob '{name}': computed candidate {v!r} is not valid: "
                                      f"{str(e).removeprefix('tuning: ')}") from None
            knobs[name] = Knob(name, "categorical", choices=tuple(choices), default=auto, function=knob.function)
        return dataclasses.replace(src, knobs=knobs, build=build, origin=src, dropped=dropped)

    def dropped_line(self) -> str | None:
        """The knobs `for_build` left out, grouped by why, on one line (None: none were)."""
        if not self.dropped:
            return None
        by_why: dict[str, list[str]] = {}
        for name, why in self.dropped.items():
            by_why.setdefault(why, []).append(name)
        groups = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_why.items())
        return (f"space {self.name}: {len(self.knobs)} of {len(self.knobs) + len(self.dropped)} knobs searched for "
                f"this build; left out: {groups}")

    def suggest(self, trial: "optuna.trial.BaseTrial") -> dict[str, Any]:
        """The trial's value of every searched knob (Optuna parameter names = knob names)."""
        return {name: knob.suggest(trial) for name, knob in self.knobs.items()}

    def distributions(self) -> dict[str, "optuna.distributions.BaseDistribution"]:
        return {name: knob.distribution() for name, knob in self.knobs.items()}

    def outside(self, values: dict[str, Any]) -> str | None:
        """Why knob values are not a configuration of this (bound) space, or None: other knobs
        than it searches, a value that is not one of a knob's candidates, or not a valid
        TuningConfig. For trials another process wrote into a shared study (`tpumk.tune.budget.foreign`)."""
        names, mine = set(values), set(self.knobs)
        if names != mine:
            parts = [f"{label} {', '.join(sorted(ns)[:4])}" for label, ns in
                     (("knobs the space does not search:", names - mine), ("missing", mine - names)) if ns]
            return "its knobs are not the space's (" + "; ".join(parts) + ")"
        for name, v in values.items():
            if not self.knobs[name].contains(v):
                return f"{name}={v!r} is not one of the space's values ({self.knobs[name].describe()})"
        try:
            self.tuning_for(values)
        except ConfigError as e:
            return str(e)
        return None

    def tuning_for(self, values: dict[str, Any], base: TuningConfig | None = None) -> TuningConfig:
        """`base` (default: TuningConfig()) with the fixed knobs, then `values`, applied."""
        base = base or TuningConfig()
        return TuningConfig.from_dict({**base.to_dict(), **self.fixed, **values}, f"tuning space {self.source}")

    def violated(self, tuning: TuningConfig, facts: dict[str, Any], deadline: float | None = None) -> str | None:
        """None if every constraint holds for `tuning` under `facts`, else the first one that
        fails as "why (expr; name=value, ...)" with the value of each name it reads, or the
        first one that cannot be evaluated for it (division by zero, out of bounds, past
        `deadline`) as "why: constraint '...' cannot be evaluated: ... (with ...)"."""
        env = {**facts, **dataclasses.asdict(tuning)}  # every knob, draft_block included
        for c in self.constraints:
            try:
                ok = c.holds(env, deadline)
            except ConstraintError as e:
                return f"{c.why}: {e}"
            if not ok:
                used = ", ".join(f"{n}={env[n]!r}" for n in c.names)
                return f"{c.why} ({' '.join(c.expr.split())}; {used})"
        return None

    def default_values(self) -> dict[str, Any]:
        """The default configuration: TuningConfig's default of each searched knob (always a
        candidate: see load_space), for a bound computed knob the choice its auto makes."""
        return {name: knob.default for name, knob in self.knobs.items()}

    def size(self) -> int:
        """Points of the grid of searched values (constraints not applied)."""
        return math.prod(k.size() for k in self.knobs.values())

    def admits_nothing(self, spec: "BuildSpec", seconds: float = 10.0) -> str | None:
        """Why no configuration of this (bound) space can be a trial, when its grid is at most
        MAX_GRID_CHECK points and every point is refused: a constraint evaluates to false for it,
        or its knobs are not a valid TuningConfig, or the model does not split that way. None
        when some point passes, when a constraint cannot be evaluated at some point (that prunes
        the trial and the study goes on, as the README says), or when the grid is too large to
        walk (the study finds out trial by trial). Arithmetic on the grid only, no plan or compile."""
        import itertools

        from tpumk.plan.knobs import TuningConfig

        if not self.constraints or self.size() > MAX_GRID_CHECK:
            return None
        deadline = time.monotonic() + seconds
        names = list(self.knobs)
        facts: dict[int, dict[str, Any] | str] = {}
        first = None
        for combo in itertools.product(*(k.values() for k in self.knobs.values())):
            if time.monotonic() > deadline:
                return None
            values = dict(zip(names, combo))
            try:
                tuning = self.tuning_for(values)
            except ConfigError as e:
                first = first or str(e)
                continue
            ep = tuning.expert_parallel
            if ep not in facts:
                try:
                    facts[ep] = space_facts(spec.replace(tuning=TuningConfig(expert_parallel=ep)))
                except (PlanError, ConfigError) as e:
                    facts[ep] = str(e)
            if isinstance(facts[ep], str):
                first = first or facts[ep]
                continue
            env = {**facts[ep], **dataclasses.asdict(tuning)}
            for c in self.constraints:
                try:
                    ok = c.holds(env, deadline)
                except ConstraintError:
                    return None  # not evaluable here: the trial is pruned, the study goes on
                if not ok:
                    used = ", ".join(f"{n}={env[n]!r}" for n in c.names)
                    first = first or f"{c.why} ({' '.join(c.expr.split())}; {used})"
                    break
            else:
                return None
        return first


# ---------------------------------------------------------------------- loading
def load_space(path: str | Path) -> TuningSpace:
    """Read and validate a space file; every problem is a one-line ConfigError naming the file
    and the table, knob or constraint at fault."""
    path = Path(path)
    data = read_toml(path)
    src = str(path)

    def err(msg: str) -> ConfigError:
        return ConfigError(f"{src}: {msg}")

    def table(key: str) -> dict[str, Any]:
        v = data.get(key, {})
        if not isinstance(v, dict):
            raise err(f"'{key}' must be a table ([{key}])")
        return v

    for key in data:
        if key not in _TOP_KEYS:
            raise err(f"unknown table or key '{key}' (expected: {', '.join(_TOP_KEYS)})")

    space = table("space")
    for key in space:
        if key not in ("name", "description"):
            raise err(f"[space]: unknown key '{key}' (expected: name, description)")
    name = space.get("name", path.stem)
    description = space.get("description", "")
    if not isinstance(name, str) or not name:
        raise err("[space]: 'name' must be a non-empty string")
    if not isinstance(description, str):
        raise err("[space]: 'description' must be a string")

    fixed = table("fixed")
    for knob in fixed:
        _check_knob_name(knob, err, "[fixed]")
    try:
        TuningConfig(**fixed)
    except ConfigError as e:
        raise err(f"[fixed]: {str(e).removeprefix('tuning: ')}") from None

    raw_knobs = table("knobs")
    if not raw_knobs:
        raise err("no knobs to search (add at least one [knobs.<knob>] table)")
    knobs: dict[str, Knob] = {}
    for knob, spec in raw_knobs.items():
        _check_knob_name(knob, err, "[knobs]")
        if knob in fixed:
            raise err(f"knob '{knob}' is both searched ([knobs.{knob}]) and fixed ([fixed]); keep one")
        knobs[knob] = _parse_knob(knob, spec, fixed, err)

    raw_constraints = data.get("constraints", [])
    if not (isinstance(raw_constraints, list) and all(isinstance(c, dict) for c in raw_constraints)):
        raise err("'constraints' must be an array of tables ([[constraints]] with expr and why)")
    constraints = []
    for i, c in enumerate(raw_constraints):
        label = f"constraint {i + 1}"
        for key in c:
            if key not in ("expr", "why"):
                raise err(f"{label}: unknown key '{key}' (expected: expr, why)")
        for key in ("expr", "why"):
            if not isinstance(c.get(key), str) or not c[key].strip():
                raise err(f"{label}: '{key}' must be a non-empty string")
        try:
            constraints.append(Constraint(" ".join(c["expr"].split()), " ".join(c["why"].split())))
        except ConfigError as e:
            raise err(str(e)) from None
    return TuningSpace(name, src, knobs, dict(fixed), tuple(constraints), description)


def _check_knob_name(knob: str, err, where: str) -> None:
    if knob not in KNOB_NAMES:
        raise err(f"{where}: unknown knob '{knob}' (knobs: {', '.join(KNOB_NAMES)})")


# Knobs whose TuningConfig default is an auto (0) that plans as one fixed value wherever that
# fits: a space searches them over real values, so its default candidate is that value (the
# default configuration then plans as TuningConfig() does; where it does not fit, the trial is
# pruned by the plan like any other ring too deep).
SPACE_DEFAULTS = {"ring_depth": AUTO_RING_DEPTH}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_knob(knob: str, spec: Any, fixed: dict[str, Any], err) -> Knob:
    where = f"knob '{knob}'"
    if not isinstance(spec, dict):
        raise err(f"{where}: expected a table [knobs.{knob}] with a type")
    kind = spec.get("type")
    if kind not in KINDS:
        raise err(f"{where}: 'type' = {kind!r}: expected one of {', '.join(KINDS)}")
    for key in spec:
        if key not in _KIND_KEYS[kind]:
            raise err(f"{where}: unknown key '{key}' for type '{kind}' (expected: {', '.join(_KIND_KEYS[kind])})")
    if kind in ("int", "pow2") and knob not in _INT_KNOBS:
        raise err(f"{where}: type '{kind}' needs an integer knob; use type 'categorical' for this one")
    default = SPACE_DEFAULTS.get(knob, getattr(TuningConfig(), knob))

    if kind == "computed":
        fn = spec.get("function")
        if fn not in COMPUTED:
            raise err(f"{where}: 'function' = {fn!r}: expected one of {', '.join(COMPUTED)}")
        if COMPUTED[fn].knob != knob:
            raise err(f"{where}: function '{fn}' computes choices of '{COMPUTED[fn].knob}', not '{knob}'")
        # Its candidates are known per build (TuningSpace.for_build checks them there).
        return Knob(knob, kind, default=default, function=fn)
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise err(f"{where}: 'choices' must be a non-empty list")
        for c in choices:
            if not isinstance(c, (int, float, str, bool)):
                raise err(f"{where}: choice {c!r}: expected a number")
        if len(set(map(repr, choices))) != len(choices):
            raise err(f"{where}: 'choices' repeats a value")
        knob_ = Knob(knob, kind, choices=tuple(choices), default=default)
    else:
        for key in ("low", "high"):
            if key not in spec:
                raise err(f"{where}: missing '{key}'")
        low, high, step = spec["low"], spec["high"], spec.get("step", 1)
        for key, v in (("low", low), ("high", high), ("step", step)):
            if not _is_int(v):
                raise err(f"{where}: '{key}' = {v!r}: expected an integer")
            if abs(v) > MAX_KNOB_VALUE:
                raise err(f"{where}: '{key}' = {v}: out of range (at most 2**53 in magnitude)")
        if low > high:
            raise err(f"{where}: empty range: low {low} > high {high}")
        if kind == "int":
            if step < 1:
                raise err(f"{where}: 'step' = {step}: expected a positive integer")
            if (high - low) % step:
                raise err(f"{where}: high {high} is not low {low} plus a multiple of step {step}")
            # Widen the range to take in the default, so the default configuration is a trial.
            if (default - low) % step:
                raise err(f"{where}: the TuningConfig default {default} is not on the grid "
                          f"low {low} + k * step {step}; shift low so it is")
            knob_ = Knob(knob, kind, min(low, default), max(high, default), step, default=default)
            if knob_.size() > MAX_INT_CANDIDATES:
                raise err(f"{where}: {knob_.size():,} candidates from {knob_.low} to {knob_.high} by {step} "
                          f"(at most {MAX_INT_CANDIDATES:,}): narrow the range or raise 'step'")
        else:
            for key, v in (("low", low), ("high", high)):
                if v < 1 or v & (v - 1):
                    raise err(f"{where}: '{key}' = {v}: expected a power of two")
            knob_ = Knob(knob, kind, low, high, default=default)

    # Check candidates the way a trial will use them. An int range's candidates are low + k*step
    # and TuningConfig's rules are lower bounds and multiples, so low, low + step and high
    # decide for them all; other kinds are short lists, checked whole.
    if kind == "int":  # never the whole list
        vals = sorted({knob_.low, min(knob_.low + knob_.step, knob_.high), knob_.high})
    else:
        vals = knob_.values()
    for v in vals:
        try:
            TuningConfig(**{**fixed, knob: v})
        except ConfigError as e:
            raise err(f"{where}: candidate {v!r} is not valid: {str(e).removeprefix('tuning: ')}") from None
    return knob_


# ---------------------------------------------------------------------- facts
def space_facts(spec: "BuildSpec") -> dict[str, int | float]:
    """The names of FACTS with their values for this model, target and step shape.

    On many devices the model and weight facts are one device's share (the plan builds each
    device's kernel from `ShardingPlan.local_config`), so a constraint that is a condition of
    the plan stays one; that share depends on `spec.tuning.expert_parallel`. Raises PlanError
    when the model does not split over `spec.devices` that way."""
    from tpumk.model import kv_quant
    from tpumk.model.config import expected_distinct_experts
    from tpumk.model.quantize import expert_format, quantized_weight_bytes, weight_format
    from tpumk.plan.geometry import mla_dims
    from tpumk.plan.plan import KV_TILE_TOKENS
    from tpumk.plan.sharding import per_device_weight_bytes, plan_sharding

    model, target, batch, context, q_len = spec.model, spec.target, spec.batch, spec.context, spec.q_len
    sharding = plan_sharding(model, spec.devices, spec.tuning.expert_parallel)
    cfg = sharding.local_config(model)  # the model itself on one device
    n_dense = sum(cfg.pattern.is_dense(i) for i in range(cfg.num_layers))
    n_moe = cfg.num_layers - n_dense
    page = spec.page_size
    pages = -(-context // page)
    rows = batch * q_len
    num_mxus, mxu_size = target.mxu_shape
    ring_fmt, expert_fmt = weight_format(spec.quant), expert_format(spec.quant)
    packed = kv_quant.layout_for(cfg, page, spec.kv_dtype) if spec.kv_dtype and not cfg.is_mla else None
    weight_bytes = quantized_weight_bytes(cfg, spec.quant)
    # bytes a step reads, scaled by the quantized share of the weights (closed form, no plan)
    step_weight_bytes = cfg.decode_weight_bytes(rows) * weight_bytes / max(cfg.param_count() * cfg.dtype_bytes, 1)
    if spec.devices > 1:
        weight_bytes = per_device_weight_bytes(model, sharding, spec.quant)
        if cfg.is_moe:  # a device streams only the picked experts it owns (1 / expert_parallel of them)
            picked = n_moe * 3 * cfg.hidden_size * cfg.moe.expert_ffn_size * (expert_fmt.itemsize if expert_fmt else cfg.dtype_bytes) \
                * expected_distinct_experts(cfg.num_experts, cfg.moe.top_k, rows)
            step_weight_bytes = int(round(step_weight_bytes - picked * (1 - sharding.experts / cfg.num_experts)))
    facts: dict[str, int | float] = {
        "vmem_bytes": target.vmem_bytes, "hbm_bytes": target.hbm_bytes,
        "hbm_bandwidth": target.hbm_bandwidth, "bf16_flops": target.bf16_flops,
        "num_mxus": num_mxus, "mxu_size": mxu_size, "devices": spec.devices,
        "num_layers": cfg.num_layers, "num_dense_layers": n_dense, "num_moe_layers": n_moe,
        "num_attention_layers": cfg.kv_layers, "num_linear_layers": len(cfg.linear_layers),
        "has_dense_layers": int(n_dense > 0),
        "has_shared_expert": int(n_moe > 0 and cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size > 0),
        "is_moe": int(cfg.is_moe),
        "hidden_size": cfg.hidden_size, "num_q_heads": cfg.num_q_heads, "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "q_size": cfg.attention.q_size, "kv_size": cfg.attention.kv_size,
        "is_mla": int(cfg.is_mla), "kv_caches": 1 if cfg.is_mla or spec.kv_dtype else 2,
        "kv_row_lanes": (cfg.attention.latent_cache_lanes if cfg.is_mla else
                         packed.lanes // packed.group if spec.kv_dtype else cfg.attention.kv_size),
        "kv_code_bytes": 1 if spec.kv_dtype else cfg.dtype_bytes,
        "o_rows": mla_dims(cfg)["o_rows"] if cfg.is_mla else cfg.attention.q_size,
        "ffn_size": cfg.ffn_size, "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts, "experts_per_device": sharding.experts if cfg.is_moe else 0,
        "top_k": cfg.moe.top_k, "expert_ffn_size": cfg.moe.expert_ffn_size,
        "num_shared_experts": cfg.moe.num_shared_experts, "shared_expert_ffn_size": cfg.moe.shared_expert_ffn_size,
        "dtype_bytes": cfg.dtype_bytes,
        "ring_code_bytes": 1 if ring_fmt is not None else cfg.dtype_bytes,
        "expert_code_bytes": 1 if expert_fmt is not None else cfg.dtype_bytes,
        "weight_bytes": weight_bytes,
        "step_weight_bytes": int(round(step_weight_bytes)),
        "batch": batch, "context": context, "q_len": q_len, "rows": rows,
        "page_size": page, "pages_per_seq": pages,
        # the plan's auto KV tile (tpumk.plan.plan.make_plan)
        "kv_auto_tile_pages": max(1, min(pages, KV_TILE_TOKENS // page)),
    }
    assert facts.keys() == FACTS.keys()
    return facts
