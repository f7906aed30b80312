"""``loractl chat`` driven through a pseudo-terminal against the real daemon."""

from __future__ import annotations

import os
import platform
import signal
import sys
import tempfile
import termios
import time

import pexpect

from conftest import BIN, run_cli, sigint_as_at_a_terminal

PROMPT = ">>> "


def spawn_chat(daemon, *args: str) -> pexpect.spawn:
    # SIGINT as at a terminal: a CI run started in the background hands it down ignored.
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "LORACTL_HOME": tempfile.mkdtemp(prefix="lct-chat-")}
    env.pop("LORACTL_SOCKET", None)
    child = pexpect.spawn(str(BIN / "loractl"), ["chat", "--socket", str(daemon.socket), *args], env=env,
                          encoding="utf-8", timeout=60, dimensions=(40, 200), preexec_fn=sigint_as_at_a_terminal)
    child.logfile_read = sys.stderr if os.environ.get("LORACTL_TEST_VERBOSE") else None
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, text: str) -> str:
    """Send one line; return the reply printed before the next prompt."""
    child.sendline(text)
    child.expect_exact(PROMPT)
    out = child.before.replace("\r\n", "\n")
    echoed = text + "\n"
    assert out.startswith(echoed), out
    return out[len(echoed):].removesuffix("\n")


def test_chat_switches_adapter_mid_conversation(daemon, demo, reference):
    assert run_cli("pull", str(demo / "adapters" / "sql-expert" / "v1"), "--name", "chat-sql/v1",
                   "--socket", str(daemon.socket)).returncode == 0
    child = spawn_chat(daemon, "--temperature", "0", "--max-tokens", "16")
    messages = [{"role": "user", "content": "hello"}]
    first = say(child, "hello")
    assert first == reference.text(reference.greedy(reference.messages_ids(messages), None, 16))

    child.sendline("/lora chat-sql/v1")
    child.expect_exact("now answering with chat-sql/v1")
    child.expect_exact(PROMPT)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    second = say(child, "again")
    expected = reference.greedy(reference.messages_ids(messages), demo / "adapters" / "sql-expert" / "v1", 16)
    assert second == reference.text(expected)

    child.sendline("/lora")
    child.expect_exact("now answering with the base model")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    child.expect_exact(PROMPT)
    assert say(child, "hello") == first  # a fresh conversation on the base model again

    child.sendline("/lora chat-sql/v2")  # refused at once, with the name the user may have meant
    child.expect_exact("no adapter named 'chat-sql/v2'")
    child.expect_exact("Did you mean 'chat-sql/v1'?")
    child.expect_exact("still answering with the base model")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact(PROMPT)
    child.sendline('"""')  # a message of several lines, as Ollama reads it: here one line, "hello"
    child.expect_exact("... ")
    child.sendline("hello")
    child.expect_exact("... ")
    child.sendline('"""')
    child.expect_exact(first)  # the base model still answers: the refused /lora changed nothing
    child.expect_exact(PROMPT)

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def _wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _terminal(child: pexpect.spawn) -> str:
    return os.readlink(f"/proc/{child.pid}/fd/1")  # the pty's slave side, /dev/pts/N


def _line_read(child: pexpect.spawn) -> bool:
    """readline has handed the line over: the terminal is back in canonical mode."""
    fd = os.open(_terminal(child), os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        return bool(termios.tcgetattr(fd)[3] & termios.ICANON)
    finally:
        os.close(fd)


def _output_stopped(child: pexpect.spawn) -> bool:
    """The XOFF was processed: a write to the terminal would block (one NUL goes out if not)."""
    fd = os.open(_terminal(child), os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}[platform.machine()]


def _blocked_writing_stdout(child: pexpect.spawn) -> bool:
    with open(f"/proc/{child.pid}/syscall") as f:  # the main thread's: where the chat loop runs
        fields = f.read().split()
    return fields[:2] == [str(WRITE_SYSCALL), "0x1"]


def test_ctrl_c_stops_the_reply_and_keeps_the_session(daemon, reference):
    """Ctrl-C lands while the reply is being written, by construction: the daemon is stopped
    until the terminal holds the chat's output (XOFF), so the reply's first write blocks and
    the turn cannot end before the Ctrl-C, however fast the engine or slow the machine."""
    message = "tell me a long story"
    story = reference.greedy(reference.chat_ids(message), None, 200)
    assert len(story) == 200  # no early EOS: the reply has more to write when Ctrl-C lands
    child = spawn_chat(daemon, "--temperature", "0", "--max-tokens", "200")
    child.delaybeforesend = None
    os.killpg(daemon.proc.pid, signal.SIGSTOP)
    try:
        child.sendline(message)
        child.expect_exact(message + "\r\n")
        _wait_until(lambda: _line_read(child), "readline to give the terminal back")
        child.sendcontrol("s")
        _wait_until(lambda: _output_stopped(child), "the terminal to stop output")
    finally:
        os.killpg(daemon.proc.pid, signal.SIGCONT)
    _wait_until(lambda: _blocked_writing_stdout(child), "the first piece of the reply")
    child.sendintr()  # SIGINT to the chat; with IXON it also restarts the output
    child.expect_exact("(stopped)")
    shown = child.before.replace("\x00", "").replace("^C", "").replace("\r\n", "\n").rstrip("\n")
    assert reference.text(story).startswith(shown), shown  # what was written is the reply's start
    child.expect_exact(PROMPT)
    child.sendline("/help")
    child.expect_exact("/reset")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_reads_stdin_when_not_a_terminal(daemon, reference):
    result = run_cli("chat", "-t", "0", "-n", "12", "--socket", str(daemon.socket), input="Write a query\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference.text(reference.greedy(reference.chat_ids("Write a query"), None, 12)) + "\n"


def test_chat_without_a_daemon(tmp_path):
    result = run_cli("chat", "--socket", "/tmp/lct-none.sock", input="hi")
    assert result.returncode == 3 and "loractld --model demo" in result.stderr


def test_read_message_joins_lines_as_typed():
    from loractl.cli.chat import read_message

    def lines(*more):
        it = iter(more)
        return lambda prompt: next(it)

    assert read_message("hello") == "hello"
    assert read_message("first \\", lines("second")) == "first \nsecond"
    assert read_message('"""', lines("a", "b", '"""')) == "a\nb"
    assert read_message('"""a', lines('b"""')) == "a\nb"
    assert read_message('"""one line"""') == "one line"


def test_a_misspelt_adapter_is_refused_before_the_prompt_opens_with_the_names_meant(daemon, demo):
    """``chat --lora pirat/v1`` opened the prompt before it checked the name; ``run`` suggested
    pulling under the misspelt name beside the name that was meant."""
    assert run_cli("pull", str(demo / "adapters" / "sql-expert" / "v1"), "--name", "chat-sql/v1",
                   "--socket", str(daemon.socket)).returncode == 0
    chat = run_cli("chat", "--lora", "chat-sql/v2", "--socket", str(daemon.socket), input="hello\n")
    assert chat.returncode == 4 and chat.stdout == "", (chat.stdout, chat.stderr)
    assert "no adapter named 'chat-sql/v2'" in chat.stderr and "Did you mean 'chat-sql/v1'?" in chat.stderr
    run = run_cli("run", "--lora", "chat-sql/v2", "hello", "--socket", str(daemon.socket))
    assert run.returncode == 4 and "Did you mean 'chat-sql/v1'?" in run.stderr
    assert "--name chat-sql/v2" not in run.stderr, run.stderr
