"""``loractl chat``: a multi-turn conversation, with the adapter switchable mid-conversation."""

from __future__ import annotations

import asyncio
import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from loractl import paths
from loractl.cli import _sampling as opts
from loractl.cli._common import HomeOpt, SocketOpt, stderr
from loractl.cli._output import cli_errors, print_error, styled, waiting_notice
from loractl.cli.run import ENGINE_START_TIMEOUT_S
from loractl.cli._complete import adapter_names
from loractl.errors import AdapterNotFound, LoractlError

if TYPE_CHECKING:
    from loractl.client import Client

HELP = """\
/lora NAME   answer with adapter NAME from now on (the conversation is kept);
             NAME is checked at once, and the adapter stays as it was if it is unknown
/lora        back to the base model
\"\"\"          start or end a message of several lines (a line ending in \\ also continues)
/reset       forget the conversation (keeps the adapter and system prompt)
/help        this help
/exit        leave (also /quit, /bye, Ctrl-D); Ctrl-C stops the current reply"""


class Conversation:
    """The messages so far and the adapter that answers; plain data, easy to test."""

    def __init__(self, system: str | None, lora: str | None) -> None:
        self.system = system
        self.lora = lora
        self.turns: list[dict[str, str]] = []

    def messages(self, user_text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + [{"role": "user", "content": user_text}]

    def record(self, user_text: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]


async def _reply(client: Client, convo: Conversation, text: str, sampling: dict, echo: bool) -> str:
    """``sampling``: :meth:`Client.generate`'s sampling keyword arguments, the same every turn."""
    parts: list[str] = []
    try:
        async for chunk in client.generate(messages=convo.messages(text), lora=convo.lora, **sampling):
            if chunk.text:
                parts.append(chunk.text)
                if echo:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
    finally:
        # An interrupted reply is kept as far as it went, like a person cut off mid-sentence.
        convo.record(text, "".join(parts))
    return "".join(parts)


def _enable_line_editing(home: str | None) -> None:
    try:
        import readline
    except ImportError:  # not every Python has it; input() still works
        return
    history = paths.layout(home).state_dir / "chat_history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
        readline.set_history_length(1000)
        import atexit

        atexit.register(_save_history, readline, history)
    except OSError:
        pass


def _save_history(readline, history: Path) -> None:
    try:
        readline.write_history_file(history)
    except OSError:
        pass


def chat(
    lora: Annotated[str | None, typer.Option("--lora", "-l", help="Adapter or profile to start with (store name or folder).",
                                             autocompletion=adapter_names)] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", "-n", min=1, help="Most tokens per reply (default: 512, fewer where the context ends first).",
    )] = None,
    temperature: opts.TemperatureOpt = None,
    top_p: opts.TopPOpt = None,
    top_k: opts.TopKOpt = None,
    stop: opts.StopOpt = None,
    min_p: opts.MinPOpt = None,
    presence_penalty: opts.PresencePenaltyOpt = None,
    frequency_penalty: opts.FrequencyPenaltyOpt = None,
    repetition_penalty: opts.RepetitionPenaltyOpt = None,
    logit_bias: opts.LogitBiasOpt = None,
    stop_token_ids: opts.StopTokenIdsOpt = None,
    ignore_eos: opts.IgnoreEosOpt = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
) -> None:
    """Chat with the base model or an adapter; switch adapters mid-conversation with /lora.

    In a terminal: line editing and history, /help lists the in-chat commands, Ctrl-C stops
    the current reply. With stdin not a terminal, reads stdin and prints only the replies, so
    it scripts well: its lines up to a command (/lora NAME, /reset, /exit) are one message.

    Examples:

        loractl chat --lora sql-expert/v1

        echo "Write a query that counts users" | loractl chat --lora sql-expert/v1

        printf '/lora pirate/v1\nTell me about your ship\n' | loractl chat

        loractl chat --repetition-penalty 1.2 --min-p 0.05
    """
    from loractl.client import Client

    convo = Conversation(system, lora)
    with asyncio.Runner() as runner, cli_errors():
        sampling = dict(max_tokens=max_tokens, temperature=temperature,
                        **opts.sampling_kwargs(min_p, presence_penalty, frequency_penalty, repetition_penalty,
                                               logit_bias, stop_token_ids, ignore_eos,
                                               top_p=top_p, top_k=top_k, stop=stop))
        client = Client(socket, home=home, prefer_adapter=lora)
        try:
            # Fails fast, with the usual hint, when no daemon is up; says so while an engine starts.
            runner.run(client.wait_ready(ENGINE_START_TIMEOUT_S, on_wait=waiting_notice()))
            if lora:  # a misspelt name is refused before the prompt opens, with the names meant
                runner.run(check_adapter(client, lora))
            if not sys.stdin.isatty():
                _piped(runner, client, convo, sys.stdin.read(), sampling)
                return
            _interactive(runner, client, convo, sampling, home)
        finally:
            client.close()


