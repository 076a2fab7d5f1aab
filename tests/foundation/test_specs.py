"""Units, cluster specs (expansion, links, overrides) and the GPU and model catalogs."""

import pytest

from planner.catalog import get_gpu, gpu_catalog, match_device_name
from planner.cluster import (
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    load_cluster,
    load_cluster_dict,
)
from planner.errors import ClusterError, ModelSpecError, SpecError
from planner.models import load_model, model_catalog, model_from_dict
from planner.units import (
    LINK_PRESETS,
    format_bandwidth,
    format_latency,
    parse_bandwidth,
    parse_latency,
    parse_size,
)


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        ("25 Gbit/s", 25e9 / 8),
        ("100 Gbit/s", 12.5e9),
        ("10Gbit/s", 1.25e9),
        ("16 GB/s", 16e9),
        ("1.5 TB/s", 1.5e12),
        ("400 Mbit/s", 50e6),
        ("200 MB/s", 200e6),
        ("10 Gbps", 1.25e9),
        ("1e2 GB/s", 100e9),
        ("nvlink", 300e9),
        ("NVLink", 300e9),
        (" nvlink4 ", 450e9),
        ("pcie4", 25e9),
        ("pcie5", 50e9),
        ("host", 12e9),
    ],
)
def test_bandwidth(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    "value, message",
    [
        ("10 Gb/s", "'Gb/s' is ambiguous; write Gbit/s or GB/s"),
        ("10 gb/s", "ambiguous"),
        ("5 Mb/s", "ambiguous"),
        ("8 b/s", "ambiguous"),
        ("fast", "cannot read 'fast'"),
        ("10 Gbit/h", "unknown bandwidth unit 'Gbit/h'"),
        ("0 GB/s", "must be positive"),
        ("-5 GB/s", "cannot read"),
        (16, "has no unit"),
        (True, "has no unit"),
        (None, "has no unit"),
    ],
)
def test_bad_bandwidth(value, message):
    with pytest.raises(SpecError) as info:
        parse_bandwidth(value, "nodes[0] (x).nic")
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("nodes[0] (x).nic: ") and message in str(info.value)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("50 us", 50e-6),
        ("50us", 50e-6),
        ("50 µs", 50e-6),
        ("1.5 ms", 1.5e-3),
        ("0 s", 0.0),
        ("2 s", 2.0),
        ("100 ns", 100e-9),
    ],
)
def test_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["50", 50, "50 parsecs", "fast"])
def test_bad_latency(value):
    with pytest.raises(SpecError, match="^links.0..latency: "):
        parse_latency(value, "links[0].latency")


def test_sizes_and_formats():
    assert parse_size("80 GiB") == 80 * 2**30
    assert parse_size("24 GB") == 24e9
    assert parse_size(1000) == 1000.0
    with pytest.raises(SpecError, match="unknown size unit"):
        parse_size("3 bananas")
    for bw in (3.125e9, 1.25e9, 300e9, 16e9, 12.5e9):
        assert parse_bandwidth(format_bandwidth(bw)) == pytest.approx(bw)
    assert format_bandwidth(3.125e9) == "3.125 GB/s"
    assert format_latency(30e-6) == "30 us"
    assert parse_latency(format_latency(5e-5)) == pytest.approx(5e-5)
    assert LINK_PRESETS["nvlink"] == LINK_PRESETS["nvlink3"]


def test_cluster_expansion(examples_dir):
    c = load_cluster(examples_dir / "clusters" / "mixed-lab.yaml")
    assert c.name == "mixed-lab"
    assert [n.name for n in c.nodes] == [
        "a100-0",
        "rtx4090-0",
        "rtx4090-1",
        "rtx4090-2",
        "rtx3090-0",
    ]
    assert [n.group for n in c.nodes] == ["a100", "rtx4090", "rtx4090", "rtx4090", "rtx3090"]
    assert c.num_gpus == 8 + 3 * 8 + 4 == 36
    slots = c.gpu_slots()
    assert slots[0] == ("a100-0", 0, "A100-SXM-80GB") and slots[8] == ("rtx4090-0", 0, "RTX-4090")
    assert slots[31] == ("rtx4090-2", 7, "RTX-4090")
    assert slots[35] == ("rtx3090-0", 3, "RTX-3090")
    n = c.node("rtx3090-0")
    assert (n.intra_node_bw, n.nic_bw) == (16e9, 1.25e9)
    assert n.nic_latency == DEFAULT_INTER_NODE_LATENCY_S
    with pytest.raises(SpecError, match="has no node 'rtx4090'"):
        c.node("rtx4090")  # a group name is not a node name once expanded
    mini = load_cluster(examples_dir / "clusters" / "mini-hetero.yaml")
    assert [n.name for n in mini.nodes] == ["a100", "rtx4090", "rtx3090"]  # no count: no suffix
    assert mini.num_gpus == 4


