"""tpumk's timeline model (tpumk.estimate.timeline): the published-ring check, the HBM floor, knob
responses, MoE vs dense, and the XLA side's reading of compiled HLO. No compiles here except
one small XLA program (tiny-dense on tpu7x, a few seconds)."""

from __future__ import annotations

import pytest

from tpumk.estimate import timeline as cm
from tpumk.model.config import load_preset
from tpumk.errors import PlanError
from tpumk.plan.plan import make_plan
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec

MIB = 2**20
TPU7X = get_target("tpu7x")


# ---------------------------------------------------------------------- the model check
def test_published_ring_within_20_percent_of_the_chip_measurement():
    """TPU_FACTS 6: 12 banks of 2 MiB bf16, 76 MiB per layer, measured at 26.4 us on a TPU7x
    TensorCore. The model sees only those shapes and the chip figures."""
    check = cm.published_ring_check(TPU7X)
    assert check["measured_seconds"] == 26.4e-6
    assert 0.8 <= check["ratio"] <= 1.2, check
    # the same figure through the public function, DMA only (the ring is DMA-bound at batch 1)
    dma_only = cm.ring_layer_seconds(TPU7X, 2 * MIB, 12, 76 * MIB)
    assert dma_only == pytest.approx(check["predicted_seconds"], rel=1e-9)


@pytest.mark.parametrize("latency", [0.5e-6, 1e-6, 2e-6])
@pytest.mark.parametrize("descriptor", [0.0, 50e-9, 200e-9])
def test_ring_check_is_not_a_knife_edge(monkeypatch, latency, descriptor):
    """The check holds for DMA latencies from 0.5 to 2 us and descriptor costs from 0 to 200 ns:
    it follows from the bandwidth and the bytes in flight, not from a tuned constant."""
    monkeypatch.setattr(cm, "DMA_LATENCY_S", latency)
    monkeypatch.setitem(cm.DMA_ENGINE, "tpu7x", cm.DmaEngine(descriptor, cm.DMA_ENGINE["tpu7x"].queue_bytes_per_s))
    assert 0.8 <= cm.published_ring_check(TPU7X)["ratio"] <= 1.2


def test_bandwidth_delay_shape():
    bw = TPU7X.hbm_bandwidth
    half = bw * cm.DMA_LATENCY_S  # bytes in flight at which half the peak is reached
    assert cm.achieved_bandwidth(TPU7X, half) == pytest.approx(bw / 2)
    rates = [cm.achieved_bandwidth(TPU7X, d * 2 * MIB) for d in (1, 2, 4, 8, 12, 64)]
    assert all(a < b for a, b in zip(rates, rates[1:]))
    assert rates[-1] < bw
    # small DMAs are bound by the descriptor rate, not their bytes
    small = cm.load_seconds(TPU7X, 100 * 4096, 64 * MIB, descriptors=100)
    assert small == pytest.approx(100 * cm.dma_engine(TPU7X).descriptor_s)


def test_stall_when_compute_exceeds_the_load():
    load = cm.load_seconds(TPU7X, 2 * MIB, 24 * MIB)
    assert cm.stream_seconds(TPU7X, 10, 2 * MIB, 24 * MIB, compute_each=load / 2) == pytest.approx(10 * load)
    assert cm.stream_seconds(TPU7X, 10, 2 * MIB, 24 * MIB, compute_each=3 * load) == pytest.approx(30 * load)


def test_mxu_rows_below_the_array_width_cost_a_full_push():
    e = 1024 * 1024
    one_row = cm.mxu_seconds(TPU7X, e, 2 * 1 * e)
    full = cm.mxu_seconds(TPU7X, e, 2 * TPU7X.mxu_shape[1] * e)
    assert one_row == pytest.approx(full)
    assert cm.mxu_seconds(TPU7X, e, 2 * 1024 * e) == pytest.approx(4 * full)  # 1024 rows: 4x the 256-row push
    assert cm.mxu_seconds(TPU7X, e, 0, passes=6) == pytest.approx(6 * full)


# ---------------------------------------------------------------------- megakernel_step
PLANS = [("tiny-dense", "tpu7x", 1), ("tiny-moe", "tpu7x", 8), ("tiny-moe", "v6e", 1), ("qwen3-8b", "tpu7x", 1),
         ("qwen3-8b", "v6e", 8), ("qwen3-30b-a3b", "tpu7x", 1), ("qwen3-30b-a3b", "tpu7x", 8),
         ("qwen3-32b", "tpu7x", 1), ("qwen3-8b", "v5e", 1)]


