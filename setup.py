"""Build the dsv4_ops package (DESIGN.md §3); the top-level `lowering/` (backend kernels)
installs as `dsv4_ops.lowering` via package_dir."""
from setuptools import find_packages, setup

setup(
    name="dsv4_ops",
    version="0.1.0",
    description="torch.compile-native operators and runtime for DeepSeek-V4 attention",
    packages=find_packages(include=["dsv4_ops", "dsv4_ops.*"]) + ["dsv4_ops.lowering", "dsv4_ops.lowering.triton",
                                                                 "dsv4_ops.lowering.gluon", "dsv4_ops.lowering.cuda"],
    package_dir={"dsv4_ops.lowering": "lowering"},
    package_data={"dsv4_ops": ["assets/tiny/*"]},  # the bundled trained model (dsv4_ops.pretrained.tiny())
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "tokenizers", "safetensors"],
)