def test_links_and_overrides(examples_dir):
    c = load_cluster(examples_dir / "clusters" / "mixed-lab.yaml")
    # inside a machine: its interconnect
    assert c.link("a100-0", "a100-0") == pytest.approx((300e9, DEFAULT_INTRA_NODE_LATENCY_S))
    assert c.link("rtx4090-1", "rtx4090-1") == pytest.approx((12e9, DEFAULT_INTRA_NODE_LATENCY_S))
    # between machines: the slower NIC, the larger latency
    inter = DEFAULT_INTER_NODE_LATENCY_S
    assert c.link("rtx4090-0", "rtx4090-2") == pytest.approx((25e9 / 8, inter))
    assert c.link("rtx4090-0", "rtx3090-0") == pytest.approx((10e9 / 8, inter))
    assert c.link("a100-0", "rtx3090-0") == pytest.approx((10e9 / 8, inter))
    # the measured group-to-group override, both directions, every node of the group
    for b in ("rtx4090-0", "rtx4090-1", "rtx4090-2"):
        assert c.link("a100-0", b) == pytest.approx((10e9 / 8, 50e-6))
        assert c.link(b, "a100-0") == pytest.approx((10e9 / 8, 50e-6))


def test_override_precedence():
    c = load_cluster_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "a",
                    "gpu": "A100-SXM-80GB",
                    "gpus_per_node": 8,
                    "count": 2,
                    "intra_node": "nvlink",
                    "nic": "200 Gbit/s",
                    "nic_latency": "10 us",
                },
                {
                    "name": "b",
                    "gpu": "rtx-4090",
                    "gpus_per_node": 4,
                    "count": 2,
                    "intra_node": "pcie4",
                    "nic": "25 Gbit/s",
                    "hostnames": ["h0", "h1"],
                },
            ],
            "links": [
                {"between": ["a", "b"], "bandwidth": "10 Gbit/s"},
                {"between": ["b-1", "a-0"], "bandwidth": "1 GB/s", "latency": "1 ms"},
            ],
        }
    )
    assert c.groups[1].gpu == "RTX-4090"  # catalog names are case-blind
    assert [n.hostname for n in c.nodes] == [None, None, "h0", "h1"]
    inter = DEFAULT_INTER_NODE_LATENCY_S
    assert c.link("a-0", "b-1") == pytest.approx((1e9, 1e-3))  # later, node-level override
    assert c.link("a-0", "b-0") == pytest.approx((1.25e9, inter))  # group override, latency the
    assert c.link("a-1", "b-0") == pytest.approx((1.25e9, inter))  # larger NIC latency
    assert c.link("a-0", "a-1") == pytest.approx((25e9, 10e-6))  # no override: NIC, latency
    assert c.link("b-0", "b-0") == pytest.approx((25e9, DEFAULT_INTRA_NODE_LATENCY_S))
    again = load_cluster_dict(c.to_dict())
    for n, m in zip(again.nodes, c.nodes, strict=True):
        assert (n.name, n.group, n.gpu, n.gpus_per_node, n.hostname) == (
            m.name,
            m.group,
            m.gpu,
            m.gpus_per_node,
            m.hostname,
        )
        assert (n.intra_node_bw, n.nic_bw, n.nic_latency) == pytest.approx(
            (m.intra_node_bw, m.nic_bw, m.nic_latency)
        )
    assert [lk.between for lk in again.links] == [("a", "b"), ("b-1", "a-0")]
    assert again.link("a-0", "b-1") == pytest.approx(c.link("a-0", "b-1"))


def test_cluster_errors_list_every_problem():
    with pytest.raises(ClusterError) as info:
        load_cluster_dict(
            {
                "name": "t",
                "nodes": [
                    {
                        "name": "a",
                        "gpu": "A100",
                        "gpus_per_node": 8,
                        "intra_node": "nvlink",
                        "nic": "1",
                    },
                    {
                        "name": "b",
                        "gpu": "T4",
                        "gpus_per_node": 0,
                        "intra_node": "x",
                        "nic": "1 GB/s",
                    },
                ],
            }
        )
    assert info.value.problems == [
        "nodes[0] (a).gpu: unknown GPU type 'A100'; known: " + ", ".join(gpu_catalog()),
        "nodes[0] (a).nic: cannot read '1': expected a number with a unit",
        "nodes[1] (b).gpus_per_node: must be a positive integer, got 0",
        "nodes[1] (b).intra_node: cannot read 'x': expected a number with a unit",
    ]


def test_gpu_catalog():
    cat = gpu_catalog()
    assert {"A100-SXM-80GB", "RTX-4090", "RTX-3090", "RTX-3080-Ti", "CPU"} <= set(cat)
    for gpu in cat.values():
        assert gpu.source.strip(), gpu.name
        assert gpu.tflops > 0 and gpu.memory_gb > 0 and gpu.mem_bw_gbs > 0
    assert get_gpu("rtx-4090") is cat["RTX-4090"]
    assert cat["A100-SXM-80GB"].memory_bytes == 80e9
    assert cat["A100-SXM-80GB"].peak_flops == cat["A100-SXM-80GB"].tflops * 1e12
    assert match_device_name("no such device") is None
    with pytest.raises(SpecError, match="^gpu: unknown GPU type 'RTX-9090'; known: "):
        get_gpu("RTX-9090")


