import dataclasses
import json
import math
import random
import statistics

import pytest
import torch
from dist_harness import run_ranks

from osdp.machine.collective_model import COLLECTIVES, AlphaBeta, CollectiveModel, Topology, ring_factor
from osdp.machine.device_info import DeviceInfo
from osdp.machine.measure import combine_samples, measure_collectives, measure_device, measure_flops
from osdp.machine.presets import DEVICE_PRESETS, device_preset, list_presets, multi_node_presets
from osdp.machine.workspace import cublas_workspace_bytes, cublaslt_workspace_bytes, training_workspace_bytes
from osdp.sizes import format_bytes, parse_size

# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        (16 * 2**30, 16 * 2**30),
        ("16GiB", 16 * 2**30),
        ("16 GiB", 16 * 2**30),
        (" 16 gib ", 16 * 2**30),
        ("16000MB", 16 * 10**9),
        ("1.5GB", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("512mib", 512 * 2**20),
        ("2048", 2048),
        ("2048B", 2048),
        ("4kB", 4000),
        ("4KB", 4000),
        ("1TiB", 2**40),
        ("0.5KiB", 512),
        ("1.1KiB", 1126),  # 1126.4 bytes, rounded down
        (8e9, 8_000_000_000),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "junk, reason",
    [
        ("sixteen", "expected a number followed by an optional unit"),
        ("-1GiB", "a memory size must be positive"),
        ("16 GB GB", "expected a number followed by an optional unit"),
        ("", "expected a number followed by an optional unit"),
        (None, "expected a number of bytes or a string with a unit"),
        (0, "a memory size must be positive"),
        ("0GiB", "a memory size must be positive"),
        (-5, "a memory size must be positive"),
        ("16g", "unit 'g' is ambiguous, write 16GB or 16GiB"),
        ("16 M", "unit 'M' is ambiguous, write 16MB or 16MiB"),
        ("16 GHz", "unknown unit 'GHz'"),
        ("2048.5", "a plain number is a count of bytes and must be whole"),
        (1.5, "a plain number is a count of bytes and must be whole"),
        (float("inf"), "a plain number is a count of bytes and must be whole"),
        (True, "expected a number of bytes or a string with a unit"),
        ([16], "expected int or str, got list"),
    ],
)
def test_parse_size_rejects_with_reason_and_examples(junk, reason):
    with pytest.raises(ValueError) as info:
        parse_size(junk)
    message = str(info.value)
    assert reason in message
    assert "examples: 16GiB" in message and "powers of 1024" in message


