"""Bounds on every planner input, in one place.

Each bound sits far above any real cluster or model, so it never refuses a real input; it exists
so that a file of a few KB cannot make a command expand millions of nodes, parse without end or
overflow to infinity. Inputs are checked against these before anything is expanded per node or
per GPU (planner/cluster.py, models.py, plan.py, inputs.py, units.py, cli.py).
"""

# --- files -------------------------------------------------------------------------------------
# Cluster and model files are hand-written YAML of a few KB. The largest real one is a cluster at
# MAX_NODES machines with a host name each (one `count` group with a `hostnames` list): 65,536
# YAML nodes and ~2.5 MB with 30-character host names. PyYAML (pure Python, needed for the strict
# loader below) composes only ~30-50k nodes/s and scans ~1-2 MB/s of plain text, so both the node
# count and the bytes are bounded: the worst file within both limits (a flat list of MAX_YAML_NODES
# empty lists, or one 4 MiB comment or string) parses in a few seconds and well under 400 MB
# (measured: docs/planner.md, "Input limits").
MAX_YAML_FILE_BYTES = 4 * 2**20
# A plan (or pipelines / profile JSON) is machine-written. The largest per-rank shape, one
# pipeline per rank written by save_plan (indent=1), measured 262 bytes per rank; at MAX_GPUS
# ranks that is 68 MB, validated in ~10 s with ~470 MB resident. The limit is derived from
# MAX_GPUS with ~20% margin, so every plan the planner can write is readable and no JSON file
# can cost much more than that plan. (At 2**20 ranks the same plan is 275 MB, 40+ s and ~2 GB:
# hence MAX_GPUS below.)
JSON_BYTES_PER_RANK = 320
# Plans nest 6 levels (pipelines[].stages[].shards.ffn[]), cluster files 4, profiles ~5.
MAX_NESTING = 32
# Integer literals longer than this are refused before Python converts them (conversion time
# grows quadratically, and Python 3.10.0-3.10.6 has no 4,300-digit limit of its own); every
# bounded count has far fewer digits. Also bounds float literals and `--flag` integers.
MAX_NUMBER_CHARS = 100
# A number with a unit ("25 Gbit/s", "50 us", "80 GiB") is at most this long.
MAX_UNIT_TEXT_CHARS = 64
# Values quoted in error lines are cut to this many characters.
MAX_SHOWN_CHARS = 80
# Error output: at most this many problem lines, then one line "... and N more problems".
MAX_REPORTED_PROBLEMS = 20

# --- clusters ----------------------------------------------------------------------------------
# The largest single training jobs today span ~16k-100k GPUs (clusters of up to ~200k GPUs);
# 2**18 is above all of them. It also bounds plans: see JSON_BYTES_PER_RANK above.
MAX_GPUS = 2**18
MAX_JSON_FILE_BYTES = MAX_GPUS * JSON_BYTES_PER_RANK  # 80 MiB
# ~25k machines in those clusters (8 GPUs each); 2**16 is 2.6x that. Bounds the per-node expansion
# of `count` in planner/cluster.py, and the YAML node count (MAX_YAML_NODES) a host list needs.
MAX_NODES = 2**16
MAX_YAML_NODES = MAX_NODES + 2**12  # the MAX_NODES host list plus the rest of the file
# A machine or NVLink domain: 8-16 GPUs per server, 72 (NVL72) to 576 (NVL576) per NVLink domain.
MAX_GPUS_PER_NODE = 1024
# Link overrides in a cluster file: one per pair of machine groups or machines that differ from
# the NIC default; real files list a handful. Bounds the per-pair lookup table.
MAX_LINKS = 4096
# Bandwidths in bytes/s: 1 kB/s is far below any network, 1 PB/s 1000x NVLink 5 (900 GB/s per
# direction). The lower bound keeps transfer times finite.
MIN_BANDWIDTH = 1e3
MAX_BANDWIDTH = 1e15
# Latencies in seconds: 0 (unmeasurable) up to an hour; real links are 1 us - 1 ms.
MAX_LATENCY_S = 3600.0

# --- models ------------------------------------------------------------------------------------
# Largest published dense models: ~126-160 layers, hidden ~25k, FFN ~100k, 128 heads, vocabulary
# ~256k, context ~10M tokens. Each bound is 10x-100x that.
MAX_LAYERS = 4096
MAX_HIDDEN = 2**20  # hidden_size and kv_channels
MAX_FFN_HIDDEN = 2**22
MAX_HEADS = 2**16  # num_attention_heads (num_query_groups divides it)
MAX_VOCAB = 2**24
MAX_SEQ_LENGTH = 2**27
# RoPE base: 1e4 (Llama 2) to 5e5-1e7 for long context.
MAX_ROTARY_BASE = 2**40
# Llama 3.2 uses 32; a larger factor is no longer a scaling anyone trains with.
MAX_ROPE_SCALING_FACTOR = 1024.0
# norm_epsilon is ~1e-6..1e-5 and init_method_std ~0.006..0.02 in real models.
MAX_NORM_EPSILON = 1.0
MAX_INIT_METHOD_STD = 1.0

MODEL_INT_BOUNDS = {
    "num_layers": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN,
    "ffn_hidden_size": MAX_FFN_HIDDEN,
    "num_attention_heads": MAX_HEADS,
    "num_query_groups": MAX_HEADS,
    "vocab_size": MAX_VOCAB,
    "seq_length": MAX_SEQ_LENGTH,
}

# --- training ----------------------------------------------------------------------------------
# Samples per global batch (and per micro-batch, micro-batches per pipeline): real runs use
# 10^2-10^4 sequences per step; 2**24 is 1000x that.
MAX_BATCH = 2**24
# --seed of the search: METIS (pymetis.Options) takes it as a C int.
MAX_SEED = 2**31 - 1
