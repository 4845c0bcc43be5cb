"""tpumk's interconnect model (tpumk.estimate.interconnect): the check against the published TPU7x
collective figures, the in-kernel all-reduce, XLA's collectives, and their place in the
timeline model of an HLO program. No compiles here (the deviceless topologies are read for
their device coordinates only)."""

from __future__ import annotations

import dataclasses

import pytest

from tpumk.estimate import interconnect as ic
from tpumk.estimate import timeline as cm
from tpumk.estimate.hlo import HloInstr, replica_group
from tpumk.plan.geometry import AllReduceGeometry
from tpumk.targets import TARGETS, get_target

TPU7X = get_target("tpu7x")
KIB, MIB = 2**10, 2**20


# ---------------------------------------------------------------------- the constants
def test_sibling_constants_reproduce_the_published_copies():
    """B and L come from the two published sibling copies alone: L + n / B gives both back."""
    for nbytes, rate in ic.TPU7X_SIBLING_COPY_POINTS:
        t = ic.TPU7X_COPY_LATENCY_S + nbytes / ic.TPU7X_SIBLING_BPS
        assert nbytes / t == pytest.approx(rate, rel=1e-9)
    assert 2.1e-6 < ic.TPU7X_COPY_LATENCY_S < 2.3e-6
    assert 650e9 < ic.TPU7X_SIBLING_BPS < 680e9
    assert ic.TPU7X_LINKS * ic.TPU7X_LINK_BPS == pytest.approx(134e9)  # "three links in parallel 134 GB/s"


def test_every_tpu_generation_has_figures_and_says_what_they_are():
    for t in TARGETS.values():
        f = ic.link_figures(t)
        assert f.link_bps > 0 and f.links >= 1 and f.latency_s > 0
        src = ic.model_source("x", t)
        assert "tpumk interconnect model" in src and "not a measurement" in src
    assert ic.link_figures(get_target("v6e")).link_bps == 100e9  # 800 GB/s bidirectional / 2 / 4 ports
    assert ic.link_figures(get_target("v5e")).link_bps == 50e9  # 400 / 2 / 4
    assert ic.link_figures(get_target("v5p")).cross_bps == 600e9  # 1200 / 2, over 6 links
    assert all(ic.link_figures(get_target(n)).sibling_bps is None for n in ("v5e", "v6e", "v5p"))
    assert "assumed" in ic.link_figures(get_target("v6e")).basis


def test_tpu7x_siblings_share_a_chip():
    coords = ic.device_coords(TPU7X, 8)
    assert all(ic.hops(coords, 2 * r, 2 * r + 1) == 0 for r in range(4))
    assert ic.hops(coords, 0, 2) == 1 and max(ic.hops(coords, 0, j) for j in range(8)) == 2  # 2x2 chips


# ---------------------------------------------------------------------- the model check
def test_published_collective_pattern_within_2x():
    """TPU_FACTS 8: on 8 TPU7x TensorCores at batch 1 the published kernel spends ~14 us per layer
    in four collective phases (two all-reduces, each reduce-scatter + all-gather), 3.5-4.7 us
    per phase. The model sees only the pattern and the shapes: hidden 7168, and either the f32
    tile a batch-1 partial is padded to (8 rows, 224 KiB) or one bare f32 row (28 KiB); what
    the published kernel sends is not published, so both are checked.

    Results (tpumk's model): 3.9 us per phase, 15.6 us per layer, ratio 1.12 for the 8-row tile;
    2.4 us per phase, ratio 0.69 for one row. The band is 2x, not the ring check's 20 %: the
    latency constant comes from a different measurement (sibling copies), the payload is
    unknown (the two payloads alone span 0.69-1.12), and link figures are per-core figures
    measured at other sizes.

    Disagreement, noted: tpumk's own "direct" all-reduce of the 8-row tile costs ~2.3x the
    published layer figure by this model: one round instead of two, but every device sends
    N-1 whole slots (7 x 224 KiB, 8 slot-hops on the 2x2 chips) instead of 2(N-1)/N of one,
    so at this size it is bandwidth-bound on the cross-chip links."""
    tile = ic.published_collective_check(TPU7X)
    assert tile["bytes_per_all_reduce"] == 8 * 7168 * 4
    assert 0.5 <= tile["ratio"] <= 2.0, tile
    assert tile["layer_seconds"] == pytest.approx(4 * tile["phase_seconds"])
    one_row = ic.published_collective_check(TPU7X, rows=8, width=896)  # 28 KiB: one f32 row of 7168
    assert 0.5 <= one_row["ratio"] <= 2.0, one_row
    assert tile["tpumk_direct_ratio"] > 1.5 > tile["ratio"]  # the disagreement above, kept visible
    assert "not a measurement" in tile["source"]