@pytest.mark.parametrize("preset, target, batch", PLANS)
def test_never_beats_the_floor_and_moves_the_plans_bytes(preset, target, batch):
    plan = make_plan(BuildSpec(load_preset(preset), get_target(target), batch, 4096))
    m = cm.megakernel_step(plan)
    assert m.hbm_bytes == pytest.approx(plan.hbm_bytes, rel=1e-9)
    assert m.seconds >= plan.floor_seconds
    assert m.floor_seconds == plan.floor_seconds and 0 < m.floor_fraction <= 1
    assert not m.notes  # no clamping was needed: every byte is paid for at <= the peak bandwidth
    assert m.seconds == pytest.approx(sum(s["seconds"] for s in m.stages.values()))
    assert m.dma_seconds > 0 and m.compute_seconds > 0 and m.kernels == 1
    assert "tpumk timeline model" in m.source and "not measurements" in m.source


@pytest.mark.parametrize("tuning", [dict(ring_depth=2, tile_bytes=256 * 1024), dict(ring_depth=24, tile_bytes=MIB),
                                    dict(kv_buffers=2, kv_tile_pages=1), dict(expert_slots=1),
                                    dict(expert_slots=8, expert_chunk=128)])
def test_never_beats_the_floor_for_odd_knobs(tuning):
    plan = make_plan(BuildSpec(load_preset("qwen3-30b-a3b"), TPU7X, 4, 4096, TuningConfig(**tuning)))
    m = cm.megakernel_step(plan)
    assert m.seconds >= plan.floor_seconds
    assert m.hbm_bytes == pytest.approx(plan.hbm_bytes, rel=1e-9)


def _seconds(preset, batch=1, target=TPU7X, page_size=16, **knobs) -> float:
    plan = make_plan(BuildSpec(load_preset(preset), target, batch, 4096, TuningConfig(**knobs), page_size=page_size))
    return cm.megakernel_step(plan).seconds


def test_deeper_ring_is_faster_until_it_saturates():
    t = [_seconds("qwen3-8b", ring_depth=d, tile_bytes=MIB) for d in (2, 4, 8, 16)]
    assert t[0] > t[1] > t[2] > t[3]
    # the gain shrinks as the bytes in flight pass the bandwidth-delay product
    assert (t[0] - t[1]) > (t[1] - t[2]) > (t[2] - t[3])


def test_more_queues_beat_bigger_tiles_at_equal_bytes_in_flight():
    """The same 4 MiB in flight in 64 KiB tiles (64 deep) against 1 MiB tiles (4 deep): the
    compiler's DMA model prefers the deeper ring (tests/test_dma_probe.py, BENCHMARKS.md), and so
    does the model since its queue law; per-DMA setup still binds far smaller tiles."""
    small = _seconds("qwen3-8b", ring_depth=64, tile_bytes=64 * 1024)
    large = _seconds("qwen3-8b", ring_depth=4, tile_bytes=MIB)
    assert small < large


def test_kv_buffers_and_tile_size_matter():
    # The other KV knob fixed at its pre-auto default (2 pages of 128 / 16 of 16, 3 buffers):
    # with both at auto the plan picks the pair itself (test_plan.py).
    # 128-token pages (256 KiB DMAs): the KV stream is bound by its bytes in flight
    big = dict(page_size=128, kv_tile_pages=2)
    assert _seconds("qwen3-8b", 8, **big, kv_buffers=2) > _seconds("qwen3-8b", 8, **big, kv_buffers=6)
    assert _seconds("qwen3-8b", 8, page_size=128, kv_buffers=3, kv_tile_pages=1) > \
        _seconds("qwen3-8b", 8, page_size=128, kv_buffers=3, kv_tile_pages=4)
    # 16-token pages (32 KiB DMAs, one semaphore per page DMA): bound by the DMA queues
    # (tests/test_dma_probe.py), so more tiles in flight and bigger tiles both win
    small = dict(page_size=16, kv_tile_pages=16)
    assert _seconds("qwen3-8b", 8, **small, kv_buffers=2) > _seconds("qwen3-8b", 8, **small, kv_buffers=4)
    assert _seconds("qwen3-8b", 8, page_size=16, kv_buffers=3, kv_tile_pages=4) > \
        _seconds("qwen3-8b", 8, page_size=16, kv_buffers=3, kv_tile_pages=16)


