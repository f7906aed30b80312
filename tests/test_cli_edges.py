"""The CLI at its edges (issue 60, items 8, 11 and 10): Ctrl-C in the first half second, the
``help`` and ``version`` commands and ``-V``, output into a pipe that is not folded, piped
``chat`` with its commands, ``--top-p``/``--top-k``/``--stop`` on ``run`` and ``chat``, and
grpclib's INFO line for a client that hung up.

The first tests need no daemon; the last ones use the session daemon (tiny model).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, collect, run_cli, sigint_as_at_a_terminal
from loractl import __version__
from loractl.cli import HELP_ENV

LORACTL = str(BIN / "loractl")
# The console script as pip writes it, with an import hook that stands for a Ctrl-C arriving
# while Typer is imported (the first half second of every command but the fast paths').
INTERRUPTED_IMPORT = """\
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
sys.argv = ["/usr/bin/loractl", "pull", "org/repo"]
from loractl.cli import main
sys.exit(main())
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HELP_ENV}
    return {**env, "NO_COLOR": "1", **extra}


def cli(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([LORACTL, *args], capture_output=True, text=True, env=_env(**env), input=input,
                          timeout=120)


# -- item 8: Ctrl-C, help, version, pipes ---------------------------------------------------------
def test_ctrl_c_while_typer_is_imported_exits_130_with_one_line():
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")


@pytest.mark.parametrize("module", ["typer", "rich.console", "loractl.cli.run"])
def test_a_real_sigint_during_the_imports_exits_130_with_one_line(module):
    """A real SIGINT (the terminal's Ctrl-C), sent while ``module`` is being imported. (Before
    loractl's code runs, Python's own start and pip's script wrapper, about 20 ms of CPU, are
    Python's to report; nothing of loractl's runs there.)"""
    code = INTERRUPTED_IMPORT.replace(
        'if name == "typer":\n            raise KeyboardInterrupt',
        f'if name == {module!r}:\n            import os, signal, time\n'
        '            os.kill(os.getpid(), signal.SIGINT)\n            time.sleep(5)')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120,
                          preexec_fn=sigint_as_at_a_terminal)
    assert (done.returncode, done.stderr) == (130, "interrupted\n"), done.stderr


def test_help_command_is_the_help_option():
    assert cli("help").stdout == cli("--help").stdout != ""
    assert cli("help", "pull").stdout == cli("pull", "--help").stdout
    assert "Usage: loractl registry" not in cli("help", "pull").stdout
    unknown = cli("help", "nosuch")
    assert unknown.returncode == 2 and "No such command 'nosuch'" in unknown.stderr


@pytest.mark.parametrize("argv", [["version"], ["-V"], ["--version"]])
def test_version_three_ways(argv):
    done = cli(*argv)
    assert (done.returncode, done.stdout) == (0, f"loractl {__version__}\n")


def test_output_into_a_pipe_is_not_folded():
    """A pipe or a file with no $COLUMNS gets lines as long as they are (the session's runs set
    COLUMNS=100, which still folds: a width asked for is honoured)."""
    code = ("from loractl.cli._output import stdout\n"
            "stdout.print('sha256:' + 'ab12' * 16 + ' ' + 'x' * 150)\n")
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert piped.stdout == "sha256:" + "ab12" * 16 + " " + "x" * 150 + "\n"
    asked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(COLUMNS="100"),
                           timeout=60)
    assert len(asked.stdout.splitlines()) > 1


def test_ls_into_a_pipe_keeps_a_long_name_on_its_line():
    from loractl.cli import UNWRAPPED
    from loractl.cli.listing import COLUMNS, plain_table

    name = "org/" + "n" * 120
    rows = [(name, "disk", "-", "1.0 KB", "8", "0123456789ab", "-")]
    text = plain_table(rows, ["ready"], (40, 7, 6, 8, 4, 12, 7), UNWRAPPED)
    assert text is not None and len(text.splitlines()) == 2 and text.splitlines()[1].startswith(name + " ")
    assert text.splitlines()[0].split() == list(COLUMNS)


def test_piped_chat_reads_commands_between_messages():
    from loractl.cli.chat import piped_steps

    assert piped_steps("") == [] and piped_steps("\n  \n") == []
    assert piped_steps("Write a query\nthat counts users\n") == [("say", "Write a query\nthat counts users")]
    assert piped_steps("/lora sql-expert/v1\nCount users\n/reset\n/lora\nHi\n/exit\nnot said\n") == [
        ("command", "/lora sql-expert/v1"), ("say", "Count users"), ("command", "/reset"), ("command", "/lora"),
        ("say", "Hi"), ("command", "/exit"), ("say", "not said")]
    # A line that is no in-chat command is text, slash or not.
    assert piped_steps("/etc/hosts holds what?\n") == [("say", "/etc/hosts holds what?")]


