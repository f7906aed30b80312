"""Ollama's ``options``, ``format`` and ``keep_alive``, as the OpenAI door's request fields and
loractl's tiers.

Invariant: an option is mapped or refused by name, never dropped. Mapped: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``num_predict`` (-> ``max_tokens``; -1 and -2: no
bound but the context), ``stop``, ``repeat_penalty`` (-> vLLM's ``repetition_penalty``: it
covers the whole sequence, so ``repeat_last_n`` other than -1 is refused beside a penalty), ``presence_penalty``,
``frequency_penalty``, and ``num_ctx``, accepted up to the context in force (the engine's
context is set when it starts; a prompt is never cut to fit). Options that tune how Ollama's
own runner loads a model (``num_gpu``, ``num_thread``, ``use_mmap``...) or samplers vLLM does not
have (``mirostat``, ``tfs_z``, ``typical_p``) are refused unless they carry the value that turns
them off.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from loractld.api.http.errors import HttpError

# Ollama option -> the OpenAI door's field (vLLM's names where OpenAI has none).
MAPPED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
          "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty"}
# The OpenAI door's words for what Ollama's request said otherwise (its refusals name them).
OLLAMA_WORDS = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
                "response_format": "format"}
# Options whose value turns a feature off: accepted with that value only.
NEUTRAL = {"mirostat": (0,), "tfs_z": (1.0,), "typical_p": (1.0,), "repeat_last_n": (-1,), "penalize_newline": (False,),
           "numa": (False,), "low_vram": (False,), "vocab_only": (False,), "embedding_only": (False,),
           "logits_all": (False,)}
# Options about how Ollama's runner loads a model: loractl's engine is configured at start.
RUNNER = {"num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "f16_kv", "num_keep",
          "mirostat_tau", "mirostat_eta"}
ENGINE_FLAGS_HINT = ("loractl's engine is configured when loractld starts (see loractld --help: --max-model-len, "
                     "--dtype, --device); leave this option out")


def refusal(message: str, hint: str, *, status: int = 400, param: str | None = None) -> HttpError:
    return HttpError(status, message, hint, param=param, code="unsupported_option" if param else "invalid_request")


def in_ollamas_words(error: HttpError) -> HttpError:
    """A refusal of the OpenAI door naming, beside its own field, the Ollama field it came from."""
    named = [ours for theirs, ours in OLLAMA_WORDS.items() if theirs in error.message or error.param == theirs]
    if named:
        error.message += f" (Ollama's {', '.join(named)})"
    return error


def map_options(options: Any, context: int | None) -> dict:
    """The OpenAI request fields ``options`` asks for; a refusal names what cannot be honoured."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise refusal("options must be a JSON object", "Send options as {\"temperature\": 0, ...}.")
    fields: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name in MAPPED:
            fields[MAPPED[name]] = _checked(name, value)
        elif name == "num_predict":
            if _checked(name, value) >= 0:
                fields["max_tokens"] = value
            elif value not in (-1, -2):
                raise refusal(f"options.num_predict {value} is not a number of tokens",
                              "Use a count, or -1 for as many as the context allows.", param=f"options.{name}")
        elif name == "num_ctx":
            if context is not None and _checked(name, value) > context:
                raise refusal(f"options.num_ctx {value} is larger than the context in force ({context} tokens)",
                              f"Ask for at most {context}, or restart loractld with a larger --max-model-len.",
                              param=f"options.{name}")
        elif name == "repeat_last_n" and options.get("repeat_penalty") in (None, 1, 1.0):
            _checked(name, value)   # no repetition penalty: nothing to count back over
        elif name in NEUTRAL:
            if value not in NEUTRAL[name] or isinstance(value, bool) != isinstance(NEUTRAL[name][0], bool):
                raise refusal(f"options.{name} is not supported by loractl's engine (vLLM)",
                              f"Leave it out (or send {NEUTRAL[name][0]!r}, which turns it off); the samplers "
                              "are temperature, top_p, top_k, min_p and the penalties.", param=f"options.{name}")
        elif name in RUNNER:
            raise refusal(f"options.{name} tunes Ollama's own runner and has no meaning here",
                          ENGINE_FLAGS_HINT + ".", param=f"options.{name}")
        else:
            raise refusal(f"unknown option {name!r}", "See Ollama's API reference for the options; loractl maps "
                          "temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty, "
                          "presence_penalty, frequency_penalty and num_ctx.", param=f"options.{name}")
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return fields


def _checked(name: str, value: Any) -> Any:
    """``value`` when it has the type Ollama gives the option."""
    if name == "stop":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    elif name in ("top_k", "seed", "num_predict", "num_ctx", "repeat_last_n"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise refusal(f"options.{name} has the wrong type ({type(value).__name__})",
                      "stop takes strings; top_k, seed, num_predict and num_ctx whole numbers; the others numbers.",
                      param=f"options.{name}")
    return value


def map_format(fmt: Any) -> dict:
    """``format``: ``"json"`` -> a JSON object; a JSON schema -> output that follows it."""
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise refusal(f"format {fmt!r} is neither \"json\" nor a JSON schema", "Send format: \"json\", or a JSON schema "
                  "object.", param="format")


@dataclass(frozen=True)
class KeepAlive:
    """What ``keep_alive`` asks of the tiers: ``evict`` (0: out of the engine after the answer),
    ``pin`` (negative: kept loaded until unpinned), or ``None`` (absent, or a duration: kept as
    any used adapter, until the least-recently-used rule needs its place)."""

    action: str | None
    text: str = ""


_DURATION = re.compile(r"(-?)((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+$")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> KeepAlive:
    """Ollama's ``keep_alive``: seconds as a number (or a numeric string), or a Go duration
    (``"5m"``, ``"1h30m"``, ``"-1m"``)."""
    if value is None:
        return KeepAlive(None)
    seconds = _seconds(value)
    if seconds is None:
        raise refusal(f"keep_alive {value!r} is not a duration", "Send seconds (0, -1, 300) or a duration such as "
                      "\"5m\".", param="keep_alive")
    text = str(value)
    if seconds == 0:
        return KeepAlive("evict", text)
    return KeepAlive("pin" if seconds < 0 else None, text)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        number = float(text)
        return number if math.isfinite(number) else None
    except ValueError:
        pass
    match = _DURATION.match(text)
    if match is None:
        return None
    total = sum(float(n) * _UNIT_S[unit] for n, unit in _PART.findall(text))
    return -total if match.group(1) else total
