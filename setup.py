"""megatron-hexi: train one LLM across a cluster of different GPUs, on megatron-core."""
from setuptools import setup

setup(
    name="megatron-hexi",
    version="0.1.0",
    description="Heterogeneous-GPU training on megatron-core: planner, plan format and runtime",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.12",
    packages=["planner", "megatron_hexi", "megatron_hexi.patches", "megatron_hexi.launch",
              "megatron_hexi.cluster_tools", "megatron_hexi.profile"],
    package_dir={"megatron_hexi.patches": "patches"},
    package_data={"planner": ["data/*.yaml", "data/*.json"]},
    py_modules=[],
    install_requires=[
        # torch is pinned: an open range pulls a multi-GB CUDA build where 2.13.0 is not cached.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "einops==0.8.2",          # megatron-core's HyperCommGrid needs it
        "pymetis==2025.2.2",
        "networkx==3.6.1",
        "numpy==2.4.6",
        "pyyaml==6.0.4",
        "packaging==26.4",
        "safetensors==0.8.0",     # checkpoints (megatron_hexi/checkpoint.py)
    ],
    extras_require={
        "test": ["pytest==9.2.0", "jsonschema==4.26.0", "matplotlib==3.11.2",
                 "tokenizers==0.23.3", "safetensors==0.8.0",
                 # HF Llama import/export tests; transformers needs no torch of its own, so the
                 # pinned CPU torch stays.
                 "transformers==5.24.0", "tensorboard==2.21.0"],
        "tensorboard": ["tensorboard==2.21.0"],
        "plot": ["matplotlib==3.11.2"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": [
        "hexi-plan=planner.cli:main",
        "hexi-train=megatron_hexi.training:cli",
        "hexi-launch=megatron_hexi.launch.cli:main",
        "hexi-cluster=megatron_hexi.cluster_tools.cli:cli",
        "hexi-profile=megatron_hexi.profile.cli:cli",
    ]},
)
