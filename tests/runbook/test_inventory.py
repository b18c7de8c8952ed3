"""Inventory, host patterns and variables, checked against ansible-core where it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ralph_runner.errors import FatalError, Problem
from ralph_runner.runbook import inventory

DATA = Path(__file__).parents[1] / "data" / "inventory"
MULTI = DATA / "multi" / "inventory.yaml"
REPO_INVENTORY = Path(__file__).parents[2] / "inventory.yaml"
MAGIC = ("inventory_hostname", "inventory_hostname_short", "group_names")


def _ansible_tool(name: str) -> str | None:
    beside_python = Path(sys.executable).with_name(name)
    return str(beside_python) if beside_python.exists() else shutil.which(name)


needs_ansible = pytest.mark.skipif(
    not (_ansible_tool("ansible-inventory") and _ansible_tool("ansible-playbook")),
    reason="ansible-core (ansible-inventory, ansible-playbook) is not installed",
)
runs_ansible = pytest.mark.system  # Ansible's CLIs: seconds a test


def _run_ansible(tmp_path: Path, tool: str, *args: str) -> str:
    """Run an Ansible CLI quietly in tmp_path: own HOME and temp, only the YAML inventory plugin."""
    home = tmp_path / "ansible-home"
    home.mkdir(exist_ok=True)
    config = home / "ansible.cfg"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        HOME=str(home),
        ANSIBLE_CONFIG=str(config),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        ANSIBLE_INVENTORY_ENABLED="yaml",
        ANSIBLE_INVENTORY_UNPARSED_FAILED="true",
        ANSIBLE_HOST_PATTERN_MISMATCH="error",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_DEPRECATION_WARNINGS="false",
        ANSIBLE_RETRY_FILES_ENABLED="false",
    )
    result = subprocess.run(
        [_ansible_tool(tool), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _ansible_groups(listing: dict) -> dict[str, list[str]]:
    """Each group's hosts from `ansible-inventory --list`, children included, breadth first."""
    names = {"all", *(k for k in listing if k != "_meta")}
    names |= {child for group in listing.values() for child in group.get("children", [])}
    groups = {}
    for name in names:
        order, frontier = [name], [name]
        while frontier:
            children = [c for g in frontier for c in listing.get(g, {}).get("children", [])]
            frontier = [c for c in dict.fromkeys(children) if c not in order]
            order += frontier
        hosts = [h for g in order for h in listing.get(g, {}).get("hosts", [])]
        groups[name] = list(dict.fromkeys(hosts))
    groups["all"] = list(dict.fromkeys([*listing["_meta"]["hostvars"], *groups["all"]]))
    return groups


@needs_ansible
@runs_ansible
@pytest.mark.parametrize("path", [MULTI, REPO_INVENTORY], ids=["multi", "repo-root"])
def test_every_host_resolves_like_ansible_inventory(tmp_path, path):
    listing = json.loads(_run_ansible(tmp_path, "ansible-inventory", "-i", str(path), "--list"))
    inv = inventory.load(path)
    expected_groups = _ansible_groups(listing)

    assert {g: sorted(h) for g, h in inv.groups().items()} == {
        g: sorted(h) for g, h in expected_groups.items()
    }
    assert sorted(inv.hosts()) == sorted(expected_groups["all"])
    for host in inv.hosts():
        resolved = inv.host_vars(host)
        ansible_vars = listing["_meta"]["hostvars"].get(host, {})
        assert {k: v for k, v in resolved.items() if k not in MAGIC} == ansible_vars, host
        member_of = sorted(
            g for g, hosts in expected_groups.items() if host in hosts and g != "all"
        )
        assert resolved["group_names"] == member_of, host
        assert resolved["inventory_hostname"] == host


PATTERNS = [
    "all",
    "*",
    "web",
    "spark-b",
    "web*",
    "*.lan",
    "spark-[bc]",
    "~db-[ab]",
    "web:db",
    "web,db",
    "web:!db",
    "web:&db",
    "gpu_hosts:&web:!big_gpu",
    "!web",
    "&web",
    "big_gpu:lonely",
    "db-*:cache1",
    "ungrouped",
    "localhost",
    "127.0.0.1",
]