def test_parse_size_message_in_full():
    with pytest.raises(ValueError) as info:
        parse_size("16g")
    assert str(info.value) == (
        "invalid memory size '16g': unit 'g' is ambiguous, write 16GB or 16GiB; "
        "examples: 16GiB, '16 GiB', 1.5GB, 512MiB, 2048 (bytes); units are case-insensitive: "
        "kB MB GB TB (powers of 1000), KiB MiB GiB TiB (powers of 1024)"
    )


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (16 * 2**30, "16.00 GiB"), (-3 * 2**20, "-3.00 MiB"),
     (5 * 2**40, "5.00 TiB"), (2**60, "1048576.00 TiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# ----------------------------------------------------------------------------- alpha-beta


def test_fit_recovers_alpha_beta_exactly():
    alpha, beta = 25e-6, 1 / 200e9
    sizes = [4 * 2**10 * 8**i for i in range(5)]
    fit = AlphaBeta.fit(sizes, [alpha + s * beta for s in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)


def test_fit_recovers_alpha_beta_from_noisy_timings():
    rng = random.Random(0)
    alpha, beta = 300e-6, 1 / 1.2e9
    sizes = [4 * 2**10 * 2**i for i in range(13)] * 5
    times = [(alpha + s * beta) * rng.uniform(0.95, 1.05) for s in sizes]
    fit = AlphaBeta.fit(sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)


def test_fit_never_returns_negative_terms():
    # Timings that fall with size would give a negative slope in plain least squares.
    fit = AlphaBeta.fit([1e3, 1e6], [2e-3, 1e-3])
    assert fit.beta_s_per_byte == 0 and fit.alpha_s > 0
    # A bandwidth-only collective would give a negative intercept.
    fit = AlphaBeta.fit([1e3, 1e6, 1e7], [1e-7, 1e-3, 1.1e-2])
    assert fit.alpha_s == 0 and fit.beta_s_per_byte > 0


def test_fit_rejects_too_few_sizes_and_bad_timings():
    with pytest.raises(ValueError, match="two or more message sizes"):
        AlphaBeta.fit([1024, 1024], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="positive and finite"):
        AlphaBeta.fit([1024, 2048], [1e-3, float("nan")])


def test_ring_formula_and_bus_bandwidth():
    assert ring_factor("all_gather", 8) == ring_factor("reduce_scatter", 8) == 7 / 8
    assert ring_factor("all_reduce", 8) == 2 * 7 / 8
    m = CollectiveModel.ring(8, dict.fromkeys(COLLECTIVES, 100e9), dict.fromkeys(COLLECTIVES, 10e-6))
    assert m.time("all_gather", 800e6) == pytest.approx(10e-6 + 800e6 * 7 / 8 / 100e9)
    assert m.time("all_reduce", 800e6) == pytest.approx(10e-6 + 800e6 * 2 * 7 / 8 / 100e9)
    assert m.bus_bandwidth("reduce_scatter") == pytest.approx(100e9)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        m.time("broadcast", 1)


def test_collective_model_round_trips_through_json():
    m = CollectiveModel.fit(
        2, {c: [(4096, 1e-4 * (i + 1)), (2**20, 1e-3 * (i + 1))] for i, c in enumerate(COLLECTIVES)}, "synthetic"
    )
    assert CollectiveModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert [n for n, _ in m.samples["all_reduce"]] == [4096, 2**20]
    assert [t for _, t in m.samples["all_reduce"]] == pytest.approx([3e-4, 3e-3])


def test_largest_message_bandwidth_is_the_rate_not_the_fit():
    # a shaped link: messages within the burst pass at once, the rest at 100 MB/s
    burst, rate = 96e3, 100e6
    samples = {c: [(n, 1e-4 + max(0.0, n / 2 - burst) / rate) for n in (4096, 32768, 262144, 2**21, 2**24)]
               for c in COLLECTIVES}
    m = CollectiveModel.fit(2, samples)
    assert m.largest_message_bus_bandwidth("all_gather") == pytest.approx(0.5 * 2**24 / (1e-4 + (2**23 - burst) / rate))
    assert m.largest_message_bus_bandwidth("all_gather") == pytest.approx(rate, rel=0.02)
    assert m.bus_bandwidth("all_gather") > 1.05 * rate  # the burst pulls the fitted beta under the rate
    unmeasured = CollectiveModel.ring(2, dict.fromkeys(COLLECTIVES, 5e9), dict.fromkeys(COLLECTIVES, 1e-5))
    assert unmeasured.largest_message_bus_bandwidth("reduce_scatter") == pytest.approx(5e9)


def test_combined_samples_take_each_size_across_models():
    fits = [CollectiveModel.fit(2, {c: [(4096, t), (2**20, 8 * t)] for c in COLLECTIVES}) for t in (1e-4, 3e-4, 2e-4)]
    assert combine_samples(fits, max)["all_gather"] == ((4096, 3e-4), (2**20, 24e-4))
    assert combine_samples(fits, statistics.median)["reduce_scatter"] == ((4096, 2e-4), (2**20, 16e-4))
    assert combine_samples([CollectiveModel.zero()], max) == {}


def test_world_size_one_costs_nothing():
    m = CollectiveModel.zero()
    assert all(m.time(c, 2**30) == 0 for c in COLLECTIVES)
    assert math.isinf(m.bus_bandwidth("all_gather"))
    assert measure_collectives() == m  # no process group in this process


def _measure(rank, world_size):
    torch.manual_seed(rank)
    # 16 MiB, not 4: on ranks pinned to one core each, a 4 KiB collective can take a scheduler slice
    # (~2.5 ms, seen once in a full suite), as long as a 4 MiB one, which left the fit no slope
    m = measure_collectives(sizes=(4096, 65536, 16 << 20), time_budget_s=0.5)
    return m.to_dict()


def test_measure_collectives_on_two_gloo_ranks():
    results = run_ranks(_measure, 2, timeout=120)
    assert results[0] == results[1], "ranks must plan from the identical model"
    m = CollectiveModel.from_dict(results[0])
    assert m.world_size == 2 and m.source.startswith("measured gloo cpu 2 ranks")
    for c in COLLECTIVES:
        t_small, t_large = m.time(c, 4096), m.time(c, 16 << 20)
        assert 0 < t_small <= t_large < 1.0 and math.isfinite(t_large)
        assert m.costs[c].beta_s_per_byte > 0  # 16 MiB take longer than 4 KiB on any machine
        assert [n for n, _ in m.samples[c]] == [4096, 65536, 16 << 20]
        nbytes, seconds = m.samples[c][-1]
        assert m.largest_message_bus_bandwidth(c) == pytest.approx(ring_factor(c, 2) * nbytes / seconds)


# ----------------------------------------------------------------------------- compute


def test_measure_flops_is_positive_and_quick():
    assert 1e8 < measure_flops("cpu", torch.float32, n=128, time_budget_s=0.02) < 1e14


# ----------------------------------------------------------------------------- presets


def test_presets_are_listed_and_complete():
    names = list_presets()
    assert names == sorted(DEVICE_PRESETS)
    for expected in ("h100-nvlink", "a100-40gb-nvlink", "a100-80gb-nvlink", "v100-32gb-nvlink", "h100-ib",
                     "cpu-loopback", "h100-nvlink-ndr400", "a100-nvlink-hdr200", "h100-nvlink-100gbe"):
        assert expected in names
    for name in names:
        d = device_preset(name, 2)
        assert d.world_size == 2 and d.memory_bytes > 0 and d.flops
        assert all(v > 0 for v in d.flops.values())
        assert all(d.collectives.time(c, 1 << 20) > d.collectives.time(c, 1024) > 0 for c in COLLECTIVES)


def test_preset_lookup_follows_the_ring_formula():
    d = device_preset("h100-nvlink", 8)
    assert d.device_type == "cuda" and d.memory_bytes == 80 * 2**30
    assert d.flops_for(torch.bfloat16) == pytest.approx(0.45 * 989e12)
    assert d.collectives.bus_bandwidth("all_gather") == pytest.approx(360e9)
    assert d.collectives.time("all_gather", 2**30) == pytest.approx(20e-6 + 2**30 * 7 / 8 / 360e9)
    assert device_preset("h100-nvlink", 1).collectives.time("all_reduce", 2**30) == 0


def test_preset_memory_override_and_limits():
    assert device_preset("a100-40gb-nvlink", 4, memory="30GiB").memory_bytes == 30 * 2**30
    with pytest.raises(ValueError, match="at most 8 ranks.*'h100-ib'"):
        device_preset("h100-nvlink", 16)
    assert device_preset("h100-ib", 64).world_size == 64
    with pytest.raises(KeyError, match="no FLOP/s figure for bfloat16"):
        device_preset("v100-32gb-nvlink", 8).flops_for(torch.bfloat16)


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError) as info:
        device_preset("tpu-v5", 8)
    assert "unknown device preset 'tpu-v5'" in str(info.value)
    assert all(name in str(info.value) for name in list_presets())


def test_device_info_round_trips_through_json():
    d = device_preset("cpu-loopback", 2, memory="2 GiB")
    assert DeviceInfo.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    with pytest.raises(ValueError, match="missing \\['collectives'\\]"):
        DeviceInfo.from_dict({k: v for k, v in d.to_dict().items() if k != "collectives"})
    pairwise = dataclasses.replace(d, reduce_scatter="pairwise")
    assert DeviceInfo.from_dict(json.loads(json.dumps(pairwise.to_dict()))) == pairwise
    assert "reduce_scatter" not in d.to_dict()  # older descriptions and caches read as the native one
    with pytest.raises(ValueError, match="reduce_scatter must be 'native' or 'pairwise', got 'ring'"):
        dataclasses.replace(d, reduce_scatter="ring")


def test_a_reduce_scatter_is_priced_with_the_buffers_its_implementation_holds_beside_its_input():
    from osdp.cost.terms import reduce_scatter_buffer_bytes

    cpu = device_preset("cpu-loopback", 4)
    assert reduce_scatter_buffer_bytes(cpu, 4096, 4) == 4096  # gloo's all-reduce of a copy of the input
    assert reduce_scatter_buffer_bytes(dataclasses.replace(cpu, reduce_scatter="pairwise"), 4096, 4) == 2048
    assert reduce_scatter_buffer_bytes(dataclasses.replace(cpu, reduce_scatter="pairwise"), 4096, 2) == 0
    assert reduce_scatter_buffer_bytes(cpu, 4096, 1) == 0  # a group of one reduces nothing
    assert reduce_scatter_buffer_bytes(device_preset("h100-nvlink", 8), 4096, 8) == 0  # NCCL's own


def test_the_matmul_workspaces_follow_pytorchs_rule_and_environment():
    MiB, KiB = 2**20, 2**10
    assert cublas_workspace_bytes((9, 0), env={}) == 32 * MiB  # Hopper
    assert cublas_workspace_bytes((10, 0), env={}) == 32 * MiB  # Blackwell
    assert cublas_workspace_bytes((8, 0), env={}) == 8 * MiB + 128 * KiB  # ":4096:2:16:8"
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * KiB  # deterministic runs
    assert cublas_workspace_bytes((8, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublaslt_workspace_bytes({}) == MiB
    assert cublaslt_workspace_bytes({"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    # two handles, the forward's thread and autograd's: 66 MiB, what an H200 held before each plan's model
    assert training_workspace_bytes((9, 0), env={}) == 66 * MiB
    assert device_preset("h100-nvlink", 8).workspace_bytes == 66 * MiB
    assert device_preset("h100-nvlink-ndr400", 16).workspace_bytes == 66 * MiB
    assert device_preset("a100-80gb-nvlink", 8).workspace_bytes == 2 * (8 * MiB + 128 * KiB + MiB)
    assert device_preset("cpu-loopback", 2).workspace_bytes == 0
    h100 = device_preset("h100-nvlink", 8)
    assert DeviceInfo.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100
    assert "workspace_bytes" not in device_preset("cpu-loopback", 2).to_dict()  # CPU records stay as they were


def test_device_info_validates():
    ring = CollectiveModel.zero()
    assert DeviceInfo("x", "1GiB", 1, "cpu", ring).memory_bytes == 2**30
    with pytest.raises(ValueError, match="collective model is for 1 ranks, device for 2"):
        DeviceInfo("x", 2**30, 2, "cpu", ring)
    with pytest.raises(ValueError, match="device_type"):
        DeviceInfo("x", 2**30, 1, "tpu", ring)
    with pytest.raises(ValueError, match="workspace_bytes must be a non-negative integer, got -1"):
        DeviceInfo("x", 2**30, 1, "cuda", ring, workspace_bytes=-1)


# ----------------------------------------------------------------------------- nodes x ranks per node


def test_multi_node_presets_price_each_level_on_its_links():
    """8 nodes x 8: the node's NVLink figures inside, the NICs shared by the node's ranks across, and the world
    ring at the node's whole NIC bandwidth (capped by NVLink), its latency the node's plus the network's."""
    assert multi_node_presets() == ["a100-nvlink-hdr200", "h100-nvlink-100gbe", "h100-nvlink-ndr400"]
    d = device_preset("h100-nvlink-ndr400", 64)
    t = d.topology
    assert (t.nodes, t.ranks_per_node, d.nodes) == (8, 8, 8)
    assert t.intra == CollectiveModel.ring(8, {"all_gather": 360e9, "reduce_scatter": 360e9, "all_reduce": 470e9},
                                           dict.fromkeys(COLLECTIVES, 20e-6), "preset h100-nvlink-ndr400")
    assert t.inter.world_size == 8 and t.inter.bus_bandwidth("all_reduce") == pytest.approx(8 * 46e9 / 8)
    assert t.inter.time("all_reduce", 2**30) == pytest.approx(50e-6 + 2**30 * 2 * 7 / 8 / 46e9)
    assert d.collectives.world_size == 64
    assert d.collectives.bus_bandwidth("all_gather") == pytest.approx(360e9)  # NVLink, below 8 x 46 GB/s of NICs
    assert d.collectives.bus_bandwidth("all_reduce") == pytest.approx(368e9)  # the NICs, below NVLS's 470 GB/s
    assert d.collectives.time("all_gather", 0) == pytest.approx(70e-6)
    # NVIDIA's measured 192 GB/s all-reduce on DGX A100 nodes with 8x HDR is what the derivation gives
    assert device_preset("a100-nvlink-hdr200", 16).collectives.bus_bandwidth("all_reduce") == pytest.approx(192e9)
    eth = device_preset("h100-nvlink-100gbe", 32)  # one NIC per node, shared by the node's 8 cross-node groups
    assert eth.topology.nodes == 4 and eth.collectives.bus_bandwidth("all_gather") == pytest.approx(7.5e9)
    assert eth.topology.inter.bus_bandwidth("all_reduce") == pytest.approx(7.5e9 / 8)
    # other layouts: 4 nodes of 4; one node is the node preset alone, with no topology
    four = device_preset("h100-nvlink-ndr400", 16, ranks_per_node=4).topology
    assert (four.nodes, four.ranks_per_node) == (4, 4)
    assert four.inter.bus_bandwidth("all_gather") == pytest.approx(8 * 46e9 / 4)
    one = device_preset("h100-nvlink-ndr400", 8)
    assert one.topology is None and one.nodes == 1
    assert one.collectives.costs == device_preset("h100-nvlink", 8).collectives.costs


@pytest.mark.parametrize("args, kwargs, message", [
    (("h100-nvlink-ndr400", 12), {}, "12 ranks are not whole nodes of 8 ranks; give a multiple of 8 \\(e.g. 16\\)"),
    (("h100-nvlink-ndr400", 64), {"ranks_per_node": 16}, "has 8 GPUs per node: ranks_per_node must be 1 to 8, got 16"),
    (("h100-nvlink-ndr400", 64), {"ranks_per_node": 0}, "ranks_per_node must be 1 to 8, got 0"),
    (("h100-nvlink", 8), {"ranks_per_node": 8}, "describes one level of links.*multi-node presets \\(a100-nvlink"),
    (("h100-nvlink", 16), {}, "at most 8 ranks.*multi-node preset \\(a100-nvlink-hdr200, h100-nvlink-100gbe"),
    (("h100-nvlink-ndr400", 0), {}, "world_size must be >= 1"),
])
def test_preset_layouts_that_cannot_be_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        device_preset(*args, **kwargs)


def test_topology_round_trips_and_descriptions_without_one_still_load():
    d = device_preset("a100-nvlink-hdr200", 32, memory="40GiB")
    raw = json.loads(json.dumps(d.to_dict()))
    assert raw["topology"]["nodes"] == 4 and raw["topology"]["intra"]["world_size"] == 8
    assert DeviceInfo.from_dict(raw) == d
    # one level: no key written, and a cached description from before topologies reads as one level
    flat = device_preset("h100-nvlink", 8)
    assert "topology" not in flat.to_dict()
    assert DeviceInfo.from_dict(flat.to_dict()) == flat and DeviceInfo.from_dict(flat.to_dict()).topology is None
    assert DeviceInfo.from_dict({**flat.to_dict(), "topology": None}).topology is None
    with pytest.raises(ValueError, match="topology is missing \\['inter'\\]"):
        DeviceInfo.from_dict({**raw, "topology": {k: v for k, v in raw["topology"].items() if k != "inter"}})


def test_topology_validates():
    two, four = CollectiveModel.ring(2, dict.fromkeys(COLLECTIVES, 1e9), dict.fromkeys(COLLECTIVES, 1e-5)), \
        CollectiveModel.ring(4, dict.fromkeys(COLLECTIVES, 1e9), dict.fromkeys(COLLECTIVES, 1e-5))
    t = Topology(2, 2, two, two)
    assert t.world_size == 4 and Topology.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="intra-node model is for 4 ranks, but a node holds 2"):
        Topology(2, 2, four, two)
    with pytest.raises(ValueError, match="inter-node model is for 4 ranks, but there are 2 nodes"):
        Topology(2, 2, two, four)
    with pytest.raises(ValueError, match="nodes must be a positive integer, got 0"):
        Topology(0, 2, two, CollectiveModel.zero())
    with pytest.raises(ValueError, match="topology of 2 nodes x 2 ranks is 4 ranks, device for 8"):
        DeviceInfo("x", 2**30, 8, "cpu", CollectiveModel.ring(8, dict.fromkeys(COLLECTIVES, 1e9),
                                                               dict.fromkeys(COLLECTIVES, 1e-5)), topology=t)


def _measure_two_nodes(rank, world_size):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it on each of 2 nodes
    d = measure_device(dtypes=(torch.float32,), time_budget_s=0.2, sizes=(4096, 1 << 20))
    return d.to_dict()


def test_measure_device_on_two_nodes_of_two_gloo_ranks_measures_each_level():
    results = run_ranks(_measure_two_nodes, 4, timeout=180)
    assert all(r == results[0] for r in results), "ranks must plan from the identical description"
    d = DeviceInfo.from_dict(results[0])
    t = d.topology
    assert (d.world_size, t.nodes, t.ranks_per_node) == (4, 2, 2)
    assert (t.intra.world_size, t.inter.world_size, d.collectives.world_size) == (2, 2, 4)
    assert t.intra.source.startswith("measured gloo cpu 2 ranks") and t.intra.source.endswith("slowest of 2 groups")
    for model in (t.intra, t.inter, d.collectives):
        for c in COLLECTIVES:
            assert 0 < model.time(c, 4096) <= model.time(c, 1 << 20) < 1.0
            assert [n for n, _ in model.samples[c]] == [4096, 1 << 20]
