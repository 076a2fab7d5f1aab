"""Bounds on every planner input, in one place.

Each bound sits far above any real cluster or model, so it never refuses a real input; it exists
so that a file of a few KB cannot make a command expand millions of nodes, parse without end or
overflow to infinity. Inputs are checked against these before anything is expanded per node or
per GPU (planner/cluster.py, models.py, plan.py, inputs.py, units.py, cli.py).
"""

# --- files -------------------------------------------------------------------------------------
# Cluster and model files are hand-written YAML of a few KB; a cluster of MAX_NODES machines with
# a host name each is about 3 MB. PyYAML parses about 1 MB/s, so this also bounds parse time.
MAX_YAML_FILE_BYTES = 8 * 2**20
# A plan (or pipelines / profile JSON) for MAX_GPUS ranks, as save_plan writes it, is about
# 110 MB; the largest clusters built today (~200k GPUs) give ~25 MB.
MAX_JSON_FILE_BYTES = 256 * 2**20
# Plans nest 6 levels (pipelines[].stages[].shards.ffn[]), cluster files 4, profiles ~5.
MAX_NESTING = 32
# Integer literals longer than this are refused before Python converts them (its own limit is
# 4300 digits, and conversion time grows quadratically); every bounded count has far fewer.
MAX_NUMBER_CHARS = 100

# --- clusters ----------------------------------------------------------------------------------
# Largest GPU clusters built today hold ~100k-200k GPUs; 2**20 is 5x that.
MAX_GPUS = 2**20
# ~25k machines in those clusters (8 GPUs each); 2**17 is 5x that. Bounds the per-node expansion
# of `count` in planner/cluster.py.
MAX_NODES = 2**17
# A machine or NVLink domain: 8-16 GPUs per server, 72 (NVL72) to 576 (NVL576) per NVLink domain.
MAX_GPUS_PER_NODE = 1024
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
MAX_HIDDEN = 2**20              # hidden_size and kv_channels
MAX_FFN_HIDDEN = 2**22
MAX_HEADS = 2**16               # num_attention_heads (num_query_groups divides it)
MAX_VOCAB = 2**24
MAX_SEQ_LENGTH = 2**27
# RoPE base: 1e4 (Llama 2) to 5e5-1e7 for long context.
MAX_ROTARY_BASE = 2**40
# norm_epsilon is ~1e-6..1e-5 and init_method_std ~0.006..0.02 in real models.
MAX_NORM_EPSILON = 1.0
MAX_INIT_METHOD_STD = 1.0

MODEL_INT_BOUNDS = {"num_layers": MAX_LAYERS, "hidden_size": MAX_HIDDEN,
                    "ffn_hidden_size": MAX_FFN_HIDDEN, "num_attention_heads": MAX_HEADS,
                    "num_query_groups": MAX_HEADS, "vocab_size": MAX_VOCAB,
                    "seq_length": MAX_SEQ_LENGTH}

# --- training ----------------------------------------------------------------------------------
# Samples per global batch (and per micro-batch, micro-batches per pipeline): real runs use
# 10^2-10^4 sequences per step; 2**24 is 1000x that.
MAX_BATCH = 2**24
# --seed of the search: METIS (pymetis.Options) takes it as a C int.
MAX_SEED = 2**31 - 1
