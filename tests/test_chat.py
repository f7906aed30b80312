"""``loractl chat`` driven through a pseudo-terminal against the real daemon."""

from __future__ import annotations

import os
import sys
import tempfile

import pexpect

from conftest import BIN, run_cli

PROMPT = ">>> "


def spawn_chat(daemon, *args: str) -> pexpect.spawn:
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "LORACTL_HOME": tempfile.mkdtemp(prefix="lct-chat-")}
    env.pop("LORACTL_SOCKET", None)
    child = pexpect.spawn(str(BIN / "loractl"), ["chat", "--socket", str(daemon.socket), *args], env=env,
                          encoding="utf-8", timeout=60, dimensions=(40, 200))
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

    child.sendline("/lora no-such/v1")
    child.expect_exact(PROMPT)
    child.sendline("hi")
    child.expect_exact("no adapter named 'no-such/v1'")
    child.expect_exact(PROMPT)  # the session survives a failed turn

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_session(daemon, reference):
    story = reference.greedy(reference.chat_ids("tell me a long story"), None, 200)
    assert len(story) == 200  # no early EOS: the reply is still streaming when Ctrl-C lands
    child = spawn_chat(daemon, "--temperature", "0", "--max-tokens", "200")
    child.sendline("tell me a long story")
    child.expect_exact(reference.text(story[:3]))
    child.sendintr()
    child.expect_exact("(stopped)")
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
