"""Install megatron_lorafusion: `pip install -e ".[dev]"` (see README.md)."""

from setuptools import find_packages, setup

setup(
    name="megatron_lorafusion",
    version="0.1.0",
    description="Fine-tune many LoRA adapters at once on one frozen Megatron-Core model.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_lorafusion", "megatron_lorafusion.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "triton>=3.6",
        "pulp[highs]>=4.2",
        "datasets>=3.0",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "numpy>=1.26",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "tensorboard>=2.16",  # metrics: torch.utils.tensorboard.SummaryWriter
    ],
    extras_require={
        "dev": [
            "pytest>=8.0",
            "hypothesis>=6.100",
            "transformers>=4.45",
            "peft>=0.13",
            "ruff==0.17.6",
        ],
    },
    entry_points={"console_scripts": ["lorafusion=megatron_lorafusion.cli:main"]},
)
