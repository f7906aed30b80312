"""loractld --dynamo: two real daemons on the tiny model join one Dynamo fleet through the real
runtime (ai-dynamo-runtime, the file discovery backend in a shared folder), and, where Dynamo's
frontend is installed, requests go through it.

Daemon A holds no adapter, daemon B holds sql-expert/v1. What is checked: the cards in discovery
follow each store (pull publishes, rm withdraws); a tokenized request sent to B through the
runtime gives the HF + PEFT reference's tokens; a stopped request is aborted in the engine, leaving
nothing running; Dynamo's /v1/loras (load from a folder with the store's checks, list, unload)
on A's system port; the frontend's requests for B's adapter all reach B with the reference's
text; the frontend's options reach the engine (a JSON schema and a choice constrain the output,
n=2 gives two choices, logprobs match HF + PEFT's) or are refused by name (echo's prompt
logprobs); SIGTERM withdraws every key at once (the file backend would drop them only after ~10 s).

The frontend (``python -m dynamo.frontend``, the ai-dynamo wheel) is not a loractl dependency:
scripts/setup.sh installs it in .venv-frontend ($LORACTL_DYNAMO_FRONTEND_PYTHON names another
interpreter that has it); without one, that test is skipped with the reason. Bounded: about a minute here.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import REPO, start_daemon, run_cli
from fleet_rig import frontend_python

pytest.importorskip("dynamo.runtime", reason="the Dynamo runtime is not installed (pip install '.[dynamo]')")

ADAPTER = "sql-expert/v1"
MAX_NEW = 8
CONTEXT = 1024  # the tiny model's whole context: a long generation for the stop test
LONG = 1000
JOINED = r"joined Dynamo .* instance (\d+)"
CLIENT = REPO / "tests" / "dynamo_client.py"


def free_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number."""
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


class Worker:
    def __init__(self, daemon, system_port: int) -> None:
        self.daemon = daemon
        self.system_port = system_port
        # The CLI's "ready" comes with the engine; the join follows at once, before systemd's READY=1.
        wait_for(lambda: re.search(JOINED, daemon.log.read_text()), 30, "the daemon to join Dynamo")
        self.instance = int(re.search(JOINED, daemon.log.read_text()).group(1))

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*args, "--socket", str(self.daemon.socket))

    def loras(self, method: str = "GET", body: dict | None = None, name: str = "") -> dict:
        url = f"http://127.0.0.1:{self.system_port}/v1/loras" + (f"/{name}" if name else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())


@pytest.fixture(scope="module")
def fleet(home: Path, demo: Path):
    root = home / "dynamo"
    root.mkdir(exist_ok=True)
    kv = root / "kv"
    env = {"DYN_FILE_KV": str(kv), "DYN_LORA_ENABLED": "true"}
    ports = {"a": free_port(), "b": free_port()}

    def start(name: str):
        sub = root / name
        sub.mkdir(exist_ok=True)
        # One model folder for both: the fleet's workers serve the same base model.
        # a takes folders over Dynamo's load_lora (file://); b keeps the default: Hub references only.
        folders = ["--dynamo-allow-folders"] if name == "a" else []
        return start_daemon(sub, "--dynamo", "--dynamo-discovery", "file", "--served-model-name", "tiny",
                            "--max-model-len", str(CONTEXT), *folders, name=name,
                            model=str(demo / "model"), env={**env, "DYN_SYSTEM_PORT": str(ports[name])})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = {name: pool.submit(start, name) for name in "ab"}
    daemons = {name: f.result() for name, f in starting.items() if f.exception() is None}
    try:
        for f in starting.values():
            f.result()  # a failed start, after the other daemon is in hand to be stopped
        a, b = Worker(daemons["a"], ports["a"]), Worker(daemons["b"], ports["b"])
        result = b.cli("pull", str(demo / "adapters" / ADAPTER), "--name", ADAPTER)
        assert result.returncode == 0, result.stderr
        yield {"a": a, "b": b, "kv": kv, "env": env, "root": root}
    finally:
        for daemon in daemons.values():
            if daemon.proc.poll() is None:
                daemon.stop()