# The in-chat commands a line of piped input may be; any other line is a message's text.
COMMANDS = ("/lora", "/reset", "/help", "/exit", "/quit", "/bye")


def piped_steps(text: str) -> list[tuple[str, str]]:
    """Piped input as steps: each line that is an in-chat command (``/lora NAME``, ``/reset``,
    ...) is one ``("command", line)``; the lines between commands are one ``("say", message)``
    (so a piped text of several lines is one message, as before commands were read)."""
    steps: list[tuple[str, str]] = []
    lines: list[str] = []

    def said() -> None:
        message = "\n".join(lines).strip()
        if message:
            steps.append(("say", message))
        lines.clear()
    for line in text.splitlines():
        if line.strip().partition(" ")[0] in COMMANDS:
            said()
            steps.append(("command", line.strip()))
        else:
            lines.append(line)
    said()
    return steps


def _piped(runner: asyncio.Runner, client: Client, convo: Conversation, text: str, sampling: dict) -> None:
    """Chat with stdin not a terminal: each reply on stdout, the commands applied as typed ones are
    (quietly: only replies are printed), a refused ``/lora`` the command's error and exit code.
    Empty input says nothing and succeeds."""
    for kind, value in piped_steps(text):
        if kind == "say":
            runner.run(_reply(client, convo, value, sampling, echo=True))
            sys.stdout.write("\n")
            continue
        command, _, arg = value.partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/help":
            stderr.print(HELP)
        elif command == "/reset":
            convo.turns.clear()
        else:   # /lora
            wanted = arg.strip() or None
            if wanted is not None:
                runner.run(check_adapter(client, wanted))
            convo.lora = wanted


async def check_adapter(client: Client, name: str) -> None:
    """Raise the error a reply with ``name`` would raise, before any reply: a folder that is not
    there, or a name the store does not hold (with the names the user may have meant)."""
    from loractl.client import local_folder

    folder = local_folder(name)
    if folder is not None:  # a folder, as generate() reads it
        if not os.path.isdir(folder):
            raise AdapterNotFound(f"no adapter folder at {folder}", "Give a PEFT folder that exists, or a store name.")
        return
    try:
        await client.show(name)
    except AdapterNotFound as e:
        stored = [a["name"] for a in await client.list()]
        close = difflib.get_close_matches(name, stored, n=3, cutoff=0.6)
        hint = (f"Did you mean {' or '.join(repr(c) for c in close)}? " if close else "") + \
            "loractl ls lists the store; /lora alone goes back to the base model."
        raise AdapterNotFound(e.message, hint) from e


def read_message(first: str, read_line=input) -> str:
    """A message as typed: one line; or lines up to a closing \"\"\" when the first starts with \"\"\";
    or lines joined while each ends in a backslash (as Ollama's CLI reads them)."""
    if first.startswith('"""'):
        body = first[3:]
        if body.rstrip().endswith('"""') and body.strip() != "":
            return body.rstrip()[:-3].strip()
        lines = [body] if body.strip() else []
        while True:
            line = read_line("... ")
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip()
            lines.append(line)
    lines = []
    line = first
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line("... ")
    lines.append(line)
    return "\n".join(lines).strip()


def _interactive(runner: asyncio.Runner, client: Client, convo: Conversation, sampling: dict,
                 home: str | None) -> None:
    _enable_line_editing(home)
    stderr.print(styled("dim", f"chatting with {convo.lora or 'the base model'}; /help for commands, /exit to leave"))
    while True:
        try:
            text = read_message(input(">>> ").strip())
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        try:
            if _turn(runner, client, convo, text, sampling) == "exit":
                return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            stderr.print(styled("dim", "(stopped)"))


def _turn(runner: asyncio.Runner, client: Client, convo: Conversation, text: str, sampling: dict) -> str | None:
    if not text:
        return None
    if text.startswith("/"):
        command, _, arg = text.partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            return "exit"
        if command == "/help":
            stderr.print(HELP)
        elif command == "/reset":
            convo.turns.clear()
            stderr.print(styled("dim", "conversation cleared"))
        elif command == "/lora":
            wanted = arg.strip() or None
            if wanted is not None:
                try:
                    runner.run(check_adapter(client, wanted))
                except LoractlError as e:
                    # Refused now, not after the user has typed the next message.
                    print_error(e, "error:")
                    stderr.print(styled("dim", f"still answering with {convo.lora or 'the base model'}"))
                    return None
            convo.lora = wanted
            stderr.print(styled("dim", f"now answering with {convo.lora or 'the base model'}"))
        else:
            stderr.print(styled("red", f"unknown command {command}", "; /help lists them"))
        return None
    try:
        runner.run(_reply(client, convo, text, sampling, echo=True))
        sys.stdout.write("\n")
    except LoractlError as e:
        # One failed turn (say, an unknown adapter) must not end the session.
        convo.turns = convo.turns[:-2]
        print_error(e, "error:")
    return None


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