@pytest.mark.parametrize("latency", [1.5e-6, 2.2e-6, 3.0e-6])
@pytest.mark.parametrize("wraparound", [False, True])
def test_check_is_not_a_knife_edge(monkeypatch, latency, wraparound):
    """The check holds for round latencies of 1.5-3 us and whether or not the 2x2 chips have
    the wrap-around links that put the diagonal chip one hop away."""
    monkeypatch.setitem(ic.LINKS, "7x", dataclasses.replace(ic.LINKS["7x"], latency_s=latency))
    if wraparound:
        monkeypatch.setattr(ic, "hops", lambda coords, a, b: min(1, sum(abs(x - y) for x, y in
                                                                     zip(coords[a], coords[b]))))
    assert 0.5 <= ic.published_collective_check(TPU7X)["ratio"] <= 2.0


def test_published_schedule_comparisons():
    """The two schedule changes the published TPU7x kernel measured (issue 29's quote): a bf16 wire
    on a [8, 8192] reduce-scatter + all-gather (9.41 -> 7.28 us, 0.774) and the chip-hierarchical
    all-reduce of [64, 4096] (14.45 -> 13.51 us, 0.935). On 8 TensorCores the model gives
    0.765 and 0.908: the same direction and within 0.03 of each ratio, with no constant chosen
    for them. Its absolute figures are 0.88x of the published ones for [8, 8192] and 1.39x /
    1.35x for [64, 4096] (it overcharges the 1 MiB payload's links), so only the ratios are held
    to a tight band."""
    c = ic.published_schedule_check(TPU7X)
    for part in ("wire", "hierarchy"):
        assert c[part]["model_ratio"] < 1 and c[part]["published_ratio"] < 1, c
        assert c[part]["model_ratio"] == pytest.approx(c[part]["published_ratio"], abs=0.05), c
    for part in ("wire", "hierarchy"):
        for key, pub in c[part]["published_seconds"].items():
            assert 0.5 <= c[part]["model_seconds"][key] / pub <= 2.0, (part, key)
    assert "not a measurement" in c["source"]


# ---------------------------------------------------------------------- tpumk's all-reduce
def test_hierarchical_rounds_and_where_it_pays():
    """Four rounds, half of rsag's cross-chip chunks: the sibling link carries the rest. At a
    batch-1 row the two extra latencies lose; at [64, 4096] on 32 TensorCores the halved
    cross-chip bytes win."""
    f = ic.link_figures(TPU7X)
    one = {s: ic.all_reduce_seconds(TPU7X, AllReduceGeometry(32, 1, 4096, "float32", s))
           for s in ("rsag", "hierarchical")}
    assert (one["rsag"]["rounds"], one["hierarchical"]["rounds"]) == (2, 4)
    assert one["hierarchical"]["latency_seconds"] == pytest.approx(4 * f.latency_s)
    assert one["hierarchical"]["seconds"] > one["rsag"]["seconds"]
    big = {s: ic.all_reduce_seconds(TPU7X, AllReduceGeometry(32, 64, 4096, "float32", s))
           for s in ("rsag", "hierarchical")}
    assert big["hierarchical"]["seconds"] < 0.8 * big["rsag"]["seconds"]
    assert big["hierarchical"]["send_bytes"] == big["rsag"]["send_bytes"]


