"""Every ``hf download`` command in docs/retrieval.md parses with the installed huggingface_hub CLI (no network).

huggingface_hub 1.x (what verl installs) removed ``huggingface-cli``, and its ``hf download``
takes one glob per ``--include``: a second pattern after the first would be read as a file
name and ignored with a warning.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "retrieval.md"


def documented_commands(text: str) -> list[str]:
    """Shell commands of the fenced bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def hf_download_command() -> click.Command:
    hf = pytest.importorskip("huggingface_hub.cli.hf")
    group = hf.app
    command = group.get_command(click.Context(group), "download")
    return command.materialize() if hasattr(command, "materialize") else command


def test_hf_download_commands_parse_with_the_installed_client() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "huggingface-cli" not in text
    downloads = [c for c in documented_commands(text) if c.startswith("hf download")]
    assert len(downloads) >= 3
    parser = hf_download_command()
    for cmd in downloads:
        ctx = parser.make_context("download", shlex.split(cmd)[2:])  # raises click.UsageError on a bad option
        filenames = ctx.params.get("filenames") or []
        assert not [f for f in filenames if any(ch in f for ch in "*?[")], f"{cmd}: a glob read as a file name"
        assert ctx.params.get("local_dir"), cmd


def test_the_check_catches_the_old_mistakes() -> None:
    parser = hf_download_command()
    with pytest.raises(click.UsageError):
        parser.make_context("download", ["repo", "--bogus-flag"])
    ctx = parser.make_context("download", shlex.split('org/data --include "nq/*" "triviaqa/*" --local-dir d'))
    assert ctx.params["filenames"] == ("triviaqa/*",) or list(ctx.params["filenames"]) == ["triviaqa/*"]