def test_model_catalog_published_dims():
    m = model_catalog()
    l7, l13, l70, l3 = m["llama2-7b"], m["llama2-13b"], m["llama2-70b"], m["llama3-8b"]
    assert (
        l7.num_layers,
        l7.hidden_size,
        l7.ffn_hidden_size,
        l7.num_attention_heads,
        l7.num_query_groups,
        l7.vocab_size,
    ) == (32, 4096, 11008, 32, 32, 32000)
    assert (
        l13.num_layers,
        l13.hidden_size,
        l13.ffn_hidden_size,
        l13.num_attention_heads,
        l13.num_query_groups,
    ) == (40, 5120, 13824, 40, 40)
    assert (
        l70.num_layers,
        l70.hidden_size,
        l70.ffn_hidden_size,
        l70.num_attention_heads,
        l70.num_query_groups,
    ) == (80, 8192, 28672, 64, 8)
    assert (l70.heads_per_group, l70.head_dim, l70.ffn_width) == (8, 128, 2 * 28672)
    assert (l3.num_query_groups, l3.vocab_size, l3.rotary_base, l3.ffn_hidden_size) == (
        8,
        128256,
        500000,
        14336,
    )
    assert m["tiny-gqa"].heads_per_group == 2 and m["tiny-gqa"].head_dim == 8
    assert m["tiny-tied"].untie_embeddings_and_output_weights is False
    assert all(
        s.swiglu and s.normalization == "RMSNorm" and not s.add_bias_linear for s in m.values()
    )
    assert load_model("llama2-13b") is l13 and l13.name == "llama2-13b"


def test_model_files_and_errors(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text(
        "num_layers: 2\nhidden_size: 48\nffn_hidden_size: 96\n"
        "num_attention_heads: 6\nnum_query_groups: 3\nvocab_size: 50\n"
        "seq_length: 16\nkv_channels: 16\n"
    )
    m = load_model(str(spec))
    assert (m.head_dim, m.heads_per_group, m.kv_channels) == (16, 2, 16)
    assert model_from_dict(m.to_dict()) == m
    with pytest.raises(SpecError, match="neither a catalog model"):
        load_model("gpt-7")
    bad = {
        "num_layers": 2,
        "hidden_size": 60,
        "ffn_hidden_size": 96,
        "num_attention_heads": 4,
        "num_query_groups": 3,
        "vocab_size": 50,
        "seq_length": 0,
        "moe": 1,
    }
    with pytest.raises(ModelSpecError) as info:
        model_from_dict(bad)
    assert info.value.problems == [
        "model.moe: unknown field",
        "model.seq_length: must be a positive integer, got 0",
    ]
    del bad["moe"]
    bad["seq_length"] = 16
    with pytest.raises(ModelSpecError) as info:
        model_from_dict(bad)
    assert info.value.problems == [
        "model.num_query_groups: 3 does not divide num_attention_heads 4",
        "model.kv_channels: rotary embeddings need an even head size, got 15",
    ]


def test_model_family_fields_are_checked():
    """Position embeddings, RoPE scaling and q/k/v biases: each bad value is one line."""
    good = {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "vocab_size": 50,
        "seq_length": 16,
    }
    bad = {
        **good,
        "position_embedding_type": "alibi",
        "rope_scaling": "yes",
        "rope_scaling_factor": 0.5,
        "add_qkv_bias": 1,
    }
    with pytest.raises(ModelSpecError) as info:
        model_from_dict(bad)
    assert info.value.problems == [
        "model.add_qkv_bias: must be true or false, got 1",
        "model.rope_scaling: must be true or false, got 'yes'",
        "model.position_embedding_type: must be rope or learned_absolute",
        "model.rope_scaling_factor: must be a number in [1, 1024], got 0.5",
    ]
    learned = {**good, "position_embedding_type": "learned_absolute", "rope_scaling": True}
    with pytest.raises(ModelSpecError) as info:
        model_from_dict(learned)
    assert info.value.problems == ["model.rope_scaling: needs position_embedding_type rope"]
    del learned["rope_scaling"]
    with pytest.raises(ModelSpecError) as info:
        model_from_dict({**learned, "max_position_embeddings": 8})
    assert info.value.problems == ["model.max_position_embeddings: 8 is below seq_length 16"]
    # an odd head size is fine without rotary embeddings; the table defaults to the sequence
    spec = model_from_dict({**learned, "kv_channels": 15})
    assert (spec.head_dim, spec.position_rows, spec.qkv_bias) == (15, 16, False)
    assert model_from_dict({**good, "add_qkv_bias": True}).qkv_bias
    assert model_from_dict(good).position_rows == 0