@pytest.mark.parametrize("chip", ["7x", "v6e", "v5p", "v5e"])
def test_no_schedule_beats_the_floor(chip):
    """`all_reduce_floor` is the least of one direct round and two bare latencies: every
    schedule tpumk builds costs at least that, at either wire."""
    target = next(t for t in TARGETS.values() if t.chip == chip and not t.interpret)
    lat = ic.link_figures(target).latency_s
    for n in (4, 8, 16, 32):
        for rows, width in ((1, 2048), (1, 4096), (8, 7168), (64, 4096)):
            for dtype in ("float32", "bfloat16"):
                floor = ic.all_reduce_floor(target, AllReduceGeometry(n, rows, width, dtype, "rsag"))
                assert floor["seconds"] == pytest.approx(min(floor["one_round_seconds"], 2 * lat))
                assert floor["bound"] == ("one round" if floor["one_round_seconds"] <= 2 * lat else "two rounds")
                schedules = ["direct", "rsag", "doubling"] + (["hierarchical"] if chip == "7x" else [])
                for s in schedules:
                    if s == "doubling" and n & (n - 1):
                        continue
                    cost = ic.all_reduce_seconds(target, AllReduceGeometry(n, rows, width, dtype, s))["seconds"]
                    assert cost >= floor["seconds"] * (1 - 1e-12), (n, rows, width, dtype, s)
    # a batch-1 row on 32 TensorCores: two rounds' latency is the floor, direct's hops lose
    row = ic.all_reduce_floor(TPU7X, AllReduceGeometry(32, 1, 4096, "bfloat16", "direct"))
    if chip == "7x":
        assert row["bound"] == "two rounds" and row["seconds"] == pytest.approx(2 * lat)
    # two TensorCores of one chip: one round on the sibling link is the floor
    pair = ic.all_reduce_floor(TPU7X, AllReduceGeometry(2, 8, 1024))
    assert pair["bound"] == "one round" and pair["seconds"] < 2 * ic.link_figures(TPU7X).latency_s
    assert ic.all_reduce_floor(target, AllReduceGeometry(1, 8, 1024))["seconds"] == 0


def test_all_gather_floor():
    g = AllReduceGeometry(32, 1, 4096)
    for nbytes in (512, 64 * KIB, 4 * MIB):
        floor = ic.all_gather_floor(TPU7X, 32, nbytes)
        assert floor["seconds"] <= ic.all_gather_seconds(TPU7X, g, nbytes)["seconds"] * (1 + 1e-12)
    assert ic.all_gather_floor(TPU7X, 32, 512)["bound"] == "one round"
    assert ic.all_gather_floor(TPU7X, 32, 4 * MIB)["bound"] == "two rounds"
    assert ic.all_gather_floor(TPU7X, 1, 512)["seconds"] == 0


@pytest.mark.parametrize("chip", ["7x", "v6e", "v5p"])
def test_auto_all_reduce_is_the_models_cheapest(chip):
    """The plan's `auto` takes the routable schedule the model costs least: never dearer than
    any schedule the chip routes. qwen3-30b-a3b's batch-1 row on 32 TPU7x TensorCores sends
    248 KiB per direct push, under the byte rule's 256 KiB, but crosses ~2.4 hops a byte:
    rsag, not direct."""
    from tpumk.plan.plan import all_reduce_geometry

    for n in (4, 8, 16, 32):
        for rows, width in ((1, 2048), (1, 4096), (8, 4096), (32, 2048), (64, 4096)):
            auto = all_reduce_geometry(chip, n, rows, width)
            best = ic.all_reduce_seconds_on(chip, auto)["seconds"]
            for s in ("direct", "rsag") + (("hierarchical",) if chip == "7x" else ()):
                other = AllReduceGeometry(n, rows, width, "float32", s)
                assert best <= ic.all_reduce_seconds_on(chip, other)["seconds"] * (1 + 1e-12), (n, rows, width, s)
    if chip == "7x":
        assert AllReduceGeometry.for_chip("7x", 32, 1, 2048).schedule == "direct"  # the byte rule
        assert all_reduce_geometry("7x", 32, 1, 2048).schedule == "rsag"  # the model