def test_moe_reads_only_routed_experts_and_dense_does_not_route():
    moe = make_plan(BuildSpec(load_preset("qwen3-30b-a3b"), TPU7X, 1, 4096))
    dense = make_plan(BuildSpec(load_preset("qwen3-8b"), TPU7X, 1, 4096))
    m, d = cm.megakernel_step(moe), cm.megakernel_step(dense)
    assert {"moe_routing", "experts"} <= set(m.stages) and not {"moe_routing", "experts"} & set(d.stages)
    # the experts stage moves the plan's expected distinct experts (plus the shared expert's tiles)
    shared = sum(moe.hbm[f"weights_{n}"] for n in ("shared_gate_up", "shared_down") if f"weights_{n}" in moe.hbm)
    routed = moe.hbm["experts_and_router"] - moe.moe.num_moe_layers * moe.moe.router_bytes
    assert m.stages["experts"]["hbm_bytes"] == pytest.approx(shared + routed, rel=1e-9)
    # more tokens route to more distinct experts: the experts stage grows, the dense ring does not
    m8 = cm.megakernel_step(make_plan(BuildSpec(load_preset("qwen3-30b-a3b"), TPU7X, 8, 4096)))
    assert m8.stages["experts"]["seconds"] > 2 * m.stages["experts"]["seconds"]
    assert m8.stages["weight_ring"]["seconds"] == pytest.approx(m.stages["weight_ring"]["seconds"], rel=0.05)
    # one expert slot serialises loads and compute
    assert _seconds("qwen3-30b-a3b", 8, expert_slots=1) > _seconds("qwen3-30b-a3b", 8, expert_slots=4)


def test_moe_step_costs_what_its_bytes_cost_not_its_parameters():
    """qwen3-30b-a3b has ~4x qwen3-8b's parameters but moves fewer bytes per step at batch 1."""
    moe = make_plan(BuildSpec(load_preset("qwen3-30b-a3b"), TPU7X, 1, 4096))
    dense = make_plan(BuildSpec(load_preset("qwen3-8b"), TPU7X, 1, 4096))
    assert moe.cfg.param_count() > 3 * dense.cfg.param_count()
    assert moe.hbm_bytes < dense.hbm_bytes
    assert cm.megakernel_step(moe).seconds < cm.megakernel_step(dense).seconds


def test_slower_chip_is_slower():
    assert _seconds("qwen3-8b", target=get_target("v5e")) > _seconds("qwen3-8b", target=get_target("v6e")) \
        > _seconds("qwen3-8b", target=TPU7X)


def test_infeasible_plan_is_rejected_before_modelling():
    with pytest.raises(PlanError):
        make_plan(BuildSpec(load_preset("qwen3-8b"), TPU7X, 1, 4096, TuningConfig(ring_depth=64, tile_bytes=4 * MIB)))


# ---------------------------------------------------------------------- xla_step on HLO text
SYNTHETIC = """HloModule synthetic, is_scheduled=true

%fused_slice (param_0: bf16[4,1024,1024], param_1: s32[]) -> bf16[1024,1024] {
  %param_0 = bf16[4,1024,1024]{2,1,0} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %c = s32[]{:T(128)} constant(0)
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,1024,1024}
  ROOT %b = bf16[1024,1024]{1,0} bitcast(%ds)
}

%fused_dot (param_0: f32[8,1024], param_1: bf16[1024,1024]) -> f32[8,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = bf16[1024,1024]{1,0} parameter(1)
  %cv = bf16[8,1024]{1,0} convert(%param_0)
  ROOT %dot = f32[8,1024]{1,0} dot(%cv, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (param_0: bf16[4,1024,1024], param_1: bf16[1,8,1024], param_2: s32[]) -> bf16[4,1024,1024] {
  %param_0 = bf16[4,1024,1024]{2,1,0} parameter(0)
  %param_1 = bf16[1,8,1024]{2,1,0} parameter(1)
  %param_2 = s32[]{:T(128)} parameter(2)
  %c = s32[]{:T(128)} constant(0)
  ROOT %dus = bf16[4,1024,1024]{2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c, %c)
}

%body (p: f32[8,1024]) -> f32[8,1024] {
  %p = f32[8,1024]{1,0} parameter(0)
  ROOT %e = f32[8,1024]{1,0} fusion(%p), kind=kLoop, calls=%fused_exp
}

%fused_exp (param_0: f32[8,1024]) -> f32[8,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  ROOT %x = f32[8,1024]{1,0} exponential(%param_0)
}

ENTRY %main (w: bf16[4,1024,1024], x: f32[8,1024], i: s32[], u: bf16[1,8,1024]) -> (f32[8,1024], bf16[4,1024,1024]) {
  %w = bf16[4,1024,1024]{2,1,0} parameter(0)
  %x = f32[8,1024]{1,0:T(8,128)S(1)} parameter(1)
  %i = s32[]{:T(128)S(6)} parameter(2)
  %u = bf16[1,8,1024]{2,1,0} parameter(3)
  %sl = bf16[1024,1024]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %y = f32[8,1024]{1,0:T(8,128)S(1)} fusion(%x, %sl), kind=kOutput, calls=%fused_dot, backend_config={"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"4194304"}]}
  %w2 = bf16[4,1024,1024]{2,1,0} fusion(%w, %u, %i), kind=kLoop, calls=%fused_update
  %j = s32[]{:T(128)S(6)} add(%i, %i)
  %cs = (bf16[1024,1024]{1,0:S(1)}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%sl)
  %cd = bf16[1024,1024]{1,0:S(1)} copy-done(%cs)
  %lp = f32[8,1024]{1,0} while(%y), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %t = (f32[8,1024]{1,0:T(8,128)S(1)}, bf16[4,1024,1024]{2,1,0}) tuple(%y, %w2)
}
"""


