"""The repository names no package mirror or registry host (issue 31, item 24).

ci/install-docker.sh used to fall back to a Debian mirror written into the script; a CI script
must take its mirrors and registries from the machine it runs on (its apt sources, pip's and
npm's own configuration), never from the repository. Two checks: every URL in ci/ and .ci/
names only a loopback host, and no tracked file anywhere names a well-known package mirror or
registry host.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI_DIRS = ("ci", ".ci")
URL_HOST = re.compile(r"\b[a-z][a-z0-9+.-]*://(?:[^\s/@'\"]*@)?([A-Za-z0-9.-]+)")
LOOPBACK = re.compile(r"^(localhost|127(\.\d+){3}|0\.0\.0\.0)$")
# Package mirrors and registries, by host (the dots escaped, so this file names none of them).
MIRROR_HOSTS = re.compile(
    r"(?<![\w.-])("
    r"(deb|security|snapshot|archive|ftp\.[a-z]{2})\.debian\.org"
    r"|([a-z]{2}\.)?(archive|ports|security)\.ubuntu\.com"
    r"|pypi\.org|(files|upload)\.pythonhosted\.org|pypi\.python\.org"
    r"|registry\.npmjs\.org|registry\.yarnpkg\.com|registry\.npmmirror\.com"
    r"|(registry-1|index|hub|production\.cloudflare)\.docker\.(io|com)|docker\.io/"
    r"|ghcr\.io|quay\.io|([a-z0-9-]+\.)?gcr\.io|[a-z0-9-]+\.pkg\.dev"
    r"|download\.pytorch\.org|conda\.anaconda\.org|repo\.anaconda\.com"
    r"|proxy\.golang\.org|crates\.io|static\.crates\.io|rubygems\.org"
    r"|[a-z0-9.-]*mirrors?[a-z0-9-]*\.[a-z0-9.-]*[a-z]"
    r")(?![\w-])",
    re.IGNORECASE,
)


def ci_files() -> list[Path]:
    """Every file under ci/ and .ci/ (tracked or not: a local fallback is caught before it is
    committed)."""
    found = []
    for name in CI_DIRS:
        folder = ROOT / name
        found += [p for p in sorted(folder.rglob("*")) if p.is_file()] if folder.is_dir() else []
    return found


def hits(path: Path, pattern: re.Pattern[str], group: int = 0) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []  # binary or unreadable: no script
    return [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(group)}"
        for m in pattern.finditer(text)
    ]


def test_the_ci_scripts_name_no_host_but_loopback() -> None:
    files = ci_files()
    assert any(p.name == "install-docker.sh" for p in files), "ci/ not found"
    named = [
        hit
        for path in files
        for hit in hits(path, URL_HOST, 1)
        if not LOOPBACK.match(hit.rsplit(": ", 1)[1])
    ]
    assert named == [], "ci/ and .ci/ name a host; take it from the machine:\n" + "\n".join(named)


def test_the_ci_scripts_name_no_mirror_or_registry() -> None:
    named = [hit for path in ci_files() for hit in hits(path, MIRROR_HOSTS)]
    assert named == [], "a mirror or registry host in ci/ or .ci/:\n" + "\n".join(named)


@pytest.mark.system  # runs git
def test_no_tracked_file_names_a_mirror_or_registry() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    tracked = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    named = [hit for path in tracked if path.is_file() for hit in hits(path, MIRROR_HOSTS)]
    assert named == [], "a mirror or registry host in the repository:\n" + "\n".join(named)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('mirror="${mirror:-http://deb.debian' + '.org/debian}"', True),
        ("--index-url https://pypi" + ".org/simple", True),
        ("npm config set registry https://registry.npmjs" + ".org/", True),
        ("FROM ghcr" + ".io/org/image:1", True),
        ("http://ftp.de.debian" + ".org/debian", True),
        ("https://mirr" + "ors.example.net/ubuntu", True),
        ("apt-get install docker" + ".io docker-compose", False),  # a Debian package, no host
        ('base_url="http://127.0.0.1:8000/v1"', False),
        ("# the mirror apt uses on this machine", False),
    ],
)
def test_the_pattern_finds_mirror_hosts_and_not_package_names(text: str, named: bool) -> None:
    assert bool(MIRROR_HOSTS.search(text)) is named


def stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


def install_docker(tmp_path: Path, sources: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """ci/install-docker.sh in a copy of the checkout's layout, with a docker that answers and
    has no image, a debootstrap that records its arguments and fails, root, and `sources` as
    the machine's only apt source file. The run and debootstrap's record."""
    checkout = tmp_path / "checkout"
    (checkout / "ci").mkdir(parents=True)
    script = checkout / "ci" / "install-docker.sh"
    script.write_bytes((ROOT / "ci" / "install-docker.sh").read_bytes())
    record = tmp_path / "debootstrap.args"
    stub(tmp_path / "bin" / "docker", 'case "$1" in info) exit 0;; *) exit 1;; esac')
    stub(tmp_path / "bin" / "debootstrap", f'echo "$@" >{record}; echo "stub failed"; exit 1')
    stub(tmp_path / "bin" / "id", "echo 0")
    apt = tmp_path / "apt" / "debian.sources"
    apt.parent.mkdir()
    apt.write_text(sources, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"}
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}", APT_SOURCES=str(apt))
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    return done, record


@pytest.mark.system  # runs the script
def test_without_a_mirror_in_the_apt_sources_it_says_so_in_one_line(tmp_path: Path) -> None:
    done, record = install_docker(tmp_path, "Types: deb\nURIs: file:/srv/local-debs\n")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "install-docker: no Debian mirror in this machine's apt sources (set DEBIAN_MIRROR);"
        " the docker tests will skip"
    ], done.stdout + done.stderr
    assert not record.exists()  # nothing fetched from anywhere


@pytest.mark.system  # runs the script
def test_the_mirror_comes_from_the_apt_sources(tmp_path: Path) -> None:
    sources = "Types: deb\nURIs: http://apt.example.test/debian\nSuites: bookworm\n"
    done, record = install_docker(tmp_path, sources)
    assert done.returncode == 1  # the stub debootstrap fails
    assert "from http://apt.example.test/debian failed" in done.stdout, done.stdout
    assert record.read_text().split()[-1] == "http://apt.example.test/debian"
