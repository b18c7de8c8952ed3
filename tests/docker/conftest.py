"""The docker tier: a real docker daemon, the image ralph-standin:latest and compose.

Each need is a session fixture that skips the tier with a one-line reason when it cannot be met:
no docker client, no daemon and none can be started (ci/dockerd.sh: needs root and the kernel's
overlay and cgroup support), no image and no cached rootfs to import it from (ci/install-docker.sh
builds both), no compose. A daemon started here is stopped at the end, its containers first.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_helpers import (
    DOCKERD_SCRIPT,
    IMAGE,
    INSTALL_SCRIPT,
    ROOTFS_DONE,
    ComposeService,
    compose_command,
    containers,
    first_line,
    run,
)


def _daemon_answers() -> bool:
    return run(["docker", "info"], timeout=20).returncode == 0


@pytest.fixture(scope="session")
def docker_daemon() -> Iterator[None]:
    """A daemon that answers `docker info`: the one running, or one started by ci/dockerd.sh.

    At the end: not one container of this pytest run is left, running or stopped."""
    if shutil.which("docker") is None:
        pytest.skip("docker tier: no docker client on PATH (Debian: apt-get install docker.io)")
    started_here = not _daemon_answers()
    if started_here:
        started = run([str(DOCKERD_SCRIPT), "start"], timeout=120)
        if started.returncode != 0:
            pytest.skip(f"docker tier: no docker daemon: {first_line(started)}")
    try:
        yield
        left = containers()
        assert not left, f"containers left behind: {left}"
    finally:
        if started_here:
            run([str(DOCKERD_SCRIPT), "stop"], timeout=120)


@pytest.fixture(scope="session")
def standin_image(docker_daemon: None) -> str:
    """ralph-standin:latest; imported from the cached rootfs when only the daemon is new."""
    if run(["docker", "image", "inspect", IMAGE]).returncode == 0:
        return IMAGE
    if not ROOTFS_DONE.exists():
        pytest.skip(f"docker tier: no image {IMAGE}: run ci/install-docker.sh (about a minute)")
    built = run([str(INSTALL_SCRIPT)], timeout=110)
    if built.returncode != 0:
        pytest.skip(f"docker tier: {first_line(built)}")
    return IMAGE


@pytest.fixture(scope="session")
def compose(docker_daemon: None) -> list[str]:
    command = compose_command()
    if shutil.which(command[0]) is None or run([*command, "version"]).returncode != 0:
        pytest.skip("docker tier: no docker compose plugin and no docker-compose")
    return command


@pytest.fixture
def service(tmp_path: Path, standin_image: str, compose: list[str]) -> Iterator[ComposeService]:
    """A stand-in compose service of this test's own; `docker compose down` at the end."""
    built = ComposeService(tmp_path)
    try:
        yield built
    finally:
        if built.status():  # compose is slow to start: only when there is a container
            built.down()