def test_an_empty_piped_chat_says_nothing_and_succeeds():
    """No daemon is asked for nothing: exit 0 before any connection... or after it, whichever the
    order, never 1 (this runs without a daemon: the empty input must not need one)."""
    done = cli("chat", "--socket", "/tmp/lct-nothing-here.sock", input="")
    assert done.returncode in (0, 3), done.stderr
    assert "stdin was empty" not in done.stderr


# -- item 11: --top-p, --top-k, --stop ------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "chat"])
def test_run_and_chat_take_top_p_top_k_and_stop(command):
    page = cli(command, "--help", COLUMNS="200").stdout
    for flag in ("--top-p", "--top-k", "--stop"):
        assert f" {flag} " in page, (flag, page)


def test_sampling_kwargs_carry_top_p_top_k_and_stop():
    from loractl.cli._sampling import sampling_kwargs
    from loractl.errors import InvalidRequest

    assert sampling_kwargs(top_p=0.9, top_k=40, stop=[";", "\n\n"]) == {"top_p": 0.9, "top_k": 40,
                                                                        "stop": [";", "\n\n"]}
    assert sampling_kwargs() == {}
    with pytest.raises(InvalidRequest, match="--stop '' is empty"):
        sampling_kwargs(stop=[""])
    assert cli("run", "--top-p", "7", "hi").returncode == 2   # Typer's range, before any request


# -- item 10: grpclib's INFO line for a client that hung up ----------------------------------------
def test_a_client_hanging_up_is_logged_at_debug_not_info(caplog):
    from loractld.api.coalesce import quiet_hang_ups

    logger = logging.getLogger("grpclib.server")
    quiet_hang_ups(logger)
    quiet_hang_ups(logger)
    assert len(logger.filters) == len({type(f) for f in logger.filters})   # installed once
    with caplog.at_level(logging.INFO, logger="grpclib.server"):
        logger.info("Request was cancelled: %s", "Connection lost")
        logger.info("Deadline exceeded")
    assert [r.getMessage() for r in caplog.records] == ["Deadline exceeded"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="grpclib.server"):
        logger.info("Request was cancelled: %s", "Connection lost")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", "Request was cancelled: Connection lost")]


# -- with the session daemon -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def edged(daemon, demo):
    done = run_cli("pull", str(demo / "adapters" / "sql-expert" / "v1"), "--name", "edge-sql/v1",
                   "--socket", str(daemon.socket))
    assert done.returncode == 0, done.stderr
    return daemon


def _generate(daemon, **kwargs) -> dict:
    async def go() -> dict:
        async with daemon.client() as client:
            return await collect(client, **kwargs)
    return asyncio.run(go())


def test_run_stop_top_k_and_top_p_reach_the_engine(edged):
    question = [{"role": "user", "content": "Count the users"}]
    full = _generate(edged, messages=question, lora="edge-sql/v1", temperature=0.0, max_tokens=12)
    assert len(full["ids"]) == 12 and len(full["text"]) > 4, full
    stop = full["text"][3:5]
    stopped = run_cli("run", "--lora", "edge-sql/v1", "-t", "0", "-n", "12", "--stop", stop, "--top-k", "1",
                      "--top-p", "0.5", "Count the users", "--socket", str(edged.socket))
    assert stopped.returncode == 0, stopped.stderr
    expected = _generate(edged, messages=question, lora="edge-sql/v1", temperature=0.0, max_tokens=12, stop=[stop],
                         top_k=1, top_p=0.5)["text"]
    assert stopped.stdout == expected + "\n" and stop not in expected and full["text"].startswith(expected)


def test_piped_chat_switches_adapters_with_lora_and_exits_0_on_empty_input(edged):
    sock = ("--socket", str(edged.socket))
    base = run_cli("chat", "-t", "0", "-n", "6", *sock, input="Count the users\n", timeout=180)
    switched = run_cli("chat", "-t", "0", "-n", "6", *sock, input="/lora edge-sql/v1\nCount the users\n", timeout=180)
    ran = run_cli("run", "--lora", "edge-sql/v1", "-t", "0", "-n", "6", "Count the users", *sock, timeout=180)
    assert base.returncode == switched.returncode == ran.returncode == 0, (base.stderr, switched.stderr)
    assert switched.stdout == ran.stdout != base.stdout
    assert "/lora" not in switched.stdout
    refused = run_cli("chat", *sock, input="/lora edge-sqll/v1\nhi\n", timeout=180)
    assert refused.returncode == 4 and "Did you mean 'edge-sql/v1'" in refused.stderr and refused.stdout == ""
    empty = run_cli("chat", *sock, input="", timeout=180)
    assert (empty.returncode, empty.stdout) == (0, ""), empty.stderr


def test_a_finished_run_leaves_no_info_line_in_the_daemons_log(edged):
    done = run_cli("run", "-n", "2", "hi", "--socket", str(edged.socket))
    assert done.returncode == 0, done.stderr
    time.sleep(0.5)
    assert "Request was cancelled" not in edged.log.read_text(errors="replace")
