"""README and `--help` agree (issue 26 item 8): every command of `stratagem --help` and every option of
`stratagem CMD --help` is named in README.md; the test fails listing what is missing.

`python tests/test_readme_help.py` prints a "Command reference" section for README.md from the same source
(each command's summary and each option's help), to paste when the test fails."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from stratagem.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"


def help_names() -> dict[str, list[str]]:
    """Command -> the long options its --help lists (hidden ones and --help left out), from the typer app."""
    group = typer.main.get_command(app)  # typer's own click (vendored in newer typer): read it by attribute
    out: dict[str, list[str]] = {}
    for name, cmd in sorted(group.commands.items()):  # type: ignore[attr-defined]
        if cmd.hidden:
            continue
        opts = []
        for p in cmd.params:
            if p.param_type_name == "option" and not getattr(p, "hidden", False):
                opts += [o for o in (*p.opts, *p.secondary_opts) if o.startswith("--") and o != "--help"]
        out[name] = opts
    return out


def missing_from_readme(text: str) -> list[str]:
    """'stratagem CMD' and 'stratagem CMD --OPTION' for each command or option README.md does not name: a
    command as `stratagem CMD`, an option anywhere as --OPTION (a whole word)."""
    missing = []
    for name, opts in help_names().items():
        if not re.search(rf"stratagem {re.escape(name)}\b", text):
            missing.append(f"stratagem {name}")
        for opt in opts:
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                missing.append(f"stratagem {name} {opt}")
    return missing


def test_every_command_and_option_is_in_the_readme() -> None:
    missing = missing_from_readme(README.read_text(encoding="utf-8"))
    assert not missing, "README.md does not name:\n" + "\n".join(missing)


def test_the_check_sees_commands_and_options() -> None:
    names = help_names()
    assert "search" in names and "--real-runs" in names["search"] and "compare" in names
    assert missing_from_readme("") and "stratagem search --real-runs" in missing_from_readme("")
    assert "stratagem search" not in missing_from_readme("stratagem search")


def test_the_cluster_section_names_only_options_its_commands_take() -> None:
    """Issue 36 item 5: "Overnight on a cluster" named --checkpoint-dir and --step-budget-s, which `search`
    rejects. Each option it names is one of `stratagem search` or `status` (the commands it documents), or
    of `ray job submit` in its example command."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## Overnight on a cluster")
    section = text[start:text.index("\n## ", start + 1)]
    names = help_names()
    taken = {*names["search"], *names["status"], "--address", "--working-dir"}  # the last two: ray job submit's
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", section))
    assert named and not named - taken, f"options search and status do not take: {sorted(named - taken)}"


def reference() -> str:
    """README's command reference: each command with its arguments, summary and options, from --help."""
    group = typer.main.get_command(app)
    lines = ["## Command reference", "",
             "Every command and option, as `stratagem CMD --help` states them (tests/test_readme_help.py fails when "
             "one is missing here).", ""]
    for name, cmd in sorted(group.commands.items()):  # type: ignore[attr-defined]
        if cmd.hidden:
            continue
        args = " ".join(p.name.upper() + ("..." if p.nargs == -1 else "") for p in cmd.params
                        if p.param_type_name == "argument")
        summary = " ".join((cmd.help or "").split("\n\n")[0].split())
        lines.append(f"- `{f'stratagem {name} {args}'.strip()}`: {summary}")
        for p in cmd.params:
            names = [o for o in (*p.opts, *p.secondary_opts) if o != "--help"]
            if p.param_type_name == "option" and names and not getattr(p, "hidden", False):
                lines.append(f"  - `{' / '.join(names)}`: {' '.join((p.help or '').split())}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
