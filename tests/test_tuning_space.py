"""Tuning spaces: loading and validating space files, Optuna suggestions, constraints and facts."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import warnings

import optuna
import pytest

from tpumk.model.config import load_preset
from tpumk.errors import ConfigError, PlanError
from tpumk.plan.plan import AUTO_RING_DEPTH, make_plan
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.tune.space import (DEFAULT_SPACE_PATH, FACTS, KNOB_NAMES, SPACES_DIR, Constraint,
                                load_space, space_facts)
from tpumk.plan.spec import BuildSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)
MIB = 1 << 20
TINY_SPACE = SPACES_DIR / "tiny.toml"
# A build where the default space's computed knob (expert_parallel) has choices: 2 or 4 groups.
MOE_4DEV = BuildSpec(load_preset("tiny-moe"), get_target("tpu7x"), batch=2, context=1024, devices=4)


@pytest.fixture(scope="module")
def default_space():
    return load_space(DEFAULT_SPACE_PATH)


@pytest.fixture(scope="module")
def tiny_space():
    return load_space(TINY_SPACE)


def write(tmp_path, text: str, name: str = "space.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = '[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 16\n'


# ---------------------------------------------------------------------- the shipped spaces
def test_shipped_spaces_load(default_space, tiny_space):
    assert default_space.name == "default" and default_space.source == str(DEFAULT_SPACE_PATH)
    assert tiny_space.name == "tiny"
    assert set(tiny_space.knobs) == {"ring_depth", "tile_bytes", "kv_buffers", "expert_slots", "expert_chunk"}
    assert tiny_space.size() == 3 * 4 * 2 * 2 * 4
    assert default_space.constraints and tiny_space.constraints


def test_default_space_covers_every_knob(default_space):
    covered = set(default_space.knobs) | set(default_space.fixed)
    assert covered == set(KNOB_NAMES) == {f.name for f in dataclasses.fields(TuningConfig)}
    assert not set(default_space.knobs) & set(default_space.fixed)


def test_knob_values(tiny_space, default_space):
    assert tiny_space.knobs["ring_depth"].values() == [4, 8, 12]
    assert tiny_space.knobs["tile_bytes"].values() == [512 * 1024, MIB, 2 * MIB, 4 * MIB]
    assert tiny_space.knobs["expert_chunk"].values() == [0, 128, 256, 512]
    assert default_space.knobs["ring_depth"].values() == list(range(2, 33))
    assert default_space.knobs["tile_bytes"].values() == [1 << e for e in range(18, 24)]


def test_facts_cover_the_documented_names():
    facts = space_facts(BuildSpec(load_preset("qwen3-30b-a3b"), get_target("tpu7x"), batch=8, context=4096))
    assert facts.keys() == FACTS.keys()
    assert not set(facts) & set(KNOB_NAMES)
    assert facts["vmem_bytes"] == 64 * MIB and facts["hidden_size"] == 2048
    assert facts["is_moe"] == 1 and facts["num_experts"] == 128 and facts["expert_ffn_size"] == 768
    assert facts["has_dense_layers"] == 0 and facts["has_shared_expert"] == 0
    assert facts["pages_per_seq"] == 4096 // facts["page_size"] and facts["rows"] == 8
    dense = space_facts(BuildSpec(load_preset("qwen3-8b"), get_target("v6e"), batch=1, context=112, q_len=2))
    assert dense["is_moe"] == 0 and dense["has_dense_layers"] == 1 and dense["ffn_size"] == 12288
    assert dense["vmem_bytes"] == 128 * MIB and dense["rows"] == 2 and dense["pages_per_seq"] == 7
    readme = (SPACES_DIR / "README.md").read_text()
    for name in FACTS:  # the README's table documents every fact
        assert f"| `{name}` |" in readme, name


# ---------------------------------------------------------------------- Optuna
def test_fixed_trial_of_the_defaults_gives_the_default_config(default_space):
    one = default_space.for_build(BuildSpec(load_preset("tiny-moe"), get_target("tpu7x")))
    values = one.default_values()
    defaults = {k: getattr(TuningConfig(), k) for k in one.knobs} | {"ring_depth": AUTO_RING_DEPTH}  # auto's depth
    assert values == defaults and "expert_parallel" not in values
    suggested = one.suggest(optuna.trial.FixedTrial(values))
    assert suggested == values
    assert one.tuning_for(suggested) == TuningConfig(ring_depth=AUTO_RING_DEPTH)
    # Many devices: the computed knob's default is the split its auto makes (the same plan).
    many = default_space.for_build(MOE_4DEV)
    values = many.default_values()
    assert values == {**defaults, "expert_parallel": 2, "all_reduce": "direct",
                      "all_reduce_wire": "float32"}
    tuning = many.tuning_for(many.suggest(optuna.trial.FixedTrial(values)))
    assert make_plan(MOE_4DEV.replace(tuning=tuning)).sharding == make_plan(MOE_4DEV).sharding
    assert make_plan(MOE_4DEV.replace(tuning=tuning)).all_reduce == make_plan(MOE_4DEV).all_reduce


EXPERT = {"expert_slots", "expert_chunk", "expert_parallel"}
SHARED = {"shared_gate_up_tile_rows", "shared_gate_up_tile_cols", "shared_down_tile_rows", "shared_down_tile_cols"}
DENSE_FFN = {"gate_up_tile_rows", "gate_up_tile_cols", "down_tile_rows", "down_tile_cols"}
COLLECTIVE = {"all_reduce", "all_reduce_wire", "mla_projections"}
DRAFT = {"draft_block"}  # a build without --draft has no speculative round


@pytest.mark.parametrize("model, devices, absent, plans", [
    ("tiny-dense", 1, EXPERT | SHARED | COLLECTIVE | DRAFT, True),
    ("tiny-dense", 4, EXPERT | SHARED | {"mla_projections"} | DRAFT, True),
    ("tiny-moe", 1, {"expert_parallel"} | COLLECTIVE | DRAFT, True),  # dense layer 0 and a shared expert: both kept
    # every layer MoE, no shared expert (its plans take seconds: the knob sets only)
    ("qwen3-30b-a3b", 1, DENSE_FFN | SHARED | {"expert_parallel"} | COLLECTIVE | DRAFT, False),
])
def test_a_build_searches_only_the_knobs_it_has(default_space, model, devices, absent, plans):
    """The default space lists every knob; a build searches those its kernel has, and the
    grid size is that of the knobs searched. (Before: a dense model's study searched the
    expert and shared-expert knobs, 6.8e15 grid points for tiny-dense, most of them the same
    kernel.) Each knob left out changes nothing in the plan."""
    spec = BuildSpec(load_preset(model), get_target("tpu7x"), devices=devices)
    space = default_space.for_build(spec)
    assert set(space.knobs) == set(default_space.knobs) - absent and set(space.dropped) == absent
    assert space.size() == math.prod(k.size() for k in space.knobs.values())
    if devices == 1:  # (on many devices a computed knob's default is the choice its auto makes)
        # ring_depth's default candidate is the depth its auto (0) plans as where it fits
        assert space.tuning_for(space.default_values()) == TuningConfig(ring_depth=AUTO_RING_DEPTH)
        if plans:
            assert make_plan(spec).ring_depth == AUTO_RING_DEPTH
    line = space.dropped_line()
    assert line.startswith(f"space default: {len(space.knobs)} of {len(default_space.knobs)} knobs searched")
    assert all(name in line for name in absent) and "\n" not in line
    base = make_plan(spec) if plans else None
    for name in sorted(absent - COLLECTIVE - DRAFT - {"expert_parallel"}) if plans else ():
        value = next(v for v in default_space.knobs[name].values() if v != getattr(TuningConfig(), name))
        other = make_plan(spec.replace(tuning=TuningConfig(**{name: value})))
        assert (other.families, other.vmem_total, other.hbm_bytes) == (base.families, base.vmem_total,
                                                                     base.hbm_bytes), name


@pytest.mark.parametrize("space_fixture", ["default_space", "tiny_space"])
def test_study_suggestions_are_valid_configs(space_fixture, request):
    space = request.getfixturevalue(space_fixture).for_build(MOE_4DEV)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    study.enqueue_trial(space.default_values())
    seen = []

    def objective(trial):
        values = space.suggest(trial)
        tuning = space.tuning_for(values)
        assert isinstance(tuning, TuningConfig)
        for name, v in values.items():
            assert v in space.knobs[name].values() and getattr(tuning, name) == v
        for name, v in space.fixed.items():
            assert getattr(tuning, name) == v
        seen.append(values)
        return float(tuning.ring_depth)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an out-of-range enqueued default would warn
        study.optimize(objective, n_trials=12)
    assert seen[0] == space.default_values()
    for t in study.trials:
        assert t.distributions == space.distributions()  # distributions() is what suggest made
        assert t.params == seen[t.number]


def test_tuning_for_applies_base_fixed_then_values(tmp_path):
    space = load_space(write(tmp_path, MINIMAL + "[fixed]\nkv_buffers = 4\n"))
    t = space.tuning_for({"ring_depth": 6}, base=TuningConfig(ring_depth=3, expert_slots=2, kv_buffers=2))
    assert (t.ring_depth, t.expert_slots, t.kv_buffers) == (6, 2, 4)
    with pytest.raises(ConfigError, match="ring_depth"):
        space.tuning_for({"ring_depth": 1})


def test_default_joins_the_candidates_and_can_be_enqueued(tmp_path):
    path = write(tmp_path, """