def test_step_collectives_floor():
    """A step's floor counts the plan's collectives at their floors: qwen3-235b-a22b on 32
    TPU7x TensorCores at batch 1 is 188 all-reduces at two round latencies each, plus the
    logits all-gather; every schedule and wire stays above it."""
    from tpumk.model.config import load_preset
    from tpumk.plan.contract import logits_slice_bytes
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec

    lat = ic.link_figures(TPU7X).latency_s
    steps = {}
    for schedule in ("rsag", "hierarchical"):
        for wire in ("float32", "bfloat16"):
            plan = make_plan(BuildSpec(load_preset("qwen3-235b-a22b"), TPU7X, devices=32, page_size=256,
                                       tuning=TuningConfig(all_reduce=schedule, all_reduce_wire=wire)))
            steps[schedule, wire] = m = cm.megakernel_step(plan)
            assert m.collectives_floor_seconds <= m.stages["collectives"]["seconds"]
    floors = {m.collectives_floor_seconds for m in steps.values()}
    assert len(floors) == 1  # one floor whatever the schedule or wire
    gather = ic.all_gather_floor(TPU7X, 32, logits_slice_bytes(plan) / 2)["seconds"]
    assert floors.pop() == pytest.approx(188 * 2 * lat + gather)
    one = make_plan(BuildSpec(load_preset("tiny-dense"), TPU7X))
    assert cm.megakernel_step(one).collectives_floor_seconds == 0


def test_all_reduce_direct_and_doubling():
    f = ic.link_figures(TPU7X)
    one = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(1, 8, 1024))
    assert one["seconds"] == 0 and one["rounds"] == 0
    # two devices on TPU7x are one chip's TensorCores: one round on the sibling link
    pair = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(2, 8, 1024))
    assert pair["seconds"] == pytest.approx(f.latency_s + 8 * 1024 * 4 / f.sibling_bps)
    v6e = get_target("v6e")
    assert ic.all_reduce_seconds(v6e, AllReduceGeometry(2, 8, 1024))["seconds"] > pair["seconds"]
    for n in (4, 8, 16):
        d = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(n, 8, 5120, schedule="direct"))
        x = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(n, 8, 5120, schedule="doubling"))
        assert d["send_bytes"] == x["send_bytes"] == (n - 1) * 8 * 5120 * 4
        assert (d["rounds"], x["rounds"]) == (1, n.bit_length() - 1)
        assert d["seconds"] <= x["seconds"]  # one latency, and the same bytes
        assert d["seconds"] == pytest.approx(d["latency_seconds"] + d["transfer_seconds"])
    small = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(8, 8, 1024))
    big = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(8, 64, 1024))
    half = ic.all_reduce_seconds(TPU7X, AllReduceGeometry(8, 64, 1024, dtype="bfloat16"))
    assert small["seconds"] < half["seconds"] < big["seconds"]
    assert half["transfer_seconds"] == pytest.approx(big["transfer_seconds"] / 2)


def test_v5e_gets_its_routable_schedule():
    v5e = get_target("v5e")
    g = AllReduceGeometry.for_chip(v5e.chip, 8, 8, 2048)
    r = ic.all_reduce_seconds(v5e, g)
    assert g.schedule == "doubling" and r["rounds"] == 3 and r["seconds"] > 3 * ic.link_figures(v5e).latency_s


