"""Package discovery lives here only because the `cli/` folder installs as `sbft_cli`.

A folder named `cli` must not land in site-packages as a top-level `cli` module (it would
shadow or be shadowed by other projects), and pyproject-only discovery cannot rename a folder.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["sparsebalance_ft", "sparsebalance_ft.*"]) + ["sbft_cli"],
    package_dir={"sbft_cli": "cli"},
    package_data={"sparsebalance_ft": ["py.typed"]},
)
