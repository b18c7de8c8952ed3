"""The runbooks and collector sets ship inside the package (ralph_runner/runbooks/ and
ralph_runner/collectors/ in the wheel), while the checkout keeps them at its top, where
operators read and copy them: `ralph-run runbooks/vllm.yaml`. Everything else is in
pyproject.toml; `ralph_runner.runbook.loader.shipped` finds them in either place."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("runbooks", "collectors")


class BuildPyWithRunbooks(build_py):
    def run(self) -> None:
        super().run()
        for folder in SHIPPED:
            target = Path(self.build_lib) / "ralph_runner" / folder
            shutil.rmtree(target, ignore_errors=True)  # a stale build keeps no removed file
            shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildPyWithRunbooks})