def test_all_reduce_rejects_a_bad_geometry():
    from tpumk.errors import PlanError

    with pytest.raises(PlanError, match="width"):
        ic.all_reduce_seconds(TPU7X, AllReduceGeometry(8, 8, 1000))


# ---------------------------------------------------------------------- XLA's collectives
def test_collective_op_costs():
    f = ic.link_figures(TPU7X)
    small = ic.collective_op_seconds(TPU7X, "all-reduce", 20 * KIB, 8)
    assert small["algorithm"] == "one-shot" and small["rounds"] == 1
    big = ic.collective_op_seconds(TPU7X, "all-reduce", 64 * MIB, 8)
    assert big["algorithm"] != "one-shot" and big["send_bytes"] == pytest.approx(2 * 7 / 8 * 64 * MIB)
    # never below the bandwidth bound: 2(N-1)/N of the buffer over all of a device's links
    assert big["seconds"] >= 2 * 7 / 8 * 64 * MIB / f.cross_bps
    assert ic.collective_op_seconds(TPU7X, "all-reduce-start", 20 * KIB, 8)["seconds"] == small["seconds"]
    assert ic.collective_op_seconds(TPU7X, "all-reduce-done", 20 * KIB, 8)["seconds"] == 0
    assert ic.collective_op_seconds(TPU7X, "all-gather", 20 * KIB, 1)["seconds"] == 0
    rs = ic.collective_op_seconds(TPU7X, "reduce-scatter", 4 * MIB, 8)
    ar = ic.collective_op_seconds(TPU7X, "all-reduce", 4 * MIB, 8)
    assert rs["seconds"] < ar["seconds"]
    for kind in ("all-to-all", "collective-permute", "all-gather-start", "collective-permute-start"):
        r = ic.collective_op_seconds(TPU7X, kind, 1 * MIB, 8)
        assert r["seconds"] > f.latency_s and "not a measurement" in r["source"]
    # a group across chips costs more than the same group size on one chip
    on_chip = ic.collective_op_seconds(TPU7X, "all-gather", 1 * MIB, 2, members=(0, 1))
    across = ic.collective_op_seconds(TPU7X, "all-gather", 1 * MIB, 2, members=(0, 4))
    assert across["seconds"] > on_chip["seconds"]


@pytest.mark.parametrize("args, field", [(("all-sum", 8, 4), "kind"), (("all-reduce", -1, 4), "nbytes"),
                                         (("all-reduce", 8, 0), "devices")])
def test_collective_op_bad_input_names_the_field(args, field):
    with pytest.raises(ValueError, match=f"^{field} = "):
        ic.collective_op_seconds(TPU7X, *args)
    with pytest.raises(ValueError, match="^members = "):
        ic.collective_op_seconds(TPU7X, "all-reduce", 8, 2, members=(0, 0))


