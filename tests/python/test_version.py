"""One version everywhere (issue 38, first part): the Python package's is the project's
(CMakeLists.txt), the server's GetInfo and --version report it, and a client warns once where the
server's major version differs from its own."""
import re
import subprocess
import warnings

import pytest

import lce_client
from conftest import REPO, server_binary
from lce_client import _version


def project_version() -> str:
    m = re.search(r"project\(lce_serve VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert m, "CMakeLists.txt names no project version"
    return m.group(1)


def test_the_package_server_and_cli_report_the_projects_version(heads):
    v = project_version()
    assert lce_client.__version__ == v
    assert subprocess.run([str(server_binary()), "--version"], capture_output=True, text=True,
                          check=True).stdout.strip() == f"lce_server {v}"
    c = lce_client.Client(heads["fp32"].target, timeout=30)
    assert c.info().server_version == v


def test_a_server_of_another_major_version_is_warned_of_once(heads, monkeypatch):
    c = lce_client.Client(heads["fp32"].target, timeout=30)
    monkeypatch.setattr(_version, "VERSION", "99.0.0")
    with pytest.warns(RuntimeWarning, match="another major version"):
        c.info()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.info()  # once a client
