"""Packaging for torchpipe: GPipe pipeline parallelism and data-parallel wrappers for PyTorch."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "torchpipe" / "__version__.py").read_text(), re.M)
assert VERSION is not None, "torchpipe/__version__.py must define __version__"

setup(
    name="torchpipe",
    version=VERSION.group(1),
    description="GPipe pipeline parallelism and data-parallel wrappers for PyTorch",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.9",
    packages=find_packages(include=["torchpipe", "torchpipe.*", "torchpipe_balancing", "torchpipe_balancing.*"]),
    package_data={"torchpipe": ["py.typed"], "torchpipe_balancing": ["py.typed"]},
    zip_safe=False,
    install_requires=["torch>=2.1", "typing-extensions>=4.0"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "mypy>=1.8", "ruff>=0.4"],
        "bench": ["tqdm>=4", "matplotlib>=3.5"],
        "docs": ["sphinx>=7", "myst-parser>=2", "furo>=2023.9.10"],
        # Only the tests and examples of as_sequential on Hugging Face models use it; torchpipe never imports it.
        "transformers": ["transformers>=4.40"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
