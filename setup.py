"""megatron-hexi: train one LLM across a cluster of different GPUs, on megatron-core."""

from setuptools import setup

setup(
    name="megatron-hexi",
    version="0.1.0",
    description="Heterogeneous-GPU training on megatron-core: planner, plan format and runtime",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=[
        "planner",
        "megatron_hexi",
        "megatron_hexi.patches",
        "megatron_hexi.launch",
        "megatron_hexi.cluster_tools",
        "megatron_hexi.profile",
    ],
    package_dir={"megatron_hexi.patches": "patches"},
    package_data={"planner": ["data/*.yaml", "data/*.json"]},
    py_modules=[],
    # Ranges, so that `pip install -e .` keeps an environment's own (CUDA) torch and numpy. The
    # exact versions tested on CPU are in tools/constraints-cpu.txt (tools/setup_env.sh uses it).
    install_requires=[
        "torch>=2.6",  # megatron-core 0.16.1's own floor
        "megatron-core==0.16.1",  # the version every module in patches/ was checked against
        "einops>=0.8,<0.9",  # megatron-core's HyperCommGrid needs it
        "pymetis>=2023.1",  # planner phase 1 (wheels for CPython 3.10-3.12)
        "networkx>=3.2,<4",
        "numpy>=1.26,<3",
        "pyyaml>=6.0,<7",
        "packaging>=24.2",  # megatron-core's floor
        "safetensors>=0.4.3,<1",  # checkpoints (megatron_hexi/checkpoint/)
        "tokenizers>=0.21,<1",  # HuggingFace and GPT-2 BPE tokenizers (--data-path)
        "tiktoken>=0.7,<1",  # --tokenizer-type TikTokenizer
        "psutil>=5.9",  # megatron-core dist_checkpointing's writer (hexi-convert export-megatron)
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.6,<4",  # tools/test.sh runs the suite on two workers
            "jsonschema>=4.18,<5",
            "matplotlib>=3.8,<4",
            "sentencepiece>=0.2.1,<0.3",
            # HF Llama import/export tests; transformers needs no torch of its own, so the
            # environment's torch stays.
            "transformers>=5.0,<6",
            "tensorboard>=2.15,<3",
            "wandb>=0.31,<0.32",  # --wandb-project, tested offline
            # Lint, format and type checks (tools/test.sh); config in pyproject.toml.
            "ruff>=0.17,<0.18",
            "mypy>=2.4,<2.5",
            "types-PyYAML>=6.0.12,<7",
        ],
        "tensorboard": ["tensorboard>=2.15,<3"],
        "wandb": ["wandb>=0.31,<0.32"],
        # --tokenizer-type SentencePieceTokenizer (Llama-style tokenizer.model)
        "sentencepiece": ["sentencepiece>=0.2.1,<0.3"],
        "plot": ["matplotlib>=3.8,<4"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": [
            "hexi-plan=planner.cli:main",
            "hexi-train=megatron_hexi.entry:cli",
            "hexi-launch=megatron_hexi.launch.cli:main",
            "hexi-cluster=megatron_hexi.cluster_tools.cli:cli",
            "hexi-profile=megatron_hexi.profile.cli:cli",
            "hexi-convert=megatron_hexi.convert.cli:cli",
        ]
    },
)