def discovery(kv: Path) -> dict[int, set[str]]:
    """Instance id -> the models its cards name ("" the base model), read from the file backend."""
    found: dict[int, set[str]] = {}
    for path in (kv / "v1" / "mdc").glob("*"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten or just removed
        card = record["card_json"]
        card = json.loads(card) if isinstance(card, str) else card
        found.setdefault(record["instance_id"], set()).add((card.get("lora") or {}).get("name", ""))
    return found


def instances(kv: Path) -> set[str]:
    return {unquote(p.name) for p in (kv / "v1" / "instances").glob("*")}


def wait_for(check, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def send(fleet, worker: Worker, request: dict, *extra: str) -> list[dict]:
    result = subprocess.run([sys.executable, str(CLIENT), "dynamo.loractl.generate", str(worker.instance),
                             json.dumps(request), *extra], capture_output=True, text=True, timeout=90,
                            env={**os.environ, **fleet["env"]})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_cards_follow_each_store(fleet, demo):
    a, b, kv = fleet["a"], fleet["b"], fleet["kv"]
    wait_for(lambda: discovery(kv).get(b.instance) == {"", ADAPTER},
             what=f"B's card: {b.instance} {discovery(kv)} {b.daemon.log_tail(30)}")
    assert discovery(kv)[a.instance] == {""}
    assert b.cli("rm", ADAPTER).returncode == 0
    wait_for(lambda: discovery(kv).get(b.instance) == {""}, what="B's card withdrawn after rm")
    result = b.cli("pull", str(demo / "adapters" / ADAPTER), "--name", ADAPTER)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: discovery(kv).get(b.instance) == {"", ADAPTER}, what="B's card after a new pull")


def test_tokenized_request_through_the_runtime_equals_the_reference(fleet, demo, reference):
    prompt = reference.chat_ids("Write a query that counts the users.")
    chunks = send(fleet, fleet["b"], {"token_ids": prompt, "model": ADAPTER, "routing": {"lora_name": ADAPTER},
                                      "stop_conditions": {"max_tokens": MAX_NEW},
                                      "sampling_options": {"temperature": 0.0}})
    ids = [t for c in chunks for t in c["token_ids"]]
    assert ids == reference.greedy(prompt, demo / "adapters" / ADAPTER, MAX_NEW)
    assert chunks[-1]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["completion_usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                              "total_tokens": len(prompt) + len(ids)}
    # The base model on the same worker: the adapter made the difference.
    base = send(fleet, fleet["b"], {"token_ids": prompt, "stop_conditions": {"max_tokens": MAX_NEW},
                                    "sampling_options": {"temperature": 0.0}})
    assert [t for c in base for t in c["token_ids"]] == reference.greedy(prompt, None, MAX_NEW)


def test_the_dynamo_door_gives_the_grpc_doors_tokens(fleet):
    """One request path (tests/test_one_path.py): a chat with a system prompt and penalties sent to
    B's socket, and the same prompt's tokens with the same options through the runtime, agree."""
    import asyncio

    from conftest import collect

    messages = [{"role": "system", "content": "You answer in SQL only."},
                {"role": "user", "content": "List the newest orders."}]
    penalties = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.15}

    async def grpc() -> dict:
        async with fleet["b"].daemon.client() as client:
            return await collect(client, messages=messages, lora=ADAPTER, max_tokens=MAX_NEW, temperature=0.0,
                                 **penalties)
    want = asyncio.run(grpc())
    chunks = send(fleet, fleet["b"], {"token_ids": want["prompt_ids"], "model": ADAPTER,
                                      "routing": {"lora_name": ADAPTER}, "stop_conditions": {"max_tokens": MAX_NEW},
                                      "sampling_options": {"temperature": 0.0, **penalties}})
    assert [t for c in chunks for t in c["token_ids"]] == want["ids"] and len(want["ids"]) == MAX_NEW


PROFILE = "sql-terse"            # a system prompt: no card (the frontend would render without it)
GREEDY = "sql-greedy"            # an adapter and parameters: a card
PROFILE_SYSTEM = "You answer in SQL only."
QUESTION = [{"role": "user", "content": "List the newest orders."}]


@pytest.fixture(scope="module")
def profiled(fleet) -> dict:
    """Two profiles on B over its adapter (greedy, MAX_NEW tokens, a penalty), one with a system
    prompt, and the gRPC door's answer for each; removed at the end, their cards withdrawn."""
    import asyncio

    from conftest import collect

    b = fleet["b"]
    params = ("--param", "temperature=0", "--param", f"num_predict={MAX_NEW}", "--param", "repeat_penalty=1.15")
    for name, extra in ((PROFILE, ("--system", PROFILE_SYSTEM)), (GREEDY, ())):
        made = b.cli("create", name, "--from", ADAPTER, *extra, *params)
        assert made.returncode == 0, made.stderr

    async def grpc(**kwargs) -> dict:
        async with b.daemon.client() as client:
            return await collect(client, **kwargs)
    answers = {name: asyncio.run(grpc(messages=QUESTION, lora=name)) for name in (PROFILE, GREEDY)}
    plain = asyncio.run(grpc(messages=[{"role": "system", "content": PROFILE_SYSTEM}, *QUESTION], lora=ADAPTER,
                             temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.15))
    want = answers[PROFILE]
    assert (want["prompt_ids"], want["ids"]) == (plain["prompt_ids"], plain["ids"]) and len(want["ids"]) == MAX_NEW
    yield answers
    if b.daemon.proc.poll() is not None:
        return   # the module's SIGTERM test stopped B, and its keys went with it: nothing to withdraw
    for name in (PROFILE, GREEDY):
        assert b.cli("rm", name).returncode == 0
    wait_for(lambda: GREEDY not in discovery(fleet["kv"]).get(b.instance, set()), what="the profile's card withdrawn")


def test_a_profile_through_the_dynamo_door_gives_the_grpc_doors_tokens(fleet, profiled):
    """The profile's name in routing.lora_name, the prompt's ids and no sampling options: its
    adapter and parameters (not the model's defaults) answer, as through the socket."""
    b, want = fleet["b"], profiled[PROFILE]
    chunks = send(fleet, b, {"token_ids": want["prompt_ids"], "model": PROFILE, "routing": {"lora_name": PROFILE}})
    assert [t for c in chunks for t in c["token_ids"]] == want["ids"]
    # The request's own values win over the profile's.
    chunks = send(fleet, b, {"token_ids": want["prompt_ids"], "routing": {"lora_name": PROFILE},
                             "stop_conditions": {"max_tokens": 3}})
    assert [t for c in chunks for t in c["token_ids"]] == want["ids"][:3]
    # Cards: the frontend renders a LoRA card's prompt with the base model's template, so a
    # profile with a system prompt gets none (it would answer without it); one without does.
    wait_for(lambda: GREEDY in discovery(fleet["kv"]).get(b.instance, set()), what="the plain profile's card")
    assert PROFILE not in discovery(fleet["kv"])[b.instance]
    assert f"profile {PROFILE} gets no card" in b.daemon.log.read_text()


def test_a_request_for_an_adapter_the_worker_lacks_is_refused_with_its_reason(fleet):
    result = subprocess.run([sys.executable, str(CLIENT), "dynamo.loractl.generate", str(fleet["a"].instance),
                             json.dumps({"token_ids": [1, 2, 3], "routing": {"lora_name": ADAPTER},
                                         "stop_conditions": {"max_tokens": 4}})],
                            capture_output=True, text=True, timeout=90, env={**os.environ, **fleet["env"]})
    assert f"no adapter named '{ADAPTER}' in the store" in result.stdout + result.stderr


def test_a_stopped_request_is_aborted_in_the_engine(fleet):
    """Dynamo's stop_generating (the frontend's client went away) aborts the generation in the
    engine: it produces far fewer than the LONG tokens min_tokens asks for, and nothing stays running."""
    b = fleet["b"]
    before = _generated_tokens(b)
    chunks = send(fleet, b, {"token_ids": [1, 2, 3, 4], "stop_conditions": {"max_tokens": LONG, "min_tokens": LONG},
                             "sampling_options": {"temperature": 0.0}}, "--stop-after", "1")
    assert chunks and not any(c.get("finish_reason") in ("length", "stop") for c in chunks)
    wait_for(lambda: json.loads(b.cli("status", "--json").stdout)["requests_in_flight"] == 0, 10,
             "the stopped request to leave the daemon")
    assert _generated_tokens(b) - before < LONG / 2


def _generated_tokens(worker: Worker) -> float:
    text = worker.cli("metrics").stdout
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:generation_tokens_total")]
    assert values, "vLLM's generation_tokens_total is missing from loractl metrics"
    return sum(values)


def test_dynamo_lora_management_on_the_system_port(fleet, demo):
    a, kv = fleet["a"], fleet["kv"]
    assert a.loras() == {"status": "success", "loras": {}, "count": 0}
    bad = a.loras("POST", {"lora_name": "poet/v1", "source": {"uri": f"file://{demo / 'adapters'}"}})
    assert bad["status"] == "error" and "adapter_config.json is missing" in bad["message"]
    refused = a.loras("POST", {"lora_name": "poet/v1", "source": {"uri": "s3://bucket/poet"}})
    assert refused["status"] == "error" and "cannot pull from s3://" in refused["message"]
    loaded = a.loras("POST", {"lora_name": "poet/v1", "source": {"uri": f"file://{demo / 'adapters' / 'poet' / 'v1'}"}})
    assert loaded["status"] == "success", loaded
    assert a.loras()["loras"] == {"poet/v1": loaded["lora_id"]}
    assert "poet/v1" in discovery(kv)[a.instance]
    assert a.loras("POST", {"lora_name": "poet/v1", "source": {"uri": "file:///elsewhere"}})["message"] == \
        "LoRA adapter 'poet/v1' already loaded"
    assert json.loads(a.cli("show", "poet/v1", "--json").stdout)["name"] == "poet/v1"  # in the store
    unloaded = a.loras("DELETE", name="poet/v1")
    assert unloaded["status"] == "success", unloaded
    assert "poet/v1" not in discovery(kv)[a.instance]
    assert a.cli("show", "poet/v1").returncode != 0
    missing = a.loras("DELETE", name="poet/v1")
    assert missing["status"] == "error" and "not found" in missing["message"]
    log = a.daemon.log.read_text()
    assert "audit dynamo=system-port op=dynamo-load target=poet/v1 <- file://" in log and "result=ok" in log
    assert "audit dynamo=system-port op=dynamo-unload target=poet/v1 result=ok" in log


def test_dynamo_lora_management_is_loopback_and_hub_only_by_default(fleet, demo):
    """Issue 37, finding 4: the system port listened on every interface, and any caller (user
    nobody) could make the daemon install a folder it reads with its own rights. By default the
    port listens on loopback, and a file:// source is refused, audited."""
    b = fleet["b"]
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{b.system_port}"], capture_output=True, text=True).stdout
    local = [line.split()[3] for line in listening.splitlines() if line.strip()]
    assert local == [f"127.0.0.1:{b.system_port}"], listening   # not 0.0.0.0 or *, Dynamo's default
    folder = demo / "adapters" / "poet" / "v1"
    refused = b.loras("POST", {"lora_name": "poet/v1", "source": {"uri": f"file://{folder}"}})
    assert refused["status"] == "error" and "--dynamo-allow-folders" in refused["message"], refused
    assert "poet/v1" not in b.loras()["loras"]
    assert f"audit dynamo=system-port op=dynamo-load target=poet/v1 <- file://{folder} result=denied" in \
        b.daemon.log.read_text()


def _frontend_python() -> tuple[str | None, str]:
    python = frontend_python()
    return python, ("" if python else "Dynamo's frontend is not installed (bash scripts/setup.sh makes .venv-frontend; "
                                      "or set LORACTL_DYNAMO_FRONTEND_PYTHON to an interpreter that has it)")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{e.code} from {url}: {e.read().decode()[:2000]}") from e


@pytest.fixture(scope="module")
def frontend(fleet) -> str:
    """Dynamo's frontend over the fleet: its base URL, once it lists B's adapter."""
    python, why = _frontend_python()
    if python is None:
        print(f"SKIPPED: {why}")
        pytest.skip(why)
    port = free_port()
    log = fleet["root"] / "frontend.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                    str(port), "--discovery-backend", "file"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **fleet["env"]}, start_new_session=True, cwd=fleet["root"])
    try:
        def listed() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                    return ADAPTER in {m["id"] for m in json.loads(response.read())["data"]}
            except OSError:
                return False
        wait_for(listed, 60, "the frontend to list the adapter")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def test_the_frontend_sends_an_adapters_requests_to_the_worker_holding_it(fleet, frontend, demo, reference):
    question = "Write a query that counts the users."
    expected = reference.text(reference.greedy(reference.chat_ids(question), demo / "adapters" / ADAPTER, MAX_NEW))
    before = _requests(fleet["b"])
    for _ in range(6):
        answer = _post(f"{frontend}/v1/chat/completions",
                       {"model": ADAPTER, "messages": [{"role": "user", "content": question}],
                        "max_tokens": MAX_NEW, "temperature": 0})
        assert answer["choices"][0]["message"]["content"] == expected
    assert _requests(fleet["b"]) - before == 6  # all six on B (A has no such adapter and would refuse)


def test_the_frontends_options_reach_the_engine_through_the_worker(frontend, demo, reference):
    """Issue 38: what the frontend carries (a JSON schema, a choice, logprobs, n) is honoured, and
    what loractl cannot do (echo's prompt logprobs) is refused by name, not dropped."""
    import jsonschema

    question = "Write a query that counts the users."
    chat = {"model": ADAPTER, "messages": [{"role": "user", "content": question}], "temperature": 0}
    # A schema that leaves no room for whitespace: inside an object the tiny model, free to put
    # any whitespace there, filled max_tokens with it (seen: '{' and then only spaces).
    schema = {"type": "string", "enum": ["users", "orders"]}
    answer = _post(f"{frontend}/v1/chat/completions", {**chat, "max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "count", "schema": schema}}})
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), schema)
    answer = _post(f"{frontend}/v1/chat/completions", {**chat, "max_tokens": 8, "guided_choice": ["yes", "no"]})
    assert answer["choices"][0]["message"]["content"] in ("yes", "no")

    prompt, adapter = reference.chat_ids(question), demo / "adapters" / ADAPTER
    ids = reference.greedy(prompt, adapter, MAX_NEW)
    answer = _post(f"{frontend}/v1/chat/completions", {**chat, "max_tokens": MAX_NEW, "logprobs": True,
                                                       "top_logprobs": 2})
    assert answer["choices"][0]["message"]["content"] == reference.text(ids)
    content = answer["choices"][0]["logprobs"]["content"]
    assert [t["token_id"] for t in content] == ids
    assert [t["logprob"] for t in content] == pytest.approx(_reference_logprobs(reference, prompt, ids, adapter),
                                                            abs=1e-3)
    for token in content:  # greedy: the sampled token is the most likely
        assert len(token["top_logprobs"]) == 2 and token["top_logprobs"][0]["logprob"] == token["logprob"]
    # n=2 (the frontend wants a temperature then): two choices, each token's logprob HF + PEFT's.
    answer = _post(f"{frontend}/v1/chat/completions", {**chat, "max_tokens": MAX_NEW, "n": 2, "temperature": 1.0,
                                                       "seed": 5, "logprobs": True})
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    for choice in answer["choices"]:
        sampled = [t["token_id"] for t in choice["logprobs"]["content"]]
        assert sampled and [t["logprob"] for t in choice["logprobs"]["content"]] == \
            pytest.approx(_reference_logprobs(reference, prompt, sampled, adapter), abs=1e-3)

    echo = urllib.request.Request(f"{frontend}/v1/completions", headers={"Content-Type": "application/json"},
                                  data=json.dumps({"model": ADAPTER, "prompt": "SELECT", "max_tokens": 2,
                                                   "logprobs": 1, "echo": True}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(echo, timeout=60)
    assert refused.value.code == 400 and "prompt_logprobs is not supported" in refused.value.read().decode()


def test_the_frontend_answers_a_profile_as_the_socket(fleet, frontend, profiled):
    """A profile of an adapter and parameters, through the frontend with no options of its own:
    the socket's prompt and answer (its parameters, not the frontend's or the model's defaults)."""
    def listed() -> bool:
        with urllib.request.urlopen(f"{frontend}/v1/models", timeout=5) as response:
            return GREEDY in {m["id"] for m in json.loads(response.read())["data"]}
    wait_for(listed, 30, "the frontend to list the profile")
    answer = _post(f"{frontend}/v1/chat/completions", {"model": GREEDY, "messages": QUESTION})
    assert answer["usage"]["prompt_tokens"] == len(profiled[GREEDY]["prompt_ids"])
    assert answer["choices"][0]["message"]["content"] == profiled[GREEDY]["text"]


def _reference_logprobs(reference, prompt: list[int], ids: list[int], adapter: Path) -> list[float]:
    """HF + PEFT's log-probabilities of ``ids`` after ``prompt`` (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(reference.model_dir, dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def _requests(worker: Worker) -> int:
    shown = json.loads(worker.cli("show", ADAPTER, "--json").stdout)
    return int(shown["requests"])  # an int64 in the protocol: a string in its JSON


def test_sigterm_withdraws_every_key_while_a_request_drains(fleet):
    """On SIGTERM the worker leaves the fleet first: its keys are gone while a running request
    still drains (the frontend stops routing here at once), then the daemon exits 0. The file
    backend alone would keep them until their ~10 s TTL ran out."""
    b, kv = fleet["b"], fleet["kv"]
    tag = f"{b.instance:x}"
    assert any(name.endswith(tag) for name in instances(kv))
    running = subprocess.Popen([sys.executable, str(CLIENT), "dynamo.loractl.generate", str(b.instance),
                                json.dumps({"token_ids": [1, 2, 3, 4], "sampling_options": {"temperature": 0.0},
                                            "stop_conditions": {"max_tokens": LONG, "min_tokens": LONG}})],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, **fleet["env"]})
    try:
        assert running.stdout.readline().startswith("{")  # generating
        b.daemon.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not [n for n in instances(kv) if n.endswith(tag)] and b.instance not in discovery(kv), 5,
                 "B's keys to go")
        assert running.poll() is None, "the keys went only after the running request ended"
        assert fleet["a"].instance in discovery(kv)  # the other worker stays
        assert b.daemon.proc.wait(60) == 0
    finally:
        running.kill()
        running.wait()