@needs_ansible
@runs_ansible
def test_select_matches_ansible_play_hosts_in_order(tmp_path):
    """One ansible-playbook run: a play per pattern prints its hosts in inventory order."""
    plays = [
        {
            "hosts": pattern,
            "gather_facts": False,
            "tasks": [
                {
                    "debug": {"msg": f"P{i} {{{{ ansible_play_hosts_all | join(',') }}}}"},
                    "run_once": True,
                }
            ],
        }
        for i, pattern in enumerate(PATTERNS)
    ]
    (tmp_path / "patterns.yml").write_text(yaml.safe_dump(plays))
    output = _run_ansible(tmp_path, "ansible-playbook", "-i", str(MULTI), "patterns.yml")
    ansible_hosts = {}
    for line in output.splitlines():
        if '"msg": "P' in line:
            index, _, hosts = line.split('"msg": "P', 1)[1].rstrip('"').partition(" ")
            ansible_hosts[PATTERNS[int(index)]] = hosts.split(",")
    assert len(ansible_hosts) == len(PATTERNS)

    inv = inventory.load(MULTI)
    assert {pattern: inv.select(pattern) for pattern in PATTERNS} == ansible_hosts


@pytest.fixture(scope="module")
def multi():
    return inventory.load(MULTI)


WEB = ["web01.lan", "web02.lan", "web03.lan", "spark-b", "spark-c"]
DB = ["db1", "spark-b", "db-a", "db-b", "cache1"]
ALL = ["lonely", "localhost", "spark-b", *WEB[:3], "spark-c", "db1", "db-a", "db-b", "cache1"]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("all", ALL),
        ("*", ALL),
        ("web", WEB),  # a group: its own hosts in inventory order
        ("gpu_hosts", ["localhost", "spark-b", "spark-c"]),  # children's hosts included
        ("spark-b", ["spark-b"]),  # a host
        ("web*", WEB),  # a glob: group web, and hosts web01.lan.. (already in it)
        ("web0*", ["web01.lan", "web02.lan", "web03.lan"]),  # a glob over host names
        ("~db-[ab]", ["db-a", "db-b"]),  # a regular expression
        ("web:db", [*WEB, "db1", "db-a", "db-b", "cache1"]),  # union, first-seen order
        ("web,db", [*WEB, "db1", "db-a", "db-b", "cache1"]),
        ("web:!db", ["web01.lan", "web02.lan", "web03.lan", "spark-c"]),  # difference
        ("web:&db", ["spark-b"]),  # intersection
        ("!web:gpu_hosts", ["localhost"]),  # exclusions apply last, whatever their place
        ("!web", ["lonely", "localhost", "db1", "db-a", "db-b", "cache1"]),  # only `!`: from all
        ("web:&gpu_hosts:!big_gpu", ["spark-b"]),
        ("web : db", [*WEB, "db1", "db-a", "db-b", "cache1"]),  # spaces are ignored
        ("ungrouped", ["lonely"]),
        ("cache1", ["cache1"]),
        ("127.0.0.1", ["localhost"]),  # the inventory's localhost
        ("web:web", WEB),  # no duplicates
    ],
)
def test_pattern_forms(multi, pattern, expected):
    assert multi.select(pattern) == expected


def test_hosts_and_groups_in_inventory_order(multi):
    assert multi.hosts() == ALL
    groups = multi.groups()
    assert list(groups) == ["all", "ungrouped", "gpu_hosts", "big_gpu", "web", "db"]
    assert groups["all"] == ALL
    assert groups["db"] == DB
    assert groups["big_gpu"] == ["spark-c"]


def test_pattern_part_that_matches_nothing_names_it_and_the_inventory(multi):
    where = Problem("", "runbooks/vllm.yaml", 2, 8, "hosts")
    with pytest.raises(FatalError) as caught:
        multi.select("gpu_host", where=where)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column, problem.path) == (
        "runbooks/vllm.yaml",
        2,
        8,
        "hosts",
    )
    assert problem.message.startswith(
        "host pattern 'gpu_host': 'gpu_host' matches no host or group; did you mean 'gpu_hosts'?"
    )
    assert "groups: all, ungrouped, gpu_hosts, big_gpu, web, db;" in problem.message
    assert "hosts: lonely, localhost, spark-b," in problem.message


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (
            "web:!gpu_host",
            "host pattern 'web:!gpu_host': 'gpu_host' matches no host or group;"
            " did you mean 'gpu_hosts'?",
        ),
        ("nomatch*", "host pattern 'nomatch*': 'nomatch*' matches no host or group"),
        ("~(web", "host pattern '~(web': '~(web' is not a valid regular expression"),
        (" , ", "empty host pattern ' , '"),
        ("web:!", "host pattern 'web:!': '!' names nothing"),
    ],
)
def test_bad_patterns(multi, pattern, message):
    with pytest.raises(FatalError) as caught:
        multi.select(pattern)
    (problem,) = caught.value.problems
    assert problem.message.startswith(message)
    assert problem.file is None


