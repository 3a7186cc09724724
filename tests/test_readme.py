"""README, Makefile, Procfile and .ci/run stay true: every command the README shows exists."""

from __future__ import annotations

import re
import shlex

import pytest

from ddpdash.cli import build_parser
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def readme_commands(prefix: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefix):
                lines.append(line)
    return lines


@pytest.mark.parametrize("line", readme_commands("ddpdash "))
def test_every_ddpdash_command_in_the_readme_parses(line: str) -> None:
    build_parser().parse_args(shlex.split(line)[1:])  # exits (fails the test) on an unknown flag


def test_the_readme_shows_cli_commands() -> None:
    assert len(readme_commands("ddpdash ")) >= 8


def test_the_two_commands_exist_in_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "make run" in README and "make test" in README
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "torch==2.13.0" in makefile


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_procfile_serves_on_port() -> None:
    procfile = (ROOT / "Procfile").read_text()
    assert procfile.startswith("web:") and "$PORT" in procfile and "ddpdash ui" in procfile


def test_readme_names_the_settings() -> None:
    for name in ("DDPDASH_HOME", "DDPDASH_DB_URL", "DDPDASH_PASSWORD", "docs/live.png"):
        assert name in README
    assert (ROOT / "docs" / "live.png").exists()
