"""The heterogeneous plans the runtime tests train, each against the one-rank plan."""

from planner.cluster import load_cluster_dict
from planner.models import load_model
from planner.plan import build_plan, save_plan

GLOBAL_BATCH = 8
# A run that learns the same under any plan: mock data, a constant lr, no dropout.
EXACT_FLAGS = [
    "--mock-data",
    "--lr",
    "1e-3",
    "--lr-decay-style",
    "constant",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def cpu_cluster(world):
    return load_cluster_dict(
        {
            "name": f"cpu-{world}",
            "nodes": [
                {
                    "name": "cpu",
                    "gpu": "CPU",
                    "gpus_per_node": world,
                    "intra_node": "host",
                    "nic": "10 Gbit/s",
                }
            ],
        }
    )


def one_stage(world, stage_ranks=None):
    return {"ranks": stage_ranks or [0], "layers": [0, 4]}


PLANS = {
    # Two pipelines with different stage counts; a TP=2 stage with uneven shards (3:1 query
    # groups, uneven FFN and vocabulary) before a TP=1 stage; different micro-batch sizes/counts.
    "two_pipelines_uneven_tp2": (
        "tiny",
        4,
        [
            {
                "micro_batch_size": 1,
                "num_microbatches": 6,
                "stages": [
                    {
                        "ranks": [0, 1],
                        "layers": [0, 3],
                        "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
                    },
                    {"ranks": [2], "layers": [3, 4]},
                ],
            },
            {
                "micro_batch_size": 2,
                "num_microbatches": 1,
                "stages": [{"ranks": [3], "layers": [0, 4]}],
            },
        ],
    ),
    # TP degrees 1, 2 and 3 in one pipeline, GQA (8 heads in 4 query groups), a first stage that
    # holds only the embedding and one layer, uneven vocabulary shards on the last stage.
    "tp_1_2_3_gqa": (
        "tiny-gqa",
        6,
        [
            {
                "micro_batch_size": 2,
                "num_microbatches": 4,
                "stages": [
                    {"ranks": [0], "layers": [0, 1]},
                    {
                        "ranks": [1, 2],
                        "layers": [1, 3],
                        "shards": {"query_groups": [3, 1], "ffn": [100, 92]},
                    },
                    {
                        "ranks": [3, 4, 5],
                        "layers": [3, 4],
                        "shards": {"query_groups": [2, 1, 1], "vocab": [50, 40, 30]},
                    },
                ],
            }
        ],
    ),
    # A single-stage pipeline beside a three-stage one.
    "single_beside_three_stages": (
        "tiny",
        4,
        [
            {
                "micro_batch_size": 1,
                "num_microbatches": 5,
                "stages": [
                    {"ranks": [0], "layers": [0, 1]},
                    {"ranks": [1], "layers": [1, 3]},
                    {"ranks": [2], "layers": [3, 4]},
                ],
            },
            {
                "micro_batch_size": 3,
                "num_microbatches": 1,
                "stages": [{"ranks": [3], "layers": [0, 4]}],
            },
        ],
    ),
    # Tied embeddings across stages of different TP (and uneven vocabulary shards), beside a
    # single-stage pipeline where one tensor serves both uses.
    "tied_embeddings_across_tp": (
        "tiny-tied",
        4,
        [
            {
                "micro_batch_size": 2,
                "num_microbatches": 3,
                "stages": [
                    {"ranks": [0, 1], "layers": [0, 2], "shards": {"vocab": [80, 48]}},
                    {"ranks": [2], "layers": [2, 4]},
                ],
            },
            {
                "micro_batch_size": 2,
                "num_microbatches": 1,
                "stages": [{"ranks": [3], "layers": [0, 4]}],
            },
        ],
    ),
}

# One pipeline of two one-rank stages (two processes: the cheapest plan with a stage boundary).
TWO_STAGES = [
    {
        "micro_batch_size": 4,
        "num_microbatches": 2,
        "stages": [{"ranks": [0], "layers": [0, 2]}, {"ranks": [1], "layers": [2, 4]}],
    }
]

REFERENCE = [
    {
        "micro_batch_size": GLOBAL_BATCH,
        "num_microbatches": 1,
        "stages": [{"ranks": [0], "layers": [0, 4]}],
    }
]


def write_plan(directory, name, model, world, pipelines, recompute=False, **training):
    """`model`: a bundled model's name, or a ModelSpec."""
    plan = build_plan(
        cpu_cluster(world),
        load_model(model) if isinstance(model, str) else model,
        GLOBAL_BATCH,
        pipelines,
        recompute=recompute,
        **training,
    )
    path = directory / f"{name}.json"
    save_plan(plan, path)
    return path


# Islands (planner.islands): island 0 holds a pipeline with an uneven TP=2 stage before a TP=1
# stage and a single-rank pipeline beside it (its sync runs over both); island 1 is one pipeline
# of two one-rank stages (another shape, other shard boundaries). Islands weigh 6/8 and 2/8.
ISLAND_PIPELINES = [
    {
        "micro_batch_size": 1,
        "num_microbatches": 4,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            },
            {"ranks": [2], "layers": [3, 4]},
        ],
    },
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 4]}]},
    {
        "micro_batch_size": 1,
        "num_microbatches": 2,
        "stages": [{"ranks": [4], "layers": [0, 1]}, {"ranks": [5], "layers": [1, 4]}],
    },
]
ISLANDS = [[0, 1], [2]]