def test_implicit_localhost_when_the_inventory_does_not_list_it(tmp_path):
    (tmp_path / "inventory.yaml").write_text(
        "all:\n  vars: {log_dir: logs, ansible_connection: ssh}\n"
        "  children:\n    gpu: {hosts: {spark-b: }}\n"
    )
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "host_vars" / "localhost.yaml").write_text("container: local-vllm\n")
    inv = inventory.load(tmp_path / "inventory.yaml")

    assert inv.hosts() == ["spark-b"]
    assert inv.select("localhost") == ["localhost"]
    assert inv.select("all") == ["spark-b"]  # like Ansible: `all` never includes it
    assert inv.select("localhost:gpu") == ["localhost", "spark-b"]
    assert inv.host_vars("localhost") == {
        "log_dir": "logs",
        "ansible_connection": "local",  # its own var beats `all`'s
        "container": "local-vllm",
        "inventory_hostname": "localhost",
        "inventory_hostname_short": "localhost",
        "group_names": [],
    }


def test_no_inventory_means_localhost_only():
    inv = inventory.load(None)
    assert inv.file is None
    assert inv.hosts() == ["localhost"]
    assert inv.select("localhost") == inv.select("all") == ["localhost"]
    assert inv.host_vars("localhost")["ansible_connection"] == "local"
    with pytest.raises(FatalError, match="'spark-b' matches no host or group"):
        inv.select("spark-b")


def test_group_order_depth_then_priority_then_name(tmp_path):
    """Inline group vars only: deeper wins; at one depth the higher priority, then the name."""
    (tmp_path / "inventory.yaml").write_text(
        """\
all:
  vars: {a: all, b: all, c: all, d: all}
  children:
    zeta:
      vars: {a: zeta, b: zeta, c: zeta}
      hosts: {h: }
      children:
        deep: {vars: {a: deep}, hosts: {h: }}
    alpha:
      vars: {a: alpha, b: alpha, c: alpha, ansible_group_priority: "5"}
      hosts: {h: }
    beta:
      vars: {a: beta, b: beta}
      hosts: {h: }
"""
    )
    inv = inventory.load(tmp_path / "inventory.yaml")
    resolved = inv.host_vars("h")
    assert {k: resolved[k] for k in "abcd"} == {"a": "deep", "b": "alpha", "c": "alpha", "d": "all"}
    assert "ansible_group_priority" not in resolved
    assert resolved["group_names"] == ["alpha", "beta", "deep", "zeta"]


def test_group_vars_files_beat_inline_vars_and_host_vars_beat_both(multi):
    spark_b = multi.host_vars("spark-b")
    assert spark_b["level"] == "db-file"  # db: priority 10, and group_vars/ over inline
    assert spark_b["service_port"] == 5432
    assert spark_b["container"] == "vllm-b-from-host_vars"
    assert spark_b["role"] == "web-too"  # inline host var over group_vars/all.yaml
    assert multi.host_vars("lonely")["role"] == "none"
    assert multi.host_vars("spark-c")["level"] == "big_gpu-dir-20"  # depth 2 beats priority
    assert multi.host_vars("db1")["level"] == "db1-host_vars-json"  # tab-indented JSON
    assert multi.host_vars("cache1")["ansible_port"] == 6380
    web01 = multi.host_vars("web01.lan")
    assert web01["inventory_hostname_short"] == "web01"
    assert web01["nested"] == {"a": 1, "b": ["x", "y"]}
    assert "shadowed" not in web01  # group_vars/web.yml shadows web.yaml
    skipped = ("hidden_file", "txt_file", "backup_file")
    assert not any(name in multi.host_vars("spark-c") for name in skipped)
    assert multi.host_vars("lonely")["group_names"] == ["ungrouped"]  # as Ansible sets it


