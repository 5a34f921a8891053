"""Every ``hf ...`` command in the docs parses with the Hugging Face Hub client that verl installs
(huggingface_hub 1.x), through that client's own click parser, without touching the network.

huggingface_hub 1.x removed ``huggingface-cli`` (it exits 1) and its ``hf download`` takes one
pattern per ``--include``: ``--include "a/*" "b/*"`` parses, but ``"b/*"`` becomes a positional
filename and the client then ignores ``--include`` altogether. Both are rejected here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("docs/quickstart.md", "docs/retrieval.md")
SEPARATORS = {";", "&&", "||", "|", "&"}


def shell_commands(markdown: str) -> list[list[str]]:
    """Simple commands (argv lists) of every ```bash block: continuations joined, comments dropped,
    split at ``;``, ``&&``, ``||``, ``|``, ``&``; leading ``VAR=value`` assignments removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError:  # a quoted string spans lines: read on
                continue
            pending = ""
            current: list[str] = []
            for token in [*tokens, ";"]:
                if token in SEPARATORS:
                    while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                        current.pop(0)
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(token)
    return commands


def hub_commands(markdown: str) -> list[list[str]]:
    return [argv for argv in shell_commands(markdown) if argv[0] in ("hf", "huggingface-cli")]


def check_hub_command(argv: list[str]) -> dict:
    """Parse ``argv`` with the installed ``hf`` app; return the parsed parameters or raise ValueError."""
    import click
    from huggingface_hub.cli.hf import app

    text = shlex.join(argv)
    if argv[0] != "hf":
        raise ValueError(f"{text}: `{argv[0]}` no longer works with huggingface_hub>=1.0; use `hf`")
    if len(argv) < 3:
        raise ValueError(f"{text}: no subcommand arguments")
    command = app.get_command(click.Context(app, info_name="hf"), argv[1])
    if command is None:
        raise ValueError(f"{text}: `hf` has no subcommand {argv[1]!r}")
    command = getattr(command, "materialize", lambda: command)()
    try:
        params = command.make_context(argv[1], argv[2:]).params
    except click.UsageError as exc:
        raise ValueError(f"{text}: {exc.format_message()}") from exc
    except click.exceptions.Exit as exc:  # no_args_is_help and friends print help and exit
        raise ValueError(f"{text}: the client printed its help instead of parsing") from exc
    if argv[1] == "download":
        files = [f for f in params.get("filenames") or () if not f.endswith("/")]
        if files and (params.get("include") or params.get("exclude")):
            raise ValueError(
                f"{text}: positional {files} make `hf download` ignore --include/--exclude "
                "(give each pattern its own --include)"
            )
    return params


def test_the_checker_rejects_what_the_installed_client_rejects_or_ignores():
    with pytest.raises(ValueError, match="no longer works"):
        check_hub_command(["huggingface-cli", "download", "org/repo"])
    with pytest.raises(ValueError, match="ignore --include"):
        check_hub_command(["hf", "download", "org/data", "--repo-type", "dataset", "--include", "nq/*", "hotpotqa/*"])
    with pytest.raises(ValueError, match="repo-type"):
        check_hub_command(["hf", "download", "org/data", "--repo-type", "datasets"])
    with pytest.raises(ValueError, match="No such option"):
        check_hub_command(["hf", "download", "org/data", "--local_dir", "x"])
    with pytest.raises(ValueError, match="no subcommand"):
        check_hub_command(["hf", "downlaod", "org/data"])
    params = check_hub_command(
        ["hf", "download", "org/data", "--repo-type", "dataset", "--include", "nq/*", "--include", "hotpotqa/*"]
    )
    assert params["include"] == ("nq/*", "hotpotqa/*") and params["repo_type"] == "dataset"


def test_shell_commands_split_blocks_as_bash_does():
    block = '```bash\nA=1 hf download x/y \\\n    --include "a b/*" && echo hi; hf download z/w # c\n```\n'
    assert shell_commands(block) == [
        ["hf", "download", "x/y", "--include", "a b/*"],
        ["echo", "hi"],
        ["hf", "download", "z/w"],
    ]
    multi_line_quote = "```bash\npython -c '\nimport x\nprint(1)\n' > f\nhf download a/b\n```\n"
    assert shell_commands(multi_line_quote) == [
        ["python", "-c", "\nimport x\nprint(1)\n", ">", "f"],
        ["hf", "download", "a/b"],
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_hub_command_parses_with_the_installed_client(doc):
    commands = hub_commands((REPO / doc).read_text())
    assert commands, f"{doc}: no hf commands found"
    errors = []
    for argv in commands:
        try:
            check_hub_command(argv)
        except ValueError as exc:
            errors.append(str(exc))
    assert not errors, f"{doc}:\n" + "\n".join(errors)
