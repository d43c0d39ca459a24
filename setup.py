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
    # torch and triton: the tested range (CPU CI: torch 2.14 + triton 3.8; GPU runs: torch 2.11 +
    # triton 3.6). 2.11.0a0 admits the NGC 26.02 image's own torch build (2.11.0a0+...nv26.02),
    # which pip must keep (docker/Dockerfile); older torch is untested, not known to break.
    install_requires=[
        "torch>=2.11.0a0,<2.15",
        "megatron-core>=0.19,<0.20",
        "triton>=3.6,<3.9",
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
        # Hugging Face tokenizers: a model.hf_path or data.tokenizer folder (docker/ installs it).
        "hf": ["transformers>=4.45"],
        "dev": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "transformers>=4.45",
            "peft>=0.13",
            "ruff==0.17.6",
        ],
    },
    entry_points={"console_scripts": ["lorafusion=megatron_lorafusion.__main__:run"]},
)