[knobs.ring_depth]
type = "int"
low = 2
high = 6
step = 2
[knobs.tile_bytes]
type = "pow2"
low = 262144
high = 1048576
[knobs.qkv_tile_cols]
type = "categorical"
choices = [512, 1024]
""")
    space = load_space(path)
    assert space.knobs["ring_depth"].values() == [2, 4, 6, 8, 10, 12]  # widened to the default 12
    assert space.knobs["tile_bytes"].values() == [262144, 524288, MIB, 2 * MIB]
    assert space.knobs["qkv_tile_cols"].values() == [512, 1024, 0]
    assert space.size() == 6 * 4 * 3
    study = optuna.create_study()
    study.enqueue_trial(space.default_values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        study.optimize(lambda tr: float(space.tuning_for(space.suggest(tr)).ring_depth), n_trials=1)
    assert study.trials[0].params == {"ring_depth": 12, "tile_bytes": 2 * MIB, "qkv_tile_cols": 0}


# ---------------------------------------------------------------------- constraints on real facts
def test_constraints_on_qwen3_8b_tpu7x(default_space):
    cfg, target = load_preset("qwen3-8b"), get_target("tpu7x")
    facts = space_facts(BuildSpec(cfg, target, batch=1, context=4096))
    assert default_space.violated(TuningConfig(), facts) is None
    make_plan(BuildSpec(cfg, target, 1, 4096, TuningConfig()))

    big_ring = TuningConfig(ring_depth=24, tile_bytes=8 * MIB)
    reason = default_space.violated(big_ring, facts)
    assert reason.startswith("the weight ring must fit the VMEM budget (")
    assert "ring_depth=24" in reason and "tile_bytes=8388608" in reason and "vmem_bytes=67108864" in reason
    with pytest.raises(PlanError, match="VMEM"):
        make_plan(BuildSpec(cfg, target, 1, 4096, big_ring))

    bad_rows = TuningConfig(o_tile_rows=3072)  # 3072 does not divide q_size 4096
    assert default_space.violated(bad_rows, facts).startswith("tile rows must divide")
    with pytest.raises(PlanError, match="o_tile_rows"):
        make_plan(BuildSpec(cfg, target, 1, 4096, bad_rows))

    short = space_facts(BuildSpec(cfg, target, batch=1, context=256))  # 16 pages per sequence
    assert default_space.violated(TuningConfig(kv_tile_pages=16), short) is None
    assert "kv_tile_pages=32" in default_space.violated(TuningConfig(kv_tile_pages=32), short)


def test_constraint_kv_budget_true_and_false():
    c = Constraint("2 * kv_buffers * (kv_tile_pages or kv_auto_tile_pages) * page_size * kv_size"
                   " * dtype_bytes <= vmem_limit_fraction * vmem_bytes", "kv fits")
    facts = space_facts(BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=1, context=1 << 20))
    env = {**facts, **TuningConfig().to_dict()}  # auto: 16 pages of 16 tokens x 1024 lanes bf16
    assert c.holds(env)
    assert not c.holds({**env, "kv_tile_pages": 2048, "kv_buffers": 4})  # 4 * 2 * 64 MiB
    assert c.names[:3] == ("kv_buffers", "kv_tile_pages", "kv_auto_tile_pages")


@pytest.mark.parametrize("model, target, batch, context, devices", [
    ("qwen3-8b", "tpu7x", 1, 4096, 1),
    ("qwen3-8b", "v6e", 8, 4096, 1),
    ("qwen3-30b-a3b", "tpu7x", 8, 4096, 1),
    ("tiny-moe", "tpu7x", 2, 1024, 1),
    # many devices: the facts are one device's share (its vocabulary slice, heads, expert width)
    ("tiny-moe", "tpu7x", 2, 1024, 4),
    ("qwen3-32b", "tpu7x", 1, 4096, 8),
    ("qwen3-235b-a22b", "tpu7x", 1, 4096, 32),
])
def test_default_constraints_are_necessary_conditions_of_the_plan(default_space, model, target, batch, context,
                                                                  devices):
    """Every random configuration the constraints reject, the plan rejects too."""
    spec = BuildSpec(load_preset(model), get_target(target), batch, context, devices=devices)
    space = default_space.for_build(spec)
    assert space.violated(TuningConfig(), space_facts(spec)) is None
    rng = random.Random(model + target)
    rejected = 0
    for _ in range(200):
        values = {n: rng.choice(k.values()) for n, k in space.knobs.items()}
        for name in values:  # mostly auto tile shapes, so the tile_bytes bounds get exercised too
            if "_tile_" in name and rng.random() < 0.8:
                values[name] = 0
        tuning = space.tuning_for(values)
        reason = space.violated(tuning, space_facts(spec.replace(tuning=tuning)))
        if reason is not None:
            rejected += 1
            with pytest.raises(PlanError):
                make_plan(spec.replace(tuning=tuning))
    assert rejected > 0  # the check above ran


def test_tiny_space_on_tiny_moe_prunes_exactly_what_it_should(tiny_space):
    cfg, target = load_preset("tiny-moe"), get_target("tpu7x")
    facts = space_facts(BuildSpec(cfg, target, batch=1, context=256))
    outcome = {"ok": 0, "chunk": 0, "policy": 0}
    for combo in itertools.product(*(k.values() for k in tiny_space.knobs.values())):
        values = dict(zip(tiny_space.knobs, combo))
        tuning = tiny_space.tuning_for(values)
        reason = tiny_space.violated(tuning, facts)
        if reason is None:
            make_plan(BuildSpec(cfg, target, 1, 256, tuning))  # whatever passes, plans
            outcome["ok"] += 1
        elif reason.startswith("an expert chunk"):
            assert values["expert_chunk"] == 512
            with pytest.raises(PlanError, match="expert_chunk"):
                make_plan(BuildSpec(cfg, target, 1, 256, tuning))
            outcome["chunk"] += 1
        else:
            assert reason.startswith("at most 24 MiB") and values["ring_depth"] * values["tile_bytes"] > 24 * MIB
            outcome["policy"] += 1
    assert outcome == {"ok": 120, "chunk": 48, "policy": 24}


# ---------------------------------------------------------------------- the expression language
@pytest.mark.parametrize("expr, env, expected", [
    ("2 <= ring_depth <= 16", {"ring_depth": 12}, True),
    ("2 <= ring_depth <= 16", {"ring_depth": 17}, False),
    ("expert_chunk == 0 or expert_ffn_size % expert_chunk == 0", {"expert_chunk": 0, "expert_ffn_size": 768}, True),
    ("expert_chunk == 0 or expert_ffn_size % expert_chunk == 0", {"expert_chunk": 512, "expert_ffn_size": 768}, False),
    ("(kv_tile_pages or kv_auto_tile_pages) == 16", {"kv_tile_pages": 0, "kv_auto_tile_pages": 16}, True),
    ("(kv_tile_pages or kv_auto_tile_pages) == 16", {"kv_tile_pages": 4, "kv_auto_tile_pages": 16}, False),
    ("not (ring_depth > 4 and tile_bytes > 2**20)", {"ring_depth": 8, "tile_bytes": 4 * MIB}, False),
    ("max(ring_depth, 3) * min(tile_bytes, 5) == abs(-15) // 1", {"ring_depth": 2, "tile_bytes": 9}, True),
    ("tile_bytes / 2 - -1 != 2 ** 3 % 5", {"tile_bytes": 6}, True),
])
def test_expression_semantics(expr, env, expected):
    assert Constraint(expr, "why").holds(env) is expected


def test_runtime_errors_name_the_constraint():
    with pytest.raises(ConfigError, match=r"constraint 'hidden_size % qkv_tile_rows == 0'.*qkv_tile_rows=0"):
        Constraint("hidden_size % qkv_tile_rows == 0", "w").holds({"hidden_size": 4096, "qkv_tile_rows": 0})
    with pytest.raises(ConfigError, match="exponent"):
        Constraint("2 ** ring_depth > 1", "w").holds({"ring_depth": 10_000})


# ---------------------------------------------------------------------- broken space files
BROKEN = [
    ("unknown knob", '[knobs.ring_dpeth]\ntype = "int"\nlow = 2\nhigh = 4\n',
     r"\[knobs\]: unknown knob 'ring_dpeth' \(knobs: ring_depth, tile_bytes"),
    ("unknown fixed knob", MINIMAL + "[fixed]\nbogus = 1\n", r"\[fixed\]: unknown knob 'bogus'"),
    ("empty int range", '[knobs.ring_depth]\ntype = "int"\nlow = 16\nhigh = 4\n',
     r"knob 'ring_depth': empty range: low 16 > high 4"),
    ("empty pow2 range", '[knobs.tile_bytes]\ntype = "pow2"\nlow = 4194304\nhigh = 262144\n',
     r"knob 'tile_bytes': empty range"),
    ("empty choices", '[knobs.qkv_tile_cols]\ntype = "categorical"\nchoices = []\n',
     r"knob 'qkv_tile_cols': 'choices' must be a non-empty list"),
    ("pow2 bound not a power of two", '[knobs.tile_bytes]\ntype = "pow2"\nlow = 300000\nhigh = 8388608\n',
     r"knob 'tile_bytes': 'low' = 300000: expected a power of two"),
    ("searched and fixed", MINIMAL + "[fixed]\nring_depth = 4\n",
     r"knob 'ring_depth' is both searched .* and fixed"),
    ("unknown name in constraint", MINIMAL + '[[constraints]]\nexpr = "ring_depth * slots <= 8"\nwhy = "w"\n',
     r"constraint 'ring_depth \* slots <= 8': unknown name 'slots' \(knobs: .*; facts: vmem_bytes"),
    ("import call", MINIMAL + "[[constraints]]\nexpr = \"__import__('os') == 0\"\nwhy = \"w\"\n",
     r"the call '__import__\('os'\)' is not allowed"),
    ("attribute access", MINIMAL + '[[constraints]]\nexpr = "ring_depth.real > 1"\nwhy = "w"\n',
     r"'ring_depth.real' is not allowed"),
    ("subscript", MINIMAL + '[[constraints]]\nexpr = "ring_depth[0] > 1"\nwhy = "w"\n', r"is not allowed"),
    ("string constant", MINIMAL + "[[constraints]]\nexpr = \"ring_depth == 'a'\"\nwhy = \"w\"\n",
     r"the constant ''a'' is not allowed"),
    ("membership", MINIMAL + '[[constraints]]\nexpr = "ring_depth in (2, 4)"\nwhy = "w"\n', r"is not allowed"),
    ("not a condition", MINIMAL + '[[constraints]]\nexpr = "ring_depth * 2"\nwhy = "w"\n', r"expected a condition"),
    ("bad syntax", MINIMAL + '[[constraints]]\nexpr = "ring_depth <="\nwhy = "w"\n', r"'ring_depth <=': invalid syntax"),
    ("missing why", MINIMAL + '[[constraints]]\nexpr = "ring_depth <= 8"\n', r"constraint 1: 'why' must be a non-empty"),
    ("min of one", MINIMAL + '[[constraints]]\nexpr = "min(ring_depth) <= 8"\nwhy = "w"\n', r"min\(\) takes two or more"),
    ("unknown top-level table", MINIMAL + "[tuning]\nring_depth = 4\n", r"unknown table or key 'tuning' \(expected: space"),
    ("unknown space key", '[space]\nnmae = "x"\n' + MINIMAL, r"\[space\]: unknown key 'nmae'"),
    ("unknown knob key", '[knobs.tile_bytes]\ntype = "pow2"\nlow = 262144\nhigh = 8388608\nstep = 2\n',
     r"knob 'tile_bytes': unknown key 'step' for type 'pow2'"),
    ("unknown type", '[knobs.ring_depth]\ntype = "float"\nlow = 2\nhigh = 4\n', r"knob 'ring_depth': 'type' = 'float'"),
    ("wrong type", '[knobs.ring_depth]\ntype = "int"\nlow = "2"\nhigh = 4\n', r"knob 'ring_depth': 'low' = '2': expected an integer"),
    ("int kind on a float knob", '[knobs.vmem_limit_fraction]\ntype = "int"\nlow = 1\nhigh = 1\n',
     r"knob 'vmem_limit_fraction': type 'int' needs an integer knob"),
    ("off-grid high", '[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 13\nstep = 4\n', r"high 13 is not low 2 plus a multiple"),
    ("default off the grid", '[knobs.ring_depth]\ntype = "int"\nlow = 3\nhigh = 11\nstep = 4\n',
     r"knob 'ring_depth': the TuningConfig default 12 is not on the grid"),
    ("invalid tile cols", '[knobs.qkv_tile_cols]\ntype = "categorical"\nchoices = [0, 200]\n',
     r"knob 'qkv_tile_cols': candidate 200 is not valid: 'qkv_tile_cols' = 200: expected 0 \(auto\) or a positive multiple of 128"),
    ("invalid gate_up cols", '[knobs.gate_up_tile_cols]\ntype = "categorical"\nchoices = [384]\n',
     r"knob 'gate_up_tile_cols': candidate 384 is not valid: .*multiple of 256"),
    ("int range below the minimum", '[knobs.ring_depth]\ntype = "int"\nlow = 1\nhigh = 12\n',
     r"knob 'ring_depth': candidate 1 is not valid: .*0 \(auto\) or at least 2"),
    ("invalid fixed value", MINIMAL + "[fixed]\nkv_buffers = 1\n", r"\[fixed\].*'kv_buffers' = 1: expected 0 \(auto\) or at least 2"),
    ("boolean choice", '[knobs.expert_slots]\ntype = "categorical"\nchoices = [1, true]\n',
     r"knob 'expert_slots': candidate True is not valid: .*an integer"),
    ("no knobs", "[fixed]\nring_depth = 4\n", r"no knobs to search"),
    ("unknown computed function", '[knobs.expert_parallel]\ntype = "computed"\nfunction = "best_split"\n',
     r"knob 'expert_parallel': 'function' = 'best_split': expected one of all_reduce_choices, expert_parallel_choices"),
    ("computed function of another knob", '[knobs.ring_depth]\ntype = "computed"\nfunction = "expert_parallel_choices"\n',
     r"knob 'ring_depth': function 'expert_parallel_choices' computes choices of 'expert_parallel', not 'ring_depth'"),
    ("computed knob with choices", '[knobs.expert_parallel]\ntype = "computed"\nchoices = [1, 2]\n',
     r"knob 'expert_parallel': unknown key 'choices' for type 'computed' \(expected: type, function\)"),
]


@pytest.mark.parametrize("case, text, pattern", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_space_is_refused_with_one_line(tmp_path, case, text, pattern):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_space(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert re.search(pattern, msg), msg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_space(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_space(write(tmp_path, "[knobs\n"))


def test_readme_examples_load(tmp_path):
    """Every TOML example in tuning_spaces/README.md is a valid space (or valid constraints)."""
    readme = (SPACES_DIR / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        text = block if "[knobs." in block else MINIMAL + block
        space = load_space(write(tmp_path, text, f"example{i}.toml"))
        assert space.knobs
    facts = space_facts(BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=1, context=4096))
    assert space.violated(TuningConfig(), facts) is None