def test_hlo_ops_count_slices_in_place_updates_vmem_and_loops():
    ops = {o.name: o for o in cm.program_ops(TPU7X, SYNTHETIC)[0]}
    two_mib = 1024 * 1024 * 2
    assert (ops["sl"].kind, ops["sl"].read_bytes, ops["sl"].write_bytes) == ("kernel", two_mib, two_mib)  # one slice
    assert (ops["y"].read_bytes, ops["y"].write_bytes) == (two_mib, 0)  # x and y live in VMEM
    assert ops["y"].window_bytes == 4 * MIB
    assert ops["y"].mxu_seconds == pytest.approx(cm.mxu_seconds(TPU7X, 1024 * 1024, 2 * 8 * 1024 * 1024))
    assert (ops["w2"].read_bytes, ops["w2"].write_bytes) == (16384, 16384)  # in place: only the update moves
    assert ops["j"].kind == "scalar" and ops["t"].kind == "free" and ops["cd"].kind == "free"
    assert ops["cs"].kind == "async_dma" and ops["cs"].read_bytes == two_mib
    assert ops["e"].times == 5  # the while body, once per known trip

    m = cm.xla_step(TPU7X, SYNTHETIC)
    assert m.kernels == 3 + 5
    loop_bytes = 5 * 2 * 8 * 1024 * 4
    assert m.hbm_bytes == pytest.approx(3 * two_mib + 2 * 16384 + two_mib + loop_bytes)
    boundaries = m.stages["kernel boundaries"]["seconds"]
    # dispatch for every kernel; fill when it reads HBM, drain when it writes HBM
    assert boundaries == pytest.approx(8 * cm.OP_DISPATCH_S + (1 + 1 + 1 + 5) * cm.DMA_LATENCY_S
                                       + (1 + 0 + 1 + 5) * cm.DMA_LATENCY_S)
    assert m.seconds >= m.hbm_bytes / TPU7X.hbm_bandwidth


def test_pallas_kernel_needs_its_model():
    text = SYNTHETIC.replace("%j = s32[]{:T(128)S(6)} add(%i, %i)",
                             '%j = f32[8,1024]{1,0} custom-call(%x), custom_call_target="tpu_custom_call"')
    with pytest.raises(ValueError, match="Pallas kernel"):
        cm.xla_step(TPU7X, text)
    plan = make_plan(BuildSpec(load_preset("tiny-dense"), TPU7X, 1, 4096))
    kernel = cm.megakernel_step(plan)
    m = cm.xla_step(TPU7X, text, kernel=kernel)
    assert m.kernels == 3 + 5 + 1
    assert m.seconds == pytest.approx(cm.xla_step(TPU7X, SYNTHETIC).seconds + kernel.seconds)


def test_xla_program_model_against_its_cost_analysis():
    """A real compiled XLA decode step: the model's HBM bytes sit between the weights the step
    must read and XLA's own cost_analysis bytes; the model never beats its own bytes' floor."""
    from tpumk.decode.xla_compile import compile_program
    from tpumk.model.xla_step import xla_decode_step, xla_step_specs

    cfg = load_preset("tiny-dense").replace(dtype="bfloat16")
    prog = compile_program(lambda p, t, pos, k, v, n: xla_decode_step(p, cfg, t, pos, k, v, n),
                           xla_step_specs(cfg, 1, 4096), TPU7X, donate_argnums=(3, 4))
    m = cm.xla_step(TPU7X, prog.hlo_text)
    plan = make_plan(BuildSpec(cfg, TPU7X, 1, 4096))
    weights = sum(v for k, v in plan.hbm.items() if k.startswith("weights_"))
    assert weights + plan.hbm["kv_cache"] * 0.9 < m.hbm_bytes <= prog.compiled.cost_analysis()["bytes accessed"] * 1.01
    assert m.seconds >= m.hbm_bytes / TPU7X.hbm_bandwidth
    assert m.kernels > 10 * cfg.num_layers  # op by op: many kernels per layer
    assert m.stages["kernel boundaries"]["seconds"] >= m.kernels * cm.OP_DISPATCH_S