def test_resolve_vars_precedence_chain(multi):
    runbook_vars = {"base_url": "http://127.0.0.1:8000/v1", "model": "qwen", "level": "runbook"}
    extra = {"model": "llama", "inventory_hostname": "ignored"}
    resolved = inventory.resolve_vars(runbook_vars, multi, "spark-b", extra)
    assert resolved["base_url"] == "http://spark-b.lan:8000/v1"  # host_vars/ over runbook
    assert resolved["level"] == "db-file"  # group vars over runbook
    assert resolved["model"] == "llama"  # -e over everything
    assert resolved["inventory_hostname"] == "spark-b"  # magic vars are not overridable
    assert inventory.resolve_vars(runbook_vars, multi, "lonely", {})["base_url"] == (
        "http://127.0.0.1:8000/v1"
    )
    with pytest.raises(FatalError, match=r"unknown host 'spark-bb'; did you mean 'spark-b'\?"):
        inventory.resolve_vars({}, multi, "spark-bb", {})


def test_host_ranges_ports_and_string_sections(tmp_path):
    (tmp_path / "inventory.yaml").write_text(
        """\
all:
  children:
    nodes:
      hosts:
        node[08:10].lan:
        rack[a:b]-[1:3:2]:
        "[fe80::1]:2200":
        gpu-box:2222: {ansible_user: ops}
    solo:
      hosts: single            # Ansible allows a string here
      children: nodes
"""
    )
    inv = inventory.load(tmp_path / "inventory.yaml")
    assert inv.groups()["nodes"] == [
        "node08.lan",
        "node09.lan",
        "node10.lan",
        "racka-1",
        "racka-3",
        "rackb-1",
        "rackb-3",
        "fe80::1",
        "gpu-box",
    ]
    assert inv.host_vars("gpu-box")["ansible_port"] == 2222
    assert inv.host_vars("fe80::1")["ansible_port"] == 2200
    assert inv.host_vars("fe80::1")["inventory_hostname_short"] == "fe80::1"
    assert inv.groups()["solo"] == ["single", *inv.groups()["nodes"]]


