"""The read commands' bodies (``status``, ``ps``, ``show``), free of Typer so that
``loractl.cli.main`` can run them directly, as it runs ``ls`` (``loractl.cli.listing``).

Each asks its daemon the quick way first (``loractl.cli._quick``: one blocking gRPC call, no
asyncio, no grpclib; the registry read without ``loractl.registry``) and through ``Client``
otherwise; either way it renders the same dict the same way.
"""

from __future__ import annotations

import re
import sys

from loractl.cli._units import ago, human_bytes, short_revision

# typing's import is ~4 ms of a command that prints a table; the annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _output():
    """``loractl.cli._output``, imported where a command falls back to ``Client`` or prints
    JSON (errors, json and typing: ~5 ms no table needs)."""
    from loractl.cli import _output

    return _output


def _status(socket: str | None, home: str | None) -> dict[str, Any]:
    from loractl.cli._quick import reply
    from loractl.v1 import loractl_pb2 as pb

    info = reply(socket, home, "/loractl.v1.Loractl/Status", pb.StatusRequest(), pb.StatusReply)
    return info if info is not None else _output().with_client(socket, home, lambda client: client.status())


def status_report(socket: str | None, home: str | None, json_output: bool, info: dict[str, Any] | None = None) -> None:
    """``loractl status``: ``info`` when the caller has it (``--wait``), else asked now."""
    info = info if info is not None else _status(socket, home)
    engine = info["engine"]
    # The engine settings in effect as an object under vLLM's own names (the wire has its text).
    engine["engine_args"] = _engine_args(engine.pop("engine_args_json", ""))
    if json_output:
        _output().print_json(info)
        return
    table = Pairs()
    # asleep: the engine gave its memory back after --keep-alive idle; the next request wakes it.
    state = info.get("state") or ("ready" if info["ready"] else "starting")
    table.add_row("state", state + (" (the next request wakes the engine)" if state == "asleep" else ""))
    name, asked = engine.get("model_name") or engine["model"], engine.get("model_arg") or ""
    table.add_row("model", (name or "-") + (f" (--model {asked})" if asked and asked != name else ""))
    if engine["model"] and engine["model"] != name:
        table.add_row("model folder", engine["model"])
    table.add_row("device", f"{engine['device'] or '-'} ({engine['dtype'] or '-'})")
    cap = info["capacity"]
    table.add_row("device slots", f"{cap['device_used']} used, {cap['device_slots'] - cap['device_used']} free "
                                  f"(device pins {cap.get('device_pins', 0)}/{cap.get('max_device_pins', 0)})")
    table.add_row("host slots", f"{cap['host_used']} used, {cap['host_slots'] - cap['host_used']} free "
                                f"(host pins {cap['pins']}/{cap['max_pins']})")
    table.add_row("disk", f"{cap['disk_adapters']} adapters, {human_bytes(int(cap['disk_bytes']))}")
    table.add_row("max rank", str(cap["max_lora_rank"] or engine["max_lora_rank"]))
    table.add_row("context", f"{engine['max_model_len']} tokens")
    kv = int(engine.get("kv_cache_bytes") or 0)
    table.add_row("kv cache", (human_bytes(kv) if kv else "sized by vLLM")
                  + f", up to {engine.get('max_num_seqs') or '-'} sequences a step")
    settled = engine["engine_args"]
    shown = [f"{k}={settled[k]}" for k in ENGINE_SHOWN if settled.get(k) not in (None, "")
             and not (k == "gpu_memory_utilization" and engine["device"] == "cpu")]   # no share of a CPU
    if shown:   # every setting in effect: loractl status --json | jq .engine.engine_args
        table.add_row("engine", ", ".join(shown))
    for choice in engine.get("choices") or []:
        table.add_row("chosen", f"{choice['name']} = {choice['value']}: {choice['why']}")
    table.add_row("in flight", str(info["requests_in_flight"]))
    gate = info.get("admission") or {}
    if gate.get("policy"):
        bound = f", hand-over after {gate['max_wait_s']:.3g} s" if gate["policy"] != "first-come" else ""
        if gate.get("handover_s") or gate.get("service_s"):   # what the measured rule decides from
            bound += (f" (measured: a hand-over {1000 * gate.get('handover_s', 0.0):.0f} ms, "
                      f"a request {1000 * gate.get('service_s', 0.0):.0f} ms)")
        if gate["policy"] == "passthrough":
            bound = ""   # the bound is only passthrough's while a device pin makes it hold
        table.add_row("admission", f"{gate['policy']}{bound}")
        if gate.get("mode"):
            table.add_row("gate", f"{gate['mode']}: {gate.get('mode_reason') or '-'}")
        table.add_row("slots", f"{gate['active']} adapter(s) running, {gate['queued']} request(s) waiting "
                               "(loractl ps)")
    table.add_row("uptime", f"{info['uptime_s']:.0f} s (engine start {info['engine_start_s']:.1f} s)")
    table.add_row("daemon", f"loractld {info['version']}, vllm {engine['vllm_version'] or '-'}, pid {info['pid']}")
    table.add_row("socket", info["socket"])
    if info.get("http"):
        table.add_row("http", f"{info['http']}/v1 (OpenAI-compatible)")
    table.print(colours={"ready": "green", "starting": "yellow", "waking": "yellow", "asleep": "cyan"})



