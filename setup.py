"""megatron-mecefo: MeCeFO fault-tolerant training for Megatron-Core and DeepSpeed."""

import glob
import re

from setuptools import find_packages, setup

# the one source of the version (megatron_mecefo/version.py), read without importing the package
VERSION = re.search(r'^__version__ = "([^"]+)"', open("megatron_mecefo/version.py", encoding="utf-8").read(), re.M).group(1)

setup(
    name="megatron-mecefo",
    version=VERSION,
    description=(
        "MeCeFO (memory- and computation-efficient fault-tolerant optimization) for "
        "Megatron-Core / DeepSpeed: survive node failures in-process with a cheap neighbor backward"
    ),
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE", "NOTICE"],
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mecefo", "megatron_mecefo.*"]),
    # torch is deliberately unpinned here: GPU users bring their own CUDA build.
    # CPU machines install with `-c constraints.txt` (see README).
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "deepspeed>=0.19.4",
    ],
    entry_points={"console_scripts": ["mecefo-launch=megatron_mecefo.elastic.launch.cli:main",
                                     "mecefo-store=megatron_mecefo.elastic.launch.store_daemon:main",
                                     "mecefo-patch=megatron_mecefo.patch:main"]},
    # the patches for existing Megatron checkouts (mecefo-patch finds them here in a wheel install)
    data_files=[(f"share/megatron-mecefo/{d}", glob.glob(f"{d}/*")) for d in glob.glob("patches/*")],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5"],
        "bench": ["matplotlib>=3.8"],
        # what Megatron-DeepSpeed's pretrain_gpt.py imports beyond torch and deepspeed (it also imports
        # torchvision, through its vision code: bring the one matching your torch)
        "mds": ["transformers>=4.40,<5", "six", "regex", "pybind11"],
        # what Megatron-LM's pretrain_gpt.py imports beyond torch and megatron-core (and triton, which
        # CUDA builds of torch bring)
        "mlm": ["six", "regex", "pybind11", "pyyaml"],
    },
)