@pytest.mark.parametrize("attrs, group", [
    ("replica_groups=mesh['axis_0'=8] {'axis_0'}, use_global_device_ids=true", tuple(range(8))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, dimensions={1}", (0, 2)),
    ("replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}", (0, 1, 4, 5)),
    ("replica_groups={{0,2},{1,3}}, to_apply=%add", (0, 2)),
    ("replica_groups=[2,4]<=[8], to_apply=%add", (0, 1, 2, 3)),
    ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", (0, 4)),
    ("replica_groups={}, to_apply=%add", None),
    ("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", (0, 1, 2, 3)),
])
def test_replica_groups_in_every_printed_form(attrs, group):
    assert replica_group(HloInstr("c", "f32[4]", "all-reduce", [], attrs, False)) == group


# ---------------------------------------------------------------------- in the timeline model
SPMD = """HloModule spmd, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gathered (p: s32[1,4]) -> s32[8,4] {
  %p = s32[1,4]{1,0} parameter(0)
  ROOT %ag = s32[8,4]{1,0} all-gather(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
}

%async_computation (param_0: s32[1,4]) -> s32[8,4] {
  %param_0 = s32[1,4]{1,0} parameter(0)
  ROOT %cc = s32[8,4]{1,0} custom-call(%param_0), custom_call_target="offload", called_computations={%gathered}
}, execution_thread="sparsecore"

%slice_comp (q: s8[1048576]) -> s8[524288] {
  %q = s8[1048576]{0} parameter(0)
  ROOT %sl = s8[524288]{0:S(1)} slice(%q), slice={[0:524288]}
}

ENTRY %main (x: f32[8,5120], i: s32[1,4], w: s8[1048576]) -> f32[8,5120] {
  %x = f32[8,5120]{1,0} parameter(0)
  %i = s32[1,4]{1,0} parameter(1)
  %w = s8[1048576]{0} parameter(2)
  %ar = f32[8,5120]{1,0} all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=8] {'axis_0'}, to_apply=%add
  %ags = ((), (), (s32[16]{0})) async-start(), async_execution_thread="sparsecore", calls=%async_computation
  %agd = s32[8,4]{1,0} async-done(%ags), calls=%async_computation
  %ss = ((s8[1048576]{0}), s8[524288]{0:S(1)}, s32[]{:S(2)}) async-start(%w), calls=%slice_comp
  %sd = s8[524288]{0:S(1)} async-done(%ss), calls=%slice_comp
  %ars = f32[8,5120]{1,0} all-reduce-start(%ar), channel_id=3, replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add
  %ard = f32[8,5120]{1,0} all-reduce-done(%ars)
  ROOT %r = f32[8,5120]{1,0} add(%ard, %ar)
}
"""


def test_xla_step_costs_collectives_as_their_own_stage():
    ops = {o.name: o for o in cm.program_ops(TPU7X, SPMD)[0]}
    assert (ops["ar"].kind, ops["ar"].collective, ops["ar"].collective_bytes, ops["ar"].group) == \
        ("collective", "all-reduce", 8 * 5120 * 4, tuple(range(8)))
    # an async, SparseCore-offloaded all-gather behind a custom call: its operand is one device's shard
    assert (ops["ags"].kind, ops["ags"].collective, ops["ags"].collective_bytes) == ("collective", "all-gather", 16)
    assert ops["ars"].group == (0, 2, 4, 6) and ops["ard"].kind == ops["agd"].kind == "free"
    assert ops["ss"].kind == "async_dma" and ops["ss"].read_bytes == 512 * KIB  # the dump's slice-start
    assert cm.program_collectives(TPU7X, SPMD) == {"all-reduce": 2, "all-gather": 1}

    m = cm.xla_step(TPU7X, SPMD)
    expected = (ic.collective_op_seconds(TPU7X, "all-reduce", 8 * 5120 * 4, 8)["seconds"]
                + ic.collective_op_seconds(TPU7X, "all-gather", 16, 8)["seconds"]
                + ic.collective_op_seconds(TPU7X, "all-reduce", 8 * 5120 * 4, 4, members=(0, 2, 4, 6))["seconds"])
    assert m.stages["collectives"]["seconds"] == pytest.approx(expected)
    assert m.seconds == pytest.approx(sum(s["seconds"] for s in m.stages.values()))
    assert any("3 XLA collective ops" in n and "tpumk interconnect model" in n for n in m.notes)
    assert m.kernels == 1  # the add; collectives and the prefetch are not kernels


def test_a_group_spanning_every_device_needs_the_device_count():
    text = SPMD.replace("replica_groups=mesh['axis_0'=8] {'axis_0'}", "replica_groups={}")
    with pytest.raises(ValueError, match="pass devices"):
        cm.xla_step(TPU7X, text)
    assert cm.xla_step(TPU7X, text, devices=8).seconds == pytest.approx(cm.xla_step(TPU7X, SPMD).seconds)