def test_sliding_layers_cost_only_their_window():
    """Qwen3-8B with its last 8 layers sliding a 4096-token window (max_window_layers 28) at
    32k context: the model moves the plan's bytes, and the KV bytes and seconds drop."""
    full = load_preset("qwen3-8b")
    slide = full.replace(sliding_window=4096, sliding_layers=list(range(28, 36)))
    plans = {c.sliding_window: make_plan(BuildSpec(c, TPU7X, 1, 32768)) for c in (full, slide)}
    models = {w: cm.megakernel_step(p) for w, p in plans.items()}
    for w, p in plans.items():
        assert models[w].hbm_bytes == pytest.approx(p.hbm_bytes, rel=1e-9)
        assert models[w].seconds >= p.floor_seconds
    kv_full, kv_slide = (plans[w].hbm["kv_cache"] for w in (0, 4096))
    # 28 full layers read the whole context, 8 only the tiles of the last 4096 keys (+ a tile).
    assert kv_full * 28 / 36 < kv_slide < kv_full * (28 + 8 * (4096 + 2048) / 32768) / 36
    assert models[4096].seconds < models[0].seconds
    # The compiler estimate's nested-loop trips (tpumk.estimate.compiler) count the same tiles.
    from tpumk.estimate.compiler import uncounted_nested_work

    for w, p in plans.items():  # each plan's own KV tile (auto knobs may differ)
        s = p.attention.tile_rows
        full_layer, slide_layer = -(-32768 // s), -(-32768 // s) - (32767 - 4095) // s
        want = 36 * (full_layer - 1) if w == 0 else 28 * full_layer + 8 * slide_layer - 36
        assert uncounted_nested_work(p)[0]["uncounted_trips"] == pytest.approx(want)


def test_next_layer_kv_prefetch_is_modelled_where_the_kernel_does_it(monkeypatch):
    """The kernel starts a layer's first kv_buffers - 1 KV tiles at the end of the previous
    layer's tile loop (GQA, no sliding windows: tpumk.kernel.attention, prefetch_next): the
    model skips those tiles' fill there and charges their bytes beside the previous tail's ring,
    for every layer but the kernel's first, and nowhere else (MLA, sliding layers)."""
    calls = []
    real = cm._attention_stage

    def spy(plan, ledger, extra, times, windows=(0,), started=False, ring_bytes_in_flight=0.0, patches_early=False):
        calls.append((times, started))
        assert patches_early == (not plan.cfg.is_mla)  # the megakernel's GQA path: attention_prefetch
        return real(plan, ledger, extra, times, windows, started, ring_bytes_in_flight, patches_early)

    monkeypatch.setattr(cm, "_attention_stage", spy)
    dense = make_plan(BuildSpec(load_preset("qwen3-8b"), TPU7X, 8, 4096))  # (auto KV knobs walk it too)
    calls.clear()
    cm.megakernel_step(dense)
    assert calls == [(1.0, False), (35.0, True)]
    slide = load_preset("qwen3-8b").replace(sliding_window=4096, sliding_layers=list(range(28, 36)))
    for plan in (make_plan(BuildSpec(slide, TPU7X, 1, 32768)),
                 make_plan(BuildSpec(load_preset("tiny-mla").replace(hidden_size=128, expert_ffn_size=128,
                                                                     shared_expert_ffn_size=128), TPU7X, 2, 256))):
        calls.clear()
        cm.megakernel_step(plan)
        assert calls and not any(s for _, s in calls)
    monkeypatch.undo()

    # Same bytes; the prefetched layer skips the fill and pays the early tiles' transfer beside
    # the previous tail's ring instead: a small gain where the layer's KV stream is engine-bound.
    for batch in (1, 8):
        plan = make_plan(BuildSpec(load_preset("qwen3-8b"), TPU7X, batch, 4096))
        depth = plan.ring_depth * plan.slot_rows * plan.slot_cols * 2
        cold = cm._attention_stage(plan, cm._Ledger(), 0.0, 1.0, (0,), False, depth)
        warm = cm._attention_stage(plan, cm._Ledger(), 0.0, 1.0, (0,), True, depth)
        assert warm[1] == cold[1]
        assert warm[0] < cold[0]
