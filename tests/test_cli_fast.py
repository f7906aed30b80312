"""The CLI's fast paths (``loractl.cli.main``) print exactly what the Typer app prints.

No engine: the help checks need nothing, the ``ls`` checks talk to a stub gRPC server that
answers List with a canned reply.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from loractl.cli import HELP_ENV

# Run as the console script does: argv[0] is the script's path, the entry is loractl.cli.main.
MAIN = "import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli import main\nmain()\n"
TYPER = "import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli.app import app\napp()\n"
REPORT = "\nimport atexit\natexit.register(lambda: print('TYPER', 'typer' in sys.modules, file=sys.stderr))\n"


def run(template: str, argv: list[str], env: dict[str, str] | None = None, prog: str = "/usr/bin/loractl",
        report: str = REPORT):
    base = {k: v for k, v in os.environ.items() if k not in HELP_ENV}
    code = report + template.format(prog=prog, argv=argv)
    return subprocess.run([sys.executable, "-c", code], env={**base, **(env or {})}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, encoding="utf-8", timeout=120)


def test_help_module_is_current():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_help.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stderr}{done.stdout}"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "bare"])
def test_fast_help_is_typers_page_without_typer(argv):
    fast, typer = run(MAIN, argv), run(TYPER, argv)
    assert "TYPER False" in fast.stderr, "the help fast path was not taken (or imported Typer)"
    assert "TYPER True" in typer.stderr
    assert (fast.stdout, fast.returncode) == (typer.stdout, typer.returncode)
    assert "Usage: loractl [OPTIONS] COMMAND [ARGS]..." in fast.stdout


@pytest.mark.parametrize("env, prog", [({"COLUMNS": "100"}, "/usr/bin/loractl"), ({"FORCE_COLOR": "1"}, "/usr/bin/loractl"),
                                       ({}, "/usr/bin/lctl")], ids=["columns", "force-color", "other-name"])
def test_help_that_would_differ_goes_through_typer(env, prog):
    fast, typer = run(MAIN, ["--help"], env, prog), run(TYPER, ["--help"], env, prog)
    assert "TYPER True" in fast.stderr, "the fast path printed a page rendered for other conditions"
    assert fast.stdout == typer.stdout


def test_help_env_names_every_variable_typer_and_rich_read():
    """A Typer or rich upgrade that reads a new variable must be classified here, or the fast
    path could print a stale page when it is set."""
    # Read by them, but with no effect on a page going into a pipe (colours and terminal
    # type matter only on a terminal; LINES only sets the height; help never pages).
    harmless = {"NO_COLOR", "COLORTERM", "TERM", "LINES", "XDG_CONFIG_HOME", "PYDANTIC_DISABLE_PLUGINS",
                "COMP_WORDS", "COMP_CWORD", "TYPER_STANDARD_TRACEBACK", "_TYPER_STANDARD_TRACEBACK",
                "PAGER", "LESS"}
    read = set()
    for package in ("typer", "rich", "click"):
        try:
            root = Path(__import__(package).__file__).parent
        except ImportError:
            continue
        for source in root.rglob("*.py"):
            text = source.read_text(encoding="utf-8", errors="replace")
            read |= set(re.findall(r"""(?:environ\b[^\n]{0,20}?|getenv\()\s*[\[(.]?(?:get\()?\s*["']([A-Z_][A-Z0-9_]*)["']""",
                                   text))
    read = {name for name in read if not name.startswith("_TYPER_COMPLETE")}
    assert {"COLUMNS", "FORCE_COLOR", "TERMINAL_WIDTH"} <= read, f"the scan found too little: {sorted(read)}"
    unclassified = read - HELP_ENV - harmless
    assert not unclassified, f"classify in loractl.cli.HELP_ENV or here: {sorted(unclassified)}"


# --- loractl ls -------------------------------------------------------------------------------

# The reference: loractl ls as before the fast paths, through Typer, the async Client and rich.
SLOW_LS = ("import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli import listing\n"
           "listing._quick_table = lambda socket, home: None\nlisting._plain_width = lambda: None\n"
           "from loractl.cli.app import app\napp()\n")
LS_REPORT = ("import sys\nimport atexit\natexit.register(lambda: print('LOADED', sorted({m for m in sys.modules "
             "if m in ('asyncio', 'grpclib.client', 'rich', 'typer', 'platformdirs')}), file=sys.stderr))\n")


def adapter(name: str, **fields):
    base = dict(name=name, source="local", revision="sha256:" + "ab12" * 16, base_model="demo", rank=8, alpha=16.0,
                size_bytes=282_500, state="ready", tier="disk", slot=-1, target_modules=["q_proj"], requests=3)
    return {**base, **fields}


ADAPTERS = {
    "four": [adapter(f"demo/adapter-{i}", tier=("device", "host", "disk", "disk")[i], pinned=i == 1, rank=4 << i)
             for i in range(4)],
    "states": [adapter("x/failed", state="failed"), adapter("x/loading", state="loading", last_used=1.0),
               adapter("x/checking", state="checking")],
    "long-name": [adapter("org/" + "n" * 60)],
    "hand-placed-odd-name": [adapter("Odd [name]:x:", hand_placed=True)],
    "empty": [],
    # ~200 KB: past HTTP/2's initial 64 KiB window, which the quick client opens at once
    "many": [adapter(f"bulk/adapter-{i:04d}", tier="disk") for i in range(1000)],
}


STUB_SERVER = """
import asyncio, sys
from pathlib import Path
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from loractl.v1 import loractl_grpc, loractl_pb2 as pb
sys.path.insert(0, {tests!r})
from test_cli_fast import ADAPTERS

async def list_(self, stream):
    await stream.recv_message()
    case = Path({case!r}).read_text()
    if case == "error":
        raise GRPCError(Status.NOT_FOUND, "no such thing")
    await stream.send_message(pb.ListReply(adapters=[pb.Adapter(**a) for a in ADAPTERS[case]]))

async def unimplemented(self, stream):
    raise GRPCError(Status.UNIMPLEMENTED)

async def main():
    methods = dict.fromkeys(loractl_grpc.LoractlBase.__abstractmethods__, unimplemented)
    server = Server([type("Stub", (loractl_grpc.LoractlBase,), {{**methods, "List": list_}})()])
    await server.start(path={socket!r})
    print("up", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def stub_daemon():
    """A grpclib server on a Unix socket whose List answers ADAPTERS[the case in a file]
    (own process: the CLI's subprocesses call it while the test waits)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="lct-fast-", dir="/tmp"))
    socket, case = root / "d.sock", root / "case"
    code = STUB_SERVER.format(tests=str(REPO / "tests"), case=str(case), socket=str(socket))
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        yield socket, case
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", ["four", "many", "empty", "error"])
def test_quick_unary_call_returns_the_servers_message_or_none(stub_daemon, case):
    """loractl.cli._quick frames HTTP/2 itself: the reply's bytes exactly (any size), None for a
    gRPC error (the full client then reports it), None for no daemon at all."""
    from loractl.cli import _quick
    from loractl.v1 import loractl_pb2 as pb

    socket, case_file = stub_daemon
    case_file.write_text(case)
    answer = _quick.unary(str(socket), "/loractl.v1.Loractl/List", pb.ListRequest().SerializeToString())
    if case == "error":
        assert answer is None
    else:
        assert pb.ListReply.FromString(answer) == pb.ListReply(adapters=[pb.Adapter(**a) for a in ADAPTERS[case]])
    assert _quick.unary(str(socket) + ".absent", "/loractl.v1.Loractl/List", b"") is None


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
@pytest.mark.parametrize("case", [*ADAPTERS, "error"])
def test_fast_ls_prints_what_the_client_and_rich_print(stub_daemon, case, json_flag):
    socket, case_file = stub_daemon
    case_file.write_text(case)
    argv = ["ls", *json_flag, "--socket", str(socket)]
    fast, slow = run(MAIN, argv, report=LS_REPORT), run(SLOW_LS, argv, report=LS_REPORT)
    assert (fast.stdout, fast.returncode) == (slow.stdout, slow.returncode)
    assert fast.stderr.split("LOADED")[0] == slow.stderr.split("LOADED")[0]
    # A table wider than the 80 columns is cut by rich, which then does the printing.
    if case in ("four", "states") or (case == "long-name" and json_flag):
        assert fast.returncode == 0 and fast.stdout.strip()
        assert "LOADED []" in fast.stderr, "the fast path loaded asyncio, grpclib's client, rich or Typer"
    if case == "error":
        assert fast.returncode != 0 and "no such thing" in fast.stderr


def test_fast_ls_without_a_daemon_reports_what_the_client_reports(tmp_path):
    argv = ["ls", "--socket", str(tmp_path / "none.sock")]
    fast, slow = run(MAIN, argv), run(SLOW_LS, argv)
    assert fast.returncode == slow.returncode == 3, fast.stderr
    assert fast.stderr.split("TYPER")[0] == slow.stderr.split("TYPER")[0]
    assert "no loractl daemon is listening" in fast.stderr


@pytest.mark.parametrize("width", [40, 62, 80, 200])
def test_plain_table_is_rich_table_or_none(width):
    import io
    import random

    from rich.console import Console
    from rich.table import Table

    from loractl.cli.listing import COLUMNS, plain_table

    rng = random.Random(width)
    checked = folded = 0
    for _ in range(60):
        rows = [(rng.choice(["a/b", "sql-expert/v1", "x" * rng.randint(1, 50)]), rng.choice(["disk", "host", "device"]),
                 rng.choice(["-", "host", "device"]), f"{rng.random() * 999:.1f} KB", str(rng.choice([4, 16, 128])), "0123456789ab",
                 rng.choice(["-", "5s ago", "12d ago"])) for _ in range(rng.randint(1, 4))]
        states = [rng.choice(["ready", "ready", "failed", "loading", "checking"]) for _ in rows]
        min_widths = (min(40, max(len(r[0]) for r in rows)), 7, 6, 8, 4, 12, 7)
        console = Console(file=io.StringIO(), width=width, highlight=False, color_system=None)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for header, min_width in zip(COLUMNS, min_widths):
            table.add_column(header, no_wrap=True, min_width=min_width)
        for row, state in zip(rows, states):
            table.add_row(row[0], {"failed": "[red]failed[/]", "loading": "[yellow]loading[/]",
                                   "checking": "[yellow]checking[/]"}.get(state, row[1]), *row[2:])
        console.print(table)
        plain = plain_table(rows, states, min_widths, width)
        if plain is not None:
            assert plain == console.file.getvalue(), (rows, states)
            checked += 1
    # Each width must exercise the plain renderer (40 columns can fit no row: it must decline).
    assert checked > 0 if width > 40 else checked == 0


# --- status, ps, show: the daemon found in the registry, as typed ------------------------------

SLOW_READS = ("import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli import _quick\n"
              "_quick.reply = lambda *args: None\nfrom loractl.cli.app import app\napp()\n")
READS_REPORT = ("import sys\nimport atexit\natexit.register(lambda: print('LOADED', sorted({m for m in sys.modules "
                "if m in ('asyncio', 'grpclib.client', 'typer', 'loractl.registry', 'loractl.client')}), "
                "file=sys.stderr))\n")
_MOVING = re.compile(r"uptime|age_s|waited_s|last_used|\d+s ago")


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["ps"], ["ps", "--json"], ["show", "nosuch/v1"]])
def test_everyday_reads_as_typed_find_the_daemon_quickly_and_print_what_typer_prints(daemon, home, argv):
    """No --socket: the registry under LORACTL_HOME names the daemon; read without asyncio,
    grpclib, Typer or the registry module, and printed as the Typer command prints it."""
    env = {"LORACTL_HOME": str(home), "NO_COLOR": "1"}
    fast, slow = run(MAIN, argv, env=env, report=READS_REPORT), run(SLOW_READS, argv, env=env, report=READS_REPORT)
    same = [ln for ln in fast.stdout.splitlines() if not _MOVING.search(ln)]
    assert (same, fast.returncode) == ([ln for ln in slow.stdout.splitlines() if not _MOVING.search(ln)],
                                       slow.returncode), (fast.stderr, slow.stderr)
    assert fast.stderr.split("LOADED")[0] == slow.stderr.split("LOADED")[0]
    if argv[0] == "show":  # an error: reported by the full client, as always
        assert fast.returncode != 0 and "no adapter named 'nosuch/v1'" in fast.stderr, fast.stderr
    else:
        assert fast.returncode == 0 and "LOADED []" in fast.stderr, fast.stderr
        assert "loractl.registry" in slow.stderr and "LOADED []" not in slow.stderr


def test_the_quick_registry_read_skips_what_the_full_one_would_question(tmp_path, monkeypatch):
    """Only the plain case: one ready instance in a folder only this user can write."""
    from loractl.cli._quick_registry import discovered_socket
    from loractl.registry import ServiceRegistry

    monkeypatch.delenv("LORACTL_INSTANCE", raising=False)
    registry = ServiceRegistry(home=str(tmp_path))
    assert discovered_socket(str(tmp_path)) is None                      # no daemon
    first = registry.register_instance("loractl", "loractld", metadata={"socket": "/x/a.sock"})
    first.set_ready(True)
    assert discovered_socket(str(tmp_path)) == "/x/a.sock"
    second = registry.register_instance("loractl", "loractld", metadata={"socket": "/x/b.sock"})
    second.set_ready(True)
    assert discovered_socket(str(tmp_path)) is None                      # two: Client decides
    second.close()
    assert discovered_socket(str(tmp_path)) == "/x/a.sock"
    folder = tmp_path / "registry" / "loractl" / "loractld"
    folder.chmod(0o777)
    assert discovered_socket(str(tmp_path)) is None                      # others could write entries
    folder.chmod(0o700)
    monkeypatch.setenv("LORACTL_INSTANCE", first.instance_id())
    assert discovered_socket(str(tmp_path)) is None                      # --instance: Client decides
    monkeypatch.delenv("LORACTL_INSTANCE")
    first.close()
    assert discovered_socket(str(tmp_path)) is None                      # its lock is gone: dead


@pytest.mark.parametrize("width", [30, 60, 80, 200])
def test_plain_pairs_is_rich_key_value_table_or_none(width):
    """status and show print their key/value tables without rich into a pipe: exactly rich's text."""
    import io
    import random

    from rich.console import Console
    from rich.table import Table

    from loractl.cli._reads import plain_pairs

    rng = random.Random(width)
    checked = folded = 0
    for _ in range(80):
        rows = [(rng.choice(["state", "model folder", "kv cache"]),
                 rng.choice(["ready", "3 used, 1 free (host pins 0/2)", "/tmp/x/models/gguf-b179c9523d0e6a0f98a330c7",
                             "http://127.0.0.1:8000/v1 (OpenAI-compatible)", "a [b] c", ":smile: x", "sha256:3dfd1c9b…",
                             "x" * rng.randint(1, 90), "/tmp/lct/adapters/.objects/" + "ab12" * rng.randint(1, 40)]))
                for _ in range(rng.randint(1, 5))]
        for fold in (False, True):
            text = plain_pairs(rows, width, fold)
            if text is None:
                continue
            checked += 1
            table = Table(show_header=False, box=None, pad_edge=False)
            table.add_column(style="bold")
            table.add_column(overflow="fold" if fold else "ellipsis")
            for key, value in rows:
                table.add_row(key, value)
            out = io.StringIO()
            Console(file=out, width=width, highlight=False, color_system=None).print(table)
            assert text == out.getvalue(), (rows, width, fold)
            folded += fold and text.count("\n") > len(rows)
    assert checked >= 2
    assert width not in (60, 80) or folded >= 5   # show's long revision and path are printed without rich
