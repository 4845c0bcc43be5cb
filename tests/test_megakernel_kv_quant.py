"""The megakernel on a 1-byte KV cache (`--kv-dtype fp8 | int8`, issue 29): whole decode steps in
interpret mode against the quantized reference, the same builds compiled deviceless for TPU7x
and v6e, what the plan and tpumk's timeline model count for qwen3-8b, and the refusals.

The 4-device steps run in tests/test_multidevice.py (dense-4dev-fp8-kv) and
tests/test_multidevice_mla.py (an MLA latent cache in int8), the GQA stage on its own in
tests/test_attention_kv_quant.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.cli.app import main
from tpumk.compat import interpret_races
from tpumk.compile.aot import compile_plan
from tpumk.compile.keys import key_for
from tpumk.errors import PlanError
from tpumk.estimate.timeline import megakernel_step
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as ref
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

# (id, preset, dtype, format, prompt lengths, knobs). float32: the kernel's new rows equal the
# reference's bit for bit, so the caches must too; bfloat16 (full tier): a row one rounding
# apart can take the next code, so only the logits are bounded (test_megakernel.py's bound).
CASES = [
    ("dense-f32-int8", "tiny-dense", "float32", "int8", [15, 16, 33], dict(kv_tile_pages=2, kv_buffers=3)),
    # MLA's latent cache: one token per packed row (c_kv | k_rope codes, then the exponent byte)
    ("mla-f32-fp8", "tiny-mla", "float32", "fp8", [15, 33], dict(kv_tile_pages=2)),
    pytest.param("moe-bf16-fp8", "tiny-moe", "bfloat16", "fp8", [16, 31], {}, marks=pytest.mark.full),
]


def spec(preset, dtype, fmt, batch, target="cpu", knobs=None):
    cfg = load_preset(preset)
    cfg = cfg.replace(dtype=dtype, name=f"{cfg.name}-{dtype}")
    return BuildSpec(cfg, get_target(target), batch=batch, context=64, kv_dtype=fmt, tuning=TuningConfig(**(knobs or {})))


@pytest.mark.parametrize("case, preset, dtype, fmt, lengths, knobs", CASES)
def test_steps_match_the_quantized_reference_and_compile(case, preset, dtype, fmt, lengths, knobs):
    s = spec(preset, dtype, fmt, len(lengths), knobs=knobs)
    plan = make_plan(s)
    cfg = s.model
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(2)
    cache = ref.init_cache(cfg, len(lengths), 64, kv_dtype=fmt)
    _, cache = ref.prefill(params, cfg, [list(rng.integers(0, cfg.vocab_size, n)) for n in lengths], cache)
    step, packed, mine = make_decode_step(plan, detect_races=True), pack_weights(plan, params), cache
    for _ in range(2):  # the second step reads the rows the first wrote
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(lengths), 1)), jnp.int32)
        positions = cache.lengths[:, None]
        want, cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
        got, mine = step(packed, tokens, positions, mine)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = float(np.max(np.abs(want)))
        assert np.max(np.abs(got - want)) <= (1e-5 if dtype == "float32" else 2.0 ** -6) * scale
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        assert isinstance(mine, ref.QuantizedKVCache) and mine.layout == cache.layout
        differ = np.mean(np.asarray(mine.kv).view(np.uint8) != np.asarray(cache.kv).view(np.uint8))
        assert differ == 0.0 if dtype == "float32" else differ <= 0.01
        assert np.array_equal(np.asarray(mine.lengths), np.asarray(cache.lengths))
    races = interpret_races()
    assert races is not None and not races.races_found
    for target in ("tpu7x", "v6e"):  # interpret mode does not check Mosaic's layout rules
        assert compile_plan(make_plan(spec(preset, dtype, fmt, len(lengths), target, knobs))).custom_calls == 1


def test_qwen3_8b_halves_the_kv_bytes_and_speeds_up_the_step():
    """Issue 29's bar, by the plan's byte accounting and tpumk's timeline model (no TPU): qwen3-8b
    on TPU7x, batch 8, 4096-token context. The KV stream of 16-token bfloat16 pages is bound by
    DMA descriptors in the model, so the packed page (one DMA for K, V and scales) matters as
    much as its halved bytes."""
    base = BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=8, context=4096)
    bf16, fp8 = make_plan(base), make_plan(base.replace(kv_dtype="fp8"))
    ratio = fp8.hbm["kv_cache"] / bf16.hbm["kv_cache"]
    assert ratio == pytest.approx(4224 / 8192) and ratio <= 0.52  # 8 rows of 4224 bytes per 16-token page
    speedup = megakernel_step(bf16).seconds / megakernel_step(fp8).seconds
    assert speedup >= 1.1, speedup
    summary = fp8.attention_summary()
    assert summary["kv_cache_format"] == "fp8" and summary["kv_cache_bytes_per_token_per_layer"] == 4224 // 2


def test_the_format_is_part_of_the_build():
    """kv_dtype is in the cache key and the spec's plain data (a model-dtype build keeps the key
    it always had: the field is written only when set)."""
    s = BuildSpec(load_preset("tiny-dense"), get_target("tpu7x"), context=64)
    q = s.replace(kv_dtype="int8")
    assert "kv_dtype" not in s.to_dict() and q.to_dict()["kv_dtype"] == "int8"
    assert BuildSpec.from_dict(q.to_dict()) == q and s.replace(kv_dtype="none") == s
    assert len({key_for(s), key_for(q), key_for(s.replace(kv_dtype="fp8"))}) == 3
    assert "int8 KV cache" in q.label()


@pytest.mark.parametrize("changes, needle", [
    (dict(kv_dtype="fp4"), "build spec: kv_dtype = 'fp4': expected one of fp8, int8 (or none: the model dtype)"),
])
def test_refusals_are_one_line(changes, needle):
    model = load_preset(changes.pop("model", "tiny-dense"))
    with pytest.raises(PlanError) as e:
        make_plan(BuildSpec(model, get_target("tpu7x"), context=64, **changes))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_step_refuses_the_other_cache_format():
    plan = make_plan(spec("tiny-dense", "float32", "fp8", 1))
    cfg = plan.cfg
    step = make_decode_step(plan)
    with pytest.raises(ValueError, match="decode step planned for a fp8 KV cache, got a model-dtype one"):
        step({}, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), ref.init_cache(cfg, 1, 64))


def test_build_cli_takes_kv_dtype():
    r = CliRunner().invoke(main, ["cache-key", "--model", "tiny-dense", "--context", "64", "--kv-dtype", "fp8"])
    plain = CliRunner().invoke(main, ["cache-key", "--model", "tiny-dense", "--context", "64"])
    assert r.exit_code == 0 and plain.exit_code == 0, r.output + plain.output
    assert r.output.strip() != plain.output.strip()
    bad = CliRunner().invoke(main, ["cache-key", "--model", "tiny-dense", "--kv-dtype", "fp4"])
    assert bad.exit_code != 0 and "'fp4' is not one of 'none', 'fp8', 'int8'" in bad.output


def test_export_round_trip_on_a_quantized_cache(tmp_path):
    """An artifact built with --kv-dtype: its manifest records the format, `init_cache` gives the
    packed cache, and both loaded forms (the executable and the portable export, whose pytree of
    the cache is serialized by name with its layout) run the step as the reference does (the
    executable here: its cache pytree is rebuilt from the plan, `export.checks.step_trees`)."""
    import tpumk

    r = CliRunner().invoke(main, ["export", "--model", "tiny-dense", "--context", "64", "--target", "cpu",
                                  "--kv-dtype", "int8", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    path = next((tmp_path / "tiny-dense" / "cpu").iterdir())
    assert "KV int8" in CliRunner().invoke(main, ["inspect", str(path)]).output
    params = random_params(load_preset("tiny-dense"), seed=0)
    tokens = jnp.full((1, 1), 3, jnp.int32)
    positions = jnp.zeros((1, 1), jnp.int32)
    want, _ = ref.decode_step(params, load_preset("tiny-dense"), tokens, positions,
                              ref.init_cache(load_preset("tiny-dense"), 1, 64, kv_dtype="int8"))
    for use in ("exported",):  # the default load of a cpu artifact is the executable: the tests above run its step
        step = tpumk.load(path, use=use)
        cache = step.init_cache()
        assert isinstance(cache, ref.QuantizedKVCache) and cache.layout.kv_dtype == "int8"
        logits, cache = step(step.pack(params), tokens, positions, cache)
        assert isinstance(cache, ref.QuantizedKVCache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=0, atol=1e-5 * float(np.max(np.abs(want))))


def test_tuning_space_facts_count_the_packed_tiles():
    """The tuning space's KV facts describe the packed cache (one array, its row's lanes per
    token, one byte each), so the default space's VMEM constraint counts the KV tile slots the
    plan allocates."""
    from tpumk.tune.space import space_facts

    s = BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=8, context=4096,
                  tuning=TuningConfig(kv_tile_pages=8, kv_buffers=3))
    plain, packed = space_facts(s), space_facts(s.replace(kv_dtype="fp8"))
    assert (plain["kv_caches"], plain["kv_row_lanes"], plain["kv_code_bytes"]) == (2, 1024, 2)
    assert (packed["kv_caches"], packed["kv_row_lanes"], packed["kv_code_bytes"]) == (1, 2112, 1)
    for f, spec in ((plain, s), (packed, s.replace(kv_dtype="fp8"))):
        tiles = f["kv_caches"] * 3 * 8 * f["page_size"] * f["kv_row_lanes"] * f["kv_code_bytes"]
        att = make_plan(spec).attention
        assert tiles == sum(b.nbytes for b in att.scratch() if b.name in ("k_tiles", "v_tiles", "kv_tiles"))
