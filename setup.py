from pathlib import Path

from setuptools import find_packages, setup


def requirements(name: str) -> list[str]:
    lines = Path(__file__).with_name(name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="megatron_grpo",
    version="0.1.0",
    description="Model-parallel GRPO on megatron-core with exact loss normalization",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    install_requires=requirements("requirements.txt"),
    extras_require={
        "test": requirements("requirements-test.txt"),
        "gpu": ["transformer-engine[pytorch]", "sglang==0.5.23"],
    },
    entry_points={"console_scripts": ["megatron-grpo=megatron_grpo.cli:main"]},
)
