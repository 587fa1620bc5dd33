"""Only here because `kernels/` and `grammars/` live at the top level but install inside the package
(`structgen.kernels`, `structgen.grammars`), which pyproject's package discovery cannot express."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["structgen", "structgen.*"]),
        "structgen.kernels",
        "structgen.grammars",
    ],
    package_dir={"structgen.kernels": "kernels", "structgen.grammars": "grammars"},
)