# The engine settings a status line shows (vLLM's names); --json has every one in effect.
ENGINE_SHOWN = ("gpu_memory_utilization", "tensor_parallel_size", "pipeline_parallel_size", "quantization",
                "kv_cache_dtype", "max_num_batched_tokens")


def _engine_args(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def requests_report(socket: str | None, home: str | None, json_output: bool) -> None:
    """``loractl ps``."""
    info = _status(socket, home)
    gate = info.get("admission") or {}
    requests = sorted(gate.get("requests", []),
                      key=lambda r: (r["state"] != "queued", r.get("position", 0), -r.get("age_s", 0.0)))
    adapters = gate.get("adapters", [])
    if json_output:
        _output().print_json({"adapters": adapters, "requests": requests})
        return
    if not requests:
        sys.stdout.write("no requests in flight\n")  # what rich prints, without its import
        return
    from rich.table import Table

    if adapters:   # fairness at a glance: who waits, and for how long
        per_adapter = Table(box=None, pad_edge=False, header_style="bold")
        for header in ("ADAPTER", "RUNNING", "WAITING", "OLDEST WAIT"):
            per_adapter.add_column(header, no_wrap=True)
        for a in adapters:
            per_adapter.add_row(a["adapter"], str(a.get("running", 0)), str(a.get("queued", 0)),
                                f"{a['oldest_wait_s']:.2f}s" if a.get("queued") else "-")
        _print(per_adapter)
        sys.stdout.write("\n")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in ("ID", "ADAPTER", "STATE", "POS", "WAITED", "AGE"):
        table.add_column(header, no_wrap=True)
    for r in requests:
        table.add_row(r["id"], r["adapter"] or "(base model)", r["state"], str(r.get("position") or "-"),
                      f"{r.get('waited_s', 0.0):.2f}s", f"{r.get('age_s', 0.0):.1f}s")
    _print(table)



def _served_quantized(socket: str | None, home: str | None) -> str:
    """", served on a quantized base (awq)" when the daemon's base is quantized (issue 59): what
    the adapter's float-model deltas are applied to. One more small read of the daemon's status."""
    from loractl.cli._quick import message
    from loractl.v1 import loractl_pb2 as pb

    status = message(socket, home, "/loractl.v1.Loractl/Status", pb.StatusRequest(), pb.StatusReply)
    quantization = status.engine.quantization if status is not None else \
        ((_output().with_client(socket, home, lambda client: client.status()).get("engine") or {}).get("quantization"))
    return f"; served on a quantized base ({quantization})" if quantization else ""


def adapter_report(name: str, socket: str | None, home: str | None, json_output: bool) -> None:
    """``loractl show NAME``."""
    from loractl.cli._quick import reply
    from loractl.v1 import loractl_pb2 as pb

    a = reply(socket, home, "/loractl.v1.Loractl/Show", pb.ShowRequest(name=name), pb.Adapter)
    if a is None:
        a = _output().with_client(socket, home, lambda client: client.show(name))
    if json_output:
        _output().print_json(a)
        return
    table = Pairs(fold=True)
    if a.get("kind") == "profile":
        for key, value in profile_rows(a):
            table.add_row(key, value)
        table.print()
        return
    import datetime

    pulled = datetime.datetime.fromtimestamp(a["pulled_at"]).strftime("%Y-%m-%d %H:%M") if a["pulled_at"] else "-"
    rows = [
        ("name", a["name"]), ("state", a["state"] + (f": {a['error']}" if a["error"] else "")),
        ("tier", a["tier"] + (f" (slot {a['slot']})" if a["tier"] == "device" else "")
         + ({"device": ", pinned to the device", "host": ", pinned in host RAM"}.get(
             a.get("pin") or ("host" if a["pinned"] else ""), ""))),
        ("requests", f"{a['requests']} (last {ago(a['last_used'])})"),
        ("in host RAM", human_bytes(int(a["host_bytes"])) if int(a["host_bytes"]) else "-"),
        ("source", f"{a['source']} {a['ref']}" + (" (placed by hand)" if a["hand_placed"] else "")),
        ("revision", a["revision"]), ("base model", (a["base_model"] or "-") + _served_quantized(socket, home)),
        ("rank", f"{a['rank']} (alpha {a['alpha']:g})"), ("targets", ", ".join(a["target_modules"]) or "-"),
        ("size", human_bytes(int(a["size_bytes"]))), ("pulled", pulled), ("path", a["path"]),
    ]
    if a.get("normalized"):
        rows.append(("normalised", "; ".join(a["normalized"])))
    rows += merge_rows(a.get("merge"))
    for f in a["files"]:
        rows.append(("file", f"{f['name']} {human_bytes(int(f['size']))} sha256:{f['sha256'][:16]}…"))
    for key, value in rows:
        table.add_row(key, value)
    table.print()



def merge_rows(merged: dict | None) -> list[tuple[str, str]]:
    """``loractl show MERGED``: how it was made (loractl merge): method, sources, the svd's error."""
    if not merged:
        return []
    method = merged["method"] + (" (exact)" if merged["method"] == "cat" else
                                 f" (approximate: relative error {merged['relative_error']:.2e})")
    # The source's revision as ls and show give it; a merge made before it was recorded: its content digest.
    return [("merged", method)] + [("from", f"{s['name']} × {s['weight']:g} (revision "
                                            f"{short_revision(s.get('revision') or 'sha256:' + s['digest'])})")
                                   for s in merged.get("sources", [])]


def profile_rows(a: dict) -> list[tuple[str, str]]:
    """``loractl show PROFILE``: what it runs and the defaults its requests get."""
    p = a.get("profile") or {}
    rows = [("name", a["name"]), ("kind", "profile"), ("from", p.get("base", "")),
            ("runs", p.get("adapter") or "the base model")]
    rows += [("adapter", f"{x['name']} (weight {x['weight']:g})") for x in p.get("adapters", [])]
    if p.get("system") is not None:
        rows.append(("system", p["system"]))
    if p.get("template"):
        rows.append(("template", f"{len(p['template'])} characters (loractl show {a['name']} --modelfile)"))
    rows += [("parameter", f"{k} {v}") for k, v in sorted((p.get("parameters") or {}).items())]
    rows += [("message", f"{m['role']}: {m['content']}") for m in p.get("messages", [])]
    rows += [("license", text.strip().splitlines()[0] if text.strip() else "") for text in p.get("license", [])]
    return rows


def _print(renderable) -> None:
    from loractl.cli._output import stdout  # rich's console, made at first use

    stdout.print(renderable)


# Text rich prints as it is in a two-column table: printable ASCII and …, no markup ([ or \), no
# emoji code (:name:).
_PLAIN_PAIR = re.compile(r"[ -Z\]-~…]*\Z")
_EMOJI_CODE = re.compile(r":[\w+-]+:")


class Pairs:
    """A key/value table (``status``, ``show``), printed as rich prints ``Table(show_header=False,
    box=None, pad_edge=False)`` with the keys bold; into a pipe without rich's import when rich
    would only pad (``plain_pairs``)."""

    def __init__(self, fold: bool = False) -> None:
        self.rows: list[tuple[str, str]] = []
        self.fold = fold

    def add_row(self, key: str, value: str) -> None:
        self.rows.append((key, value))

    def print(self, colours: dict[str, str] | None = None) -> None:
        from loractl.cli.listing import _plain_width

        width = _plain_width()
        text = plain_pairs(self.rows, width, self.fold) if width else None
        if text is not None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        from rich.table import Table
        from rich.text import Text

        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold" if self.fold else "ellipsis")
        for key, value in self.rows:
            colour = (colours or {}).get(value) if key == "state" else None
            table.add_row(key, Text(value, style=colour) if colour else value)
        _print(table)


def plain_pairs(rows: list[tuple[str, str]], width: int, fold: bool = False) -> str | None:
    """``rows`` as rich prints them (see ``Pairs``) without colour, or None when rich would do
    more than pad and fold (wrap at spaces, interpret markup or emoji codes).

    Too wide for ``width``, rich narrows the widest column first, so while the values stay
    wider than the keys only the value column shrinks: to the rest of the line, every value
    padded to it. With ``fold`` a value without spaces is then cut into lines of that width
    (``show``'s revision and path); one with spaces would be word-wrapped: left to rich."""
    if not rows or not all(_PLAIN_PAIR.match(cell) and not _EMOJI_CODE.search(cell) for row in rows for cell in row):
        return None
    keys, values = max(len(k) for k, _ in rows), max(len(v) for _, v in rows)
    if keys + 2 + values <= width:
        return "".join(f"{k.ljust(keys)}  {v.ljust(values)}\n" for k, v in rows)
    room = width - keys - 2
    if not fold or room < keys or any(" " in v for _, v in rows if len(v) > room):
        return None
    lines = []
    for key, value in rows:
        chunks = [value[i:i + room] for i in range(0, len(value), room)] or [""]
        lines += [f"{(key if n == 0 else '').ljust(keys)}  {chunk.ljust(room)}\n" for n, chunk in enumerate(chunks)]
    return "".join(lines)