def _inventory_problem(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Problem:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(FatalError) as caught:
        inventory.load(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    return problem


MALFORMED_INVENTORIES = {
    "hosts given as a list": (
        "all:\n  children:\n    web:\n      hosts:\n        - web1\n        - web2\n",
        (4, 7, "all.children.web.hosts"),
        "`hosts` must be a mapping of host name to its vars (write `web1:`, not `- web1`),"
        " found a list",
    ),
    "group that is not a mapping": (
        "all:\n  children:\n    web: [web1, web2]\n",
        (3, 5, "all.children.web"),
        "group 'web' must be a mapping with `hosts`, `children` or `vars`, found a list",
    ),
    "unknown key in a group": (
        "all:\n  children:\n    web:\n      host:\n        web1:\n",
        (4, 7, "all.children.web.host"),
        "unknown key 'host' in group 'web'; did you mean 'hosts'?;"
        " a group has `hosts`, `children` and `vars`",
    ),
    "host vars that are not a mapping": (
        "all:\n  hosts:\n    web1: web1.lan\n",
        (3, 5, "all.hosts.web1"),
        "the vars of host 'web1' must be a mapping (or empty), found a string",
    ),
    "children that loop": (
        "all:\n  children:\n    a:\n      children:\n        b:\n          children:\n"
        "            a:\n",
        (5, 9, "all.children.a.children.b"),
        "group 'b' under 'a' makes a loop: 'b' is already 'a' or one of its parents",
    ),
    "ansible_group_priority not an integer": (
        "web:\n  vars:\n    ansible_group_priority: high\n",
        (3, 5, "web.vars.ansible_group_priority"),
        "ansible_group_priority must be an integer, found a string",
    ),
    "vars given as a list": (
        "all:\n  vars:\n    - log_dir: logs\n",
        (2, 3, "all.vars"),
        "`vars` must be a mapping of variable name to value, found a list",
    ),
    "host name that is a number": (
        "all:\n  hosts:\n    1234:\n",
        (3, 5, "all.hosts.1234"),
        "host name 1234 must be a string; quote it",
    ),
    "empty host range": (
        "all:\n  hosts:\n    web[3:1]:\n",
        (3, 5, "all.hosts.web[3:1]"),
        "host range in 'web[3:1]': [3:1] is empty; begin must not be after end",
    ),
    "port on a host defined before": (
        "a:\n  hosts: {web1: }\nb:\n  hosts:\n    web1:2222:\n",
        (5, 5, "b.hosts.web1:2222"),
        "host 'web1' is already defined; Ansible ignores a port given again:"
        " give `:2222` where it first appears",
    ),
    "`all` as a child group": (
        "web:\n  children:\n    all:\n",
        (3, 5, "web.children.all"),
        "`all` holds every group; it cannot be a child group",
    ),
    "top level that is a list": (
        "- all\n- web\n",
        (1, 1, ""),
        "an inventory is a mapping of groups (`all:`), found a list",
    ),
    "inventory plugin configuration": (
        "plugin: amazon.aws.aws_ec2\nregions: [us-east-1]\n",
        (1, 1, "plugin"),
        "inventory plugin configuration is not supported; give hosts and groups",
    ),
    "YAML syntax error": (
        "all:\n  hosts:\n    web1: {ansible_host: [\n",
        (4, 1, ""),
        "invalid YAML: expected the node content, but found '<stream end>'",
    ),
}


@pytest.mark.parametrize(
    ("text", "where", "message"),
    MALFORMED_INVENTORIES.values(),
    ids=MALFORMED_INVENTORIES.keys(),
)
def test_malformed_inventory(tmp_path, text, where, message):
    problem = _inventory_problem(tmp_path, text)
    assert (problem.line, problem.column, problem.path) == where
    assert problem.message.startswith(message)


def test_ini_inventory_says_how_to_convert(tmp_path):
    ini = "# production\n\n[gpu_hosts]\nspark-b ansible_host=spark-b.lan\n"
    problem = _inventory_problem(tmp_path, ini, name="hosts")
    assert (problem.line, problem.column, problem.path) == (3, 1, "")
    assert problem.message == (
        "this is an INI inventory; ralph-run reads Ansible's YAML inventory format."
        f" Convert it once: ansible-inventory -i {tmp_path / 'hosts'} --list --yaml"
        " > inventory.yaml"
    )


def test_vars_file_that_is_not_a_mapping(tmp_path):
    (tmp_path / "inventory.yaml").write_text("web:\n  hosts: {web1: }\n")
    (tmp_path / "group_vars").mkdir()
    vars_file = tmp_path / "group_vars" / "web.yaml"
    vars_file.write_text("# web servers\n- port: 80\n")
    with pytest.raises(FatalError) as caught:
        inventory.load(tmp_path / "inventory.yaml")
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column, problem.path) == (str(vars_file), 2, 1, "")
    assert problem.message == (
        "a vars file must hold a mapping of variable names to values, found a list"
    )


def test_vars_file_with_a_syntax_error(tmp_path):
    (tmp_path / "inventory.yaml").write_text("all:\n  hosts: {web1: }\n")
    (tmp_path / "host_vars" / "web1").mkdir(parents=True)
    vars_file = tmp_path / "host_vars" / "web1" / "10-ssh.yml"
    vars_file.write_text("ansible_user: ops\nansible_port: 22\nansible_user: root\n")
    with pytest.raises(FatalError) as caught:
        inventory.load(tmp_path / "inventory.yaml")
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column) == (str(vars_file), 3, 1)
    assert problem.message == "duplicate key 'ansible_user'"


def test_missing_inventory_and_directory(tmp_path):
    with pytest.raises(FatalError) as caught:
        inventory.load(tmp_path / "nope.yaml")
    assert caught.value.problems == [Problem("file not found", str(tmp_path / "nope.yaml"))]
    with pytest.raises(FatalError) as caught:
        inventory.load(tmp_path)
    assert caught.value.problems == [
        Problem("is a directory; -i takes an inventory file", str(tmp_path))
    ]


def test_empty_inventory_file_has_no_hosts_but_localhost_works(tmp_path):
    (tmp_path / "inventory.yaml").write_text("# nothing yet\n")
    inv = inventory.load(tmp_path / "inventory.yaml")
    assert inv.hosts() == []
    assert inv.groups() == {"all": [], "ungrouped": []}
    assert inv.select("all") == []
    assert inv.select("localhost") == ["localhost"]
