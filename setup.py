"""Build the dsv4_ops package (DESIGN.md §3). `lowering/` (Triton kernels) joins as
`dsv4_ops.lowering` via package_dir once it exists."""
from setuptools import find_packages, setup

setup(
    name="dsv4_ops",
    version="0.1.0",
    description="torch.compile-native operators and runtime for DeepSeek-V4 attention",
    packages=find_packages(include=["dsv4_ops", "dsv4_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6"],
)
