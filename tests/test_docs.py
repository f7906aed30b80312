"""The documentation artifacts stay true to the code: completions, man pages, help, packaging.

No daemon, no engine: everything here reads the CLI's Typer app, the daemon's argparse parser,
and the files in man/ and completions/.
"""

from __future__ import annotations

import enum
import re
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from loractl import __version__
from loractl.cli.app import app

REPO = Path(__file__).resolve().parent.parent
MAN_PAGES = ("loractl.1", "loractld.8")
# Typer's own options: documented once under OPTIONS, not required per command.
TYPER_OWN = {"--install-completion", "--show-completion", "--help"}


def man_text(name: str) -> str:
    """The page's source with roff's escaped hyphens (\\-) made plain, ready to search."""
    return (REPO / "man" / name).read_text().replace("\\-", "-")


def mentions(page: str, option: str) -> bool:
    """``option`` appears in ``page`` as a whole flag (--to is not found inside --top)."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", page) is not None


def commands(command=None, path: tuple[str, ...] = ()):
    """Every (path, click command) of the CLI, groups included, depth first."""
    command = command or typer.main.get_command(app)
    yield path, command
    for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
        yield from commands(sub, path + (name,))


def choices(param) -> list[str]:
    """The values an option accepts, when it names them (an Enum or Literal annotation)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return [str(member.value) for member in candidate]
        if typing.get_origin(candidate) is typing.Literal:
            return [str(value) for value in typing.get_args(candidate)]
    return []


def test_completions_are_current():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_completions.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{done.stderr}{done.stdout}run: python scripts/gen_completions.py"


def test_the_module_lists_are_current():
    """docs/architecture.md's "Every module" and the README's daemon layout are written from the
    tree (scripts/gen_architecture.py): a module added, renamed or removed shows in both."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_architecture.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{done.stderr}{done.stdout}"


def test_the_module_list_check_would_see_a_new_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_architecture", REPO / "scripts" / "gen_architecture.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    found = gen.modules()
    assert ("store/known", gen.first_sentence((REPO / "daemon/loractld/store/known.py").read_text().split('"""')[1])) \
        in found["store"]
    found["store"].append(("store/planted", "A module nobody listed."))
    pages = gen.render(found)
    assert "`store/planted`" in pages[gen.ARCHITECTURE] and "planted" in pages[gen.README]
    assert pages[gen.ARCHITECTURE] != gen.ARCHITECTURE.read_text()


@pytest.mark.parametrize("page", MAN_PAGES)
def test_man_page_lints_clean(page):
    groff = shutil.which("groff")
    if groff is None:
        pytest.fail("groff is not installed, so the man pages cannot be linted: "
                    "install it with `apt-get install -y groff-base`")
    done = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z", str(REPO / "man" / page)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", f"groff warnings in man/{page}:\n{done.stderr}"


@pytest.mark.parametrize("page", MAN_PAGES)
def test_man_page_names_the_current_version(page):
    th = next(line for line in man_text(page).splitlines() if line.startswith(".TH "))
    assert f'"loractl {__version__}"' in th, f"man/{page}: update the version in {th!r}"


def test_every_command_and_option_is_in_the_loractl_page():
    page = man_text("loractl.1")
    missing = []
    for path, command in commands():
        if path:
            # An entry of its own (.B pull, .SS "registry ls" ...), not just the word somewhere.
            words = r"\s+".join(re.escape(p) for p in path)
            if not re.search(rf'^\.(?:B|SS)\s+"?(?:loractl\s+)?(?:{words}|{re.escape(path[-1])})\b', page, re.M):
                missing.append(f"command {' '.join(path)} (a '.B {path[-1]}' entry under COMMANDS)")
        for param in command.params:
            if param.param_type_name != "option":
                continue
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--") and opt not in TYPER_OWN and not mentions(page, opt):
                    missing.append(f"option {opt} of {' '.join(('loractl',) + path)}")
            for value in choices(param):
                if not mentions(page, value):
                    missing.append(f"value {value} of {param.opts[0]} of {' '.join(('loractl',) + path)}")
    assert not missing, "man/loractl.1 lacks:\n  " + "\n  ".join(missing)


def test_loractl_page_documents_chat():
    """chat may land after this page: its entry, options and in-chat commands are checked as written."""
    page = man_text("loractl.1")
    entry = re.search(r"^\.B chat\n(.*?)^\.S[SH] ", page, re.M | re.S)
    assert entry, "man/loractl.1 has no '.B chat' entry under COMMANDS"
    for word in ("--lora", "-l", "--system", "--max-tokens", "-n", "--temperature", "-t",
                 "/lora", "/reset", "/help", "/exit"):
        assert mentions(entry.group(1), word), f"the chat entry of man/loractl.1 lacks {word}"


def test_every_flag_is_in_the_loractld_page():
    from loractld.main import build_parser

    page = man_text("loractld.8")
    missing = []
    for action in build_parser()._actions:
        missing += [f"flag {opt}" for opt in action.option_strings if not mentions(page, opt)]
        missing += [f"value {c} of {action.option_strings[0]}" for c in action.choices or () if not mentions(page, c)]
    assert not missing, "man/loractld.8 lacks:\n  " + "\n  ".join(missing)


@pytest.mark.parametrize("section", ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "ENVIRONMENT", "FILES",
                                     "EXIT STATUS", "EXAMPLES", "SEE ALSO"])
def test_man_pages_have_the_usual_sections(section):
    for page in MAN_PAGES:
        assert re.search(rf'^\.SH "?{section}"?$', man_text(page), re.M), f"man/{page} has no {section} section"


def test_every_exit_status_of_the_readme_is_in_the_loractl_page():
    readme = (REPO / "README.md").read_text()
    codes = re.findall(r"^\| (\d+) \|", readme, re.M)
    assert codes, "README.md has no exit-code table"
    page = man_text("loractl.1")
    status = page.split(".SH EXIT STATUS", 1)[1].split(".SH ", 1)[0]
    missing = [c for c in codes if not re.search(rf"^\.B {c}$", status, re.M)]
    assert not missing, f"EXIT STATUS of man/loractl.1 lacks {missing}"


def _help_params():
    for path, _ in commands():
        yield pytest.param(path, id=" ".join(path) or "loractl")


@pytest.mark.parametrize("path", list(_help_params()))
def test_every_help_page_renders(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"NO_COLOR": "1", "COLUMNS": "100"})
    assert result.exception is None and result.exit_code == 0, f"{result.exception!r}\n{result.output}"


def test_every_command_has_help_with_examples_and_every_option_help():
    lacking = []
    for path, command in commands():
        if not path:
            continue
        if "Examples:" not in (command.help or ""):
            lacking.append(f"loractl {' '.join(path)}: no 'Examples:' in its help")
        lacking += [f"loractl {' '.join(path)} {p.opts[0]}: no help text" for p in command.params if not getattr(p, "help", None)]
    assert not lacking, "\n".join(lacking)


def test_the_wheel_installs_the_man_pages_and_completions():
    shared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
        "shared-data"]
    assert shared == {
        "man/loractl.1": "share/man/man1/loractl.1",
        "man/loractld.8": "share/man/man8/loractld.8",
        "completions/loractl.bash": "share/bash-completion/completions/loractl",
        "completions/_loractl": "share/zsh/site-functions/_loractl",
        "completions/loractl.fish": "share/fish/vendor_completions.d/loractl.fish",
    }
    assert all((REPO / source).is_file() for source in shared)


def test_the_readmes_first_modelfile_runs_against_the_tours_demo_daemon():
    """Issue 60, item 5: the README's profiles example, pasted during the tour (``loractld --model
    demo``, the demo's two adapters pulled), names only what that daemon has: the base model by
    its --model argument and the demo's adapters; its Modelfile parses."""
    from loractld.models.demo import ADAPTERS
    from loractld.store.modelfile import parse

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Profiles and merges"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```\n")]
    modelfile = block[block.index("<<'MODELFILE'\n") + len("<<'MODELFILE'\n"):block.index("\nMODELFILE\n")]
    m = parse(modelfile)
    assert m.base == "demo" and {name for name, _ in m.adapters} <= set(ADAPTERS), m
    merge = next(line for line in block.splitlines() if line.startswith("loractl merge "))
    assert {term.partition("=")[0] for term in merge.split("#")[0].split()[3:]} <= set(ADAPTERS), merge


def test_max_lora_ranks_default_is_the_same_in_help_and_man_page():
    """Issue 60, item 10: the man page said 16 where --help says the installed adapters' largest."""
    from loractld.main import build_parser

    action = next(a for a in build_parser()._actions if "--max-lora-rank" in a.option_strings)
    assert action.default is None and "largest" in action.help and "at least 16" in action.help
    page = man_text("loractld.8")
    entry = page[page.index('.BI --max-lora-rank " R"'):]
    entry = entry[:entry.index(".TP")]
    assert "(default: 16)" not in entry and "largest installed rank, at least 16" in " ".join(entry.split()), entry
