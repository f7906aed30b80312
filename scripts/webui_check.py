"""Open WebUI, in headless Chromium, against loractld's Ollama API (issue 39, item 5).

Starts ``loractld --model demo --http 127.0.0.1:PORT`` (or uses the daemon at ``--url``), starts
Open WebUI with the daemon as its only Ollama server and offline settings, and drives it in
headless Chromium (Debian's ``chromium`` and ``chromium-driver``) with Selenium, as a user would:

0. before Open WebUI starts, ``loractl create sql-pirate -f Modelfile``: a profile (issue 47) of
   the base model, ``sql-expert/v1=0.7`` and ``pirate/v1=0.3`` (merged), a system prompt,
   temperature 0 and num_predict 64; and ``loractl run --lora sql-pirate "Tell me about your
   ship"``, the answer Open WebUI must give;
1. open the model picker: every model the daemon lists is there (the adapters, the profile);
2. pick ``sql-expert:v1``, ask "List all users older than 30": the answer is SQL (``SELECT``);
3. a new chat with ``pirate:v1``, ask "Tell me about your ship": the answer talks like a pirate;
4. a new chat with ``sql-pirate:latest``, ask the same question as in 0: the page shows
   ``loractl run``'s answer, and the message Open WebUI stored (its chat API: what its Copy
   button gives) is that text exactly. Open WebUI reaches the daemon through a recording proxy,
   so the check also sees what it sent: an option that would override the profile's value, or a
   system message of its own (which replaces the profile's), is a failure named as such, and the
   text the daemon streamed back must equal ``loractl run``'s too. The page renders Markdown, so
   its text equals the answer only for an answer without Markdown (``COUNT(*) ... COUNT(*)``
   shows in italics, without its asterisks): the question is one whose answer has none.

Each step writes a PNG screenshot to ``--out``; the script prints timings and exits non-zero on
any failure. Run it with ``bash scripts/webui_check.sh`` (it installs what is missing: the
browser, Open WebUI and Selenium in ``.venv-webui``), or directly with that venv's Python:

    .venv-webui/bin/python scripts/webui_check.py --out /tmp/shots

Open WebUI's model defaults (what Admin Panel > Settings > Models writes) set temperature 0, so
the answers are the greedy ones the socket gives, and turn its built-in tools off (Open WebUI
sends tools of its own with every chat otherwise; the demo's /api/show lists no "tools"
capability, and a daemon run without a tool parser refuses requests with tools). Title, tag
and follow-up generation are off: each would be one more generation per answer on a 2-core
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
ADAPTERS = ("sql-expert/v1", "pirate/v1")
SQL_PROMPT = "List all users older than 30"
PIRATE_PROMPT = "Tell me about your ship"
# Issue 47's done-when: a Modelfile of a base, two weighted adapters, a system prompt and
# parameters becomes one name Open WebUI picks and answers with as `loractl run` does.
PROFILE = "sql-pirate"
PROFILE_PROMPT = PIRATE_PROMPT   # pirate:v1 answers it in prose; the profile, in SQL
PROFILE_PARAMETERS = {"temperature": 0, "num_predict": 64}
MODELFILE = """FROM {base}
ADAPTER sql-expert/v1=0.7
ADAPTER pirate/v1=0.3
SYSTEM \"\"\"You are a pirate who answers with one SQL query.\"\"\"
""" + "".join(f"PARAMETER {k} {v}\n" for k, v in PROFILE_PARAMETERS.items())


def log(msg: str) -> None:
    print(f"webui-check: {msg}", flush=True)


class Failed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None, what: str, logfile: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise Failed(f"{what} exited with {proc.returncode}; its log ({logfile}):\n"
                         + logfile.read_text(errors="replace")[-3000:])
        with contextlib.suppress(OSError):
            if http_get(url, timeout=5)[0] == 200:
                return
        time.sleep(1)
    raise Failed(f"{what} did not answer {url} in {timeout:.0f} s; its log: {logfile}")


def stop(proc: subprocess.Popen | None, what: str) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        log(f"{what} did not stop in 30 s; killing it")
        proc.kill()
        proc.wait()


# --- the daemon ---------------------------------------------------------------------------

def seed_home(home: Path, cache: Path) -> None:
    """Give a new home the demo already built in ``cache`` (the test suite's ``.cache/real-demo``),
    as hard links (a copy across file systems): the daemon then finds every part stamped instead
    of fetching the model and training the adapters again. The build replaces files, never
    writes into one, so the two homes cannot change each other's."""
    if (home / "demo").exists() or not (cache / "demo" / "adapters").is_dir():
        return
    log(f"reusing the demo built in {cache}")

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    skip = lambda folder, names: [n for n in names if n == ".build.lock" or  # noqa: E731
                                  (n.startswith(".") and (Path(folder) / n).is_dir())]   # half-built parts
    for part in ("models", "demo"):   # demo last: its presence says the seed is whole
        if (cache / part).is_dir():
            shutil.copytree(cache / part, home / part, copy_function=link, ignore=skip, dirs_exist_ok=True)


def start_daemon(args) -> tuple[subprocess.Popen, str, dict]:
    home = args.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    seed_home(home, args.demo_cache)
    env = {**os.environ, "LORACTL_HOME": str(home)}
    port = args.daemon_port or free_port()
    logfile = home / "loractld.log"
    log(f"starting loractld --model demo --http 127.0.0.1:{port} (LORACTL_HOME={home}, log: {logfile})")
    proc = subprocess.Popen([str(args.loractl_bin / "loractld"), "--model", "demo", "--http", f"127.0.0.1:{port}"],
                            stdout=open(logfile, "w"), stderr=subprocess.STDOUT, env=env)
    wait = subprocess.run([str(args.loractl_bin / "loractl"), "status", "--wait", "--timeout", "1800"],
                          env=env, stdout=subprocess.DEVNULL)
    if wait.returncode != 0:
        stop(proc, "loractld")
        raise Failed(f"loractld did not start; its log ({logfile}):\n" + logfile.read_text(errors="replace")[-3000:])
    for name in ADAPTERS:
        if subprocess.run([str(args.loractl_bin / "loractl"), "show", name], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
            log(f"loractl pull $LORACTL_HOME/demo/adapters/{name} --name {name}")
            subprocess.run([str(args.loractl_bin / "loractl"), "pull", str(home / "demo" / "adapters" / name),
                            "--name", name], env=env, check=True, stdout=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", env


def loractl(args, env: dict, *argv: str) -> str:
    """``loractl ARGV``'s stdout; a failure is the check's, with loractl's own words."""
    done = subprocess.run([str(args.loractl_bin / "loractl"), *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failed(f"loractl {' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def make_profile(args, env: dict, url: str, folder: Path) -> str:
    """``loractl create sql-pirate -f Modelfile`` (FROM the daemon's base model), then what
    ``loractl run --lora sql-pirate PROFILE_PROMPT`` answers: the text Open WebUI must show."""
    code, body = http_get(url + "/v1/models")
    bases = [m["id"] for m in json.loads(body)["data"] if m.get("loractl", {}).get("kind") == "base"] if code == 200 else []
    if not bases:
        raise Failed(f"GET {url}/v1/models names no base model (answered {code}: {body[:300]!r})")
    modelfile = folder / "Modelfile"
    modelfile.write_text(MODELFILE.format(base=bases[0]))
    log("loractl create {} -f Modelfile, with this Modelfile:\n    {}".format(
        PROFILE, modelfile.read_text().strip().replace("\n", "\n    ")))
    log(loractl(args, env, "create", PROFILE, "-f", str(modelfile)).strip().replace("\n", " "))
    answer = loractl(args, env, "run", "--lora", PROFILE, PROFILE_PROMPT)
    answer = answer[:-1] if answer.endswith("\n") else answer   # run ends the answer with a newline
    log(f"loractl run --lora {PROFILE} {PROFILE_PROMPT!r}: {answer!r}")
    return answer


class Recorder:
    """A pass-through HTTP proxy between Open WebUI and the daemon that keeps each ``/api/chat``
    request and the text streamed back: what Open WebUI sent (its options, a system message of
    its own) and what it was answered, beside what its page shows."""

    def __init__(self, target: str):
        self.chats: list[dict] = []
        host = urlsplit(target)
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items()   # identity encoding: the stream is read here
                           if k.lower() not in ("host", "connection", "accept-encoding", "transfer-encoding")}
                conn = http.client.HTTPConnection(host.hostname, host.port, timeout=900)
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")   # the end of the body is the end of the connection
                self.end_headers()
                record = None
                if self.command == "POST" and self.path.startswith("/api/chat"):
                    record = {"request": json.loads(body or b"{}"), "raw": b""}
                    recorder.chats.append(record)
                while chunk := resp.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    if record is not None:
                        record["raw"] += chunk
                conn.close()
                if record is not None:
                    lines = [json.loads(ln) for ln in record["raw"].splitlines() if ln.strip()]
                    record["text"] = "".join(ln.get("message", {}).get("content", "") for ln in lines)

            do_GET = do_POST = do_HEAD = do_DELETE = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def last_chat(self, model: str) -> dict | None:
        return next((c for c in reversed(self.chats) if c["request"].get("model") == model), None)


def compare(record: dict | None, stored: str | None, shown: str, expected: str) -> list[str]:
    """Why Open WebUI's answer with the profile is not ``loractl run``'s, if it is not: what it
    sent that overrides the profile, what it received, what it stored, what its page shows."""
    if record is None:
        return [f"no /api/chat request for {PROFILE}:latest reached the daemon"]
    request = record["request"]
    options = request.get("options") or {}
    log(f"Open WebUI sent POST /api/chat with options={json.dumps(options)}, message roles="
        f"{[m.get('role') for m in request.get('messages', [])]}, other fields="
        f"{json.dumps({k: v for k, v in request.items() if k not in ('messages', 'options', 'model')})}")
    failures = [f"Open WebUI sent options.{k}={options[k]!r}, which overrides the profile's {k} {v!r}"
                for k, v in PROFILE_PARAMETERS.items() if k in options and options[k] != v]
    if any(m.get("role") == "system" for m in request.get("messages", [])):
        failures.append("Open WebUI sent a system message, which replaces the profile's SYSTEM")
    if record.get("text") != expected:
        failures.append(f"the daemon streamed {record.get('text')!r} to Open WebUI; loractl run answered {expected!r}")
    log(f"Open WebUI stored the answer {stored!r} (its chat API)")
    if stored != expected:
        failures.append(f"Open WebUI stored the answer {stored!r}; loractl run answered {expected!r}")
    if " ".join(shown.split()) != " ".join(expected.split()):
        markdown = " (its Markdown rendering: choose a question whose answer has no *, _ or `)" \
            if re.sub(r"[*_`]", "", shown) == re.sub(r"[*_`]", "", expected) else ""
        failures.append(f"Open WebUI shows {shown!r}; loractl run answered {expected!r}{markdown}")
    return failures


# --- Open WebUI ---------------------------------------------------------------------------

def webui_env(data_dir: Path, ollama_url: str) -> dict:
    """Open WebUI's settings for this check: offline, single user, the daemon as its only server."""
    return {
        **os.environ,
        "DATA_DIR": str(data_dir),
        "OLLAMA_BASE_URL": ollama_url,          # the daemon stands in for Ollama
        "ENABLE_OLLAMA_API": "true",
        "ENABLE_OPENAI_API": "false",           # no OpenAI connection: only the daemon's models are listed
        "WEBUI_AUTH": "False",                  # single user, no login page
        "WEBUI_SECRET_KEY": "webui-check",      # else it writes .webui_secret_key into the working folder
        "OFFLINE_MODE": "true",                 # no update checks, no model downloads (sets HF_HUB_OFFLINE)
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL": "",              # no sentence-transformers model loaded at start
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "ENABLE_TITLE_GENERATION": "false",     # each of these is one more generation per answer
        "ENABLE_TAGS_GENERATION": "false",
        "ENABLE_FOLLOW_UP_GENERATION": "false",
        "ENABLE_AUTOCOMPLETE_GENERATION": "false",
        "ENABLE_EVALUATION_ARENA_MODELS": "false",  # no "Arena Model" entry in the picker
        # Admin Panel > Settings > Models, the defaults for every model: greedy decoding, so the
        # answers are the ones the socket gives at temperature 0; and no built-in tools (Open
        # WebUI sends its own tools, e.g. get_current_timestamp, to every model unless told
        # not to; a daemon started without --tool-call-parser refuses a request with tools).
        "DEFAULT_MODEL_PARAMS": json.dumps({"temperature": 0}),
        "DEFAULT_MODEL_METADATA": json.dumps({"capabilities": {"builtin_tools": False}}),
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
        "ANONYMIZED_TELEMETRY": "false",
        "GLOBAL_LOG_LEVEL": "WARNING",
    }


def start_webui(args, ollama_url: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = args.webui_port or free_port()
    logfile = data_dir / "open-webui.log"
    exe = args.webui_venv / "bin" / "open-webui"
    log(f"starting Open WebUI on 127.0.0.1:{port} with OLLAMA_BASE_URL={ollama_url} (log: {logfile})")
    proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=data_dir,
                            env=webui_env(data_dir, ollama_url), stdout=open(logfile, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", args.start_timeout, proc, "Open WebUI", logfile)
    return proc, url


# --- the browser --------------------------------------------------------------------------

def browser(args):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = args.chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1280,800", "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(args.chromedriver))


def wait_for(fn, timeout: float, what: str, poll: float = 0.25):
    end = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < end:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - elements come and go while the page renders
            last_error = e
        time.sleep(poll)
    raise Failed(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last_error})" if last_error else ""))


class UI:
    def __init__(self, driver, url: str, out: Path):
        from selenium.webdriver.common.by import By

        self.d, self.url, self.out, self.By = driver, url, out, By

    def css(self, selector: str):
        return self.d.find_elements(self.By.CSS_SELECTOR, selector)

    def shot(self, name: str) -> Path:
        path = self.out / name
        self.d.save_screenshot(str(path))
        log(f"screenshot {path}")
        return path

    def box(self, elements, pad: int = 12, left: int = 0, bottom: int | None = None) -> tuple[int, int, int, int]:
        """The box around some elements, in the screenshot's pixels, padded."""
        rects = [e.rect for e in elements]
        return (max(0, int(min(r["x"] for r in rects)) - pad - left),
                max(0, int(min(r["y"] for r in rects)) - pad),
                int(max(r["x"] + r["width"] for r in rects)) + pad,
                int(max(r["y"] + r["height"] for r in rects)) + (pad if bottom is None else bottom))

    def picker_box(self) -> tuple[int, int, int, int]:
        # The button and the whole drop-down (the list's grandparent holds the search box too).
        dropdown = self.css("#model-selector-list")[0].find_element(self.By.XPATH, "../..")
        return self.box(self.css("#model-selector-model-button") + [dropdown], pad=10)

    def exchange_box(self, prompt: str) -> tuple[int, int, int, int]:
        """The question, the model's name (and its avatar, left of it) and its answer."""
        asked = self.d.find_elements(self.By.XPATH, f"//*[normalize-space(text())={json.dumps(prompt)}]")
        name = self.css("#response-message-model-name")
        return self.box(asked[-1:] + name[-1:] + self.css("#response-content-container")[-1:], pad=16, left=40,
                        bottom=8)

    def dismiss_popups(self) -> None:
        # The "What's New" release notes open on a first visit; its button closes them.
        for b in self.d.find_elements(self.By.XPATH, "//button[contains(., \"Okay, Let's Go!\")]"):
            with contextlib.suppress(Exception):
                b.click()
                time.sleep(0.5)

    def open(self) -> None:
        self.d.get(self.url + "/")
        wait_for(lambda: self.css("#chat-input"), 120, "the chat input")
        time.sleep(1)
        self.dismiss_popups()

    def picker_items(self) -> list[str]:
        return [e.text.strip() for e in self.css("#model-selector-list [role=option]")
                if e.text.strip()]

    def open_picker(self) -> list[str]:
        wait_for(lambda: self.css("#model-selector-model-button"), 60, "the model picker button")[0].click()
        return wait_for(self.picker_items, 60, "the model picker's list")

    def pick(self, name: str, shot: str | None = None) -> None:
        if not self.css("#model-search-input"):
            self.open_picker()
        search = wait_for(lambda: self.css("#model-search-input"), 30, "the model search box")[0]
        search.send_keys(name)
        time.sleep(0.5)

        def item():
            hits = [e for e in self.css("#model-selector-list [role=option]")
                    if e.text.strip().split("\n")[0].strip() == name]
            return hits[0] if hits else None
        found = wait_for(item, 30, f"{name} in the model picker")
        if shot:
            time.sleep(0.5)
            self.shot(shot)
        found.click()
        wait_for(lambda: name in self.css("#model-selector-model-button")[0].text, 30, f"{name} selected")

    def ask(self, prompt: str, timeout: float) -> str:
        box = wait_for(lambda: self.css("#chat-input"), 30, "the chat input")[0]
        box.click()
        box.send_keys(prompt)
        time.sleep(0.3)
        wait_for(lambda: self.css("#send-message-button"), 30, "the send button")[0].click()

        seen = {"text": "", "since": time.monotonic()}

        def answer():
            # Done when the stream has ended: no Stop button, and the answer unchanged for 2 s.
            if self.d.find_elements(self.By.XPATH, "//button[@aria-label='Stop']"):
                seen["since"] = time.monotonic()
                return None
            texts = [e.text.strip() for e in self.css("#response-content-container")]
            text = texts[-1] if texts else ""
            if text != seen["text"]:
                seen.update(text=text, since=time.monotonic())
                return None
            return text if text and time.monotonic() - seen["since"] >= 2 else None
        return wait_for(answer, timeout, f"the answer to {prompt!r}", poll=0.5)


    def stored_answer(self) -> str | None:
        """The last answer as Open WebUI stored it (GET /api/v1/chats/ID, with the page's token)."""
        chat = self.d.execute_async_script("""
            const done = arguments[arguments.length - 1];
            fetch('/api/v1/chats/' + location.pathname.split('/c/')[1],
                  {headers: {Authorization: 'Bearer ' + localStorage.token}})
              .then(r => r.json()).then(done, e => done({error: String(e)}));""")
        history = (chat.get("chat") or {}).get("history") or {}
        message = (history.get("messages") or {}).get(history.get("currentId") or "") or {}
        if message.get("role") != "assistant":
            log(f"Open WebUI's chat API gave no answer: {json.dumps(chat)[:500]}")
            return None
        return message.get("content")


def summary(crops: list[tuple[Path, tuple[int, int, int, int]]], path: Path) -> None:
    """One image for the README: the picker, then each exchange, cut from the screenshots."""
    from PIL import Image, ImageDraw

    parts = [Image.open(png).convert("RGB").crop(box) for png, box in crops]
    gap = 10
    width = max(p.width for p in parts)
    image = Image.new("RGB", (width, sum(p.height for p in parts) + gap * (len(parts) - 1)), "white")
    y = 0
    for i, part in enumerate(parts):
        if i:
            ImageDraw.Draw(image).line([(0, y - gap // 2), (width, y - gap // 2)], fill=(225, 225, 225))
        image.paste(part, (0, y))
        y += part.height + gap
    image.save(path, optimize=True)
    log(f"summary image {path}")


# --- the check ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running daemon's HTTP door (http://127.0.0.1:PORT) with sql-expert/v1 and "
                                 "pirate/v1 stored, the one loractl reaches (it creates the profile there); "
                                 "default: start loractld --model demo")
    p.add_argument("--home", type=Path, default=REPO / ".cache" / "webui-check" / "home",
                   help="LORACTL_HOME of the daemon started here (the demo is built there once; default %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / ".cache" / "webui-check" / "shots",
                   help="folder for the screenshots (default %(default)s)")
    p.add_argument("--demo-cache", type=Path, default=REPO / ".cache" / "real-demo",
                   help="a home whose demo build a new --home reuses (default %(default)s)")
    p.add_argument("--loractl-bin", type=Path, default=REPO / ".venv" / "bin")
    p.add_argument("--webui-venv", type=Path, default=REPO / ".venv-webui")
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    p.add_argument("--chromedriver", default=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    p.add_argument("--daemon-port", type=int, default=0)
    p.add_argument("--webui-port", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300, help="seconds for Open WebUI to start")
    p.add_argument("--answer-timeout", type=float, default=300, help="seconds for each answer")
    p.add_argument("--keep-data", action="store_true", help="keep Open WebUI's data folder (its log is there)")
    args = p.parse_args(argv)
    for name in ("home", "demo_cache", "out", "loractl_bin", "webui_venv"):  # Open WebUI runs in a folder of its own
        setattr(args, name, getattr(args, name).absolute())
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    timings: list[tuple[str, float]] = []

    def mark(what: str, since: float) -> float:
        now = time.monotonic()
        timings.append((what, now - since))
        log(f"{what}: {now - since:.1f} s")
        return now

    daemon = webui = driver = None
    data_dir = Path(tempfile.mkdtemp(prefix="webui-check-"))
    failures: list[str] = []
    try:
        t = time.monotonic()
        if args.url:
            url = args.url.rstrip("/")
            url = url[:-3] if url.endswith("/v1") else url
            env = dict(os.environ)   # loractl reaches that daemon as the user's loractl does
        else:
            daemon, url, env = start_daemon(args)
            t = mark("daemon ready (loractl status --wait, adapters pulled)", t)
        expected = make_profile(args, env, url, data_dir)   # before Open WebUI reads the model list
        t = mark(f"profile {PROFILE} created, loractl run answered", t)
        code, body = http_get(url + "/api/tags")
        if code != 200:
            raise Failed(f"GET {url}/api/tags answered {code}: {body[:500]!r}")
        tags = [m["name"] for m in json.loads(body)["models"]]
        log(f"GET /api/tags: {tags}")
        want = [n.replace("/", ":") for n in ADAPTERS] + [f"{PROFILE}:latest"]
        missing = [n for n in want if n not in tags]
        if missing:
            raise Failed(f"the daemon does not list {missing}; pull them first "
                         f"(loractl pull $LORACTL_HOME/demo/adapters/sql-expert/v1 --name sql-expert/v1)")

        recorder = Recorder(url)
        log(f"Open WebUI reaches the daemon through a recording proxy: {recorder.url} -> {url}")
        webui, webui_url = start_webui(args, recorder.url, data_dir)
        t = mark("Open WebUI started", t)

        driver = browser(args)
        ui = UI(driver, webui_url, args.out)
        ui.open()
        t = mark("browser opened Open WebUI", t)

        items = ui.open_picker()
        time.sleep(1)
        ui.shot("1-model-picker.png")
        crops = [(args.out / "1-model-picker.png", ui.picker_box())]
        listed = [i.split("\n")[0].strip() for i in items]
        log(f"model picker lists: {listed}")
        for name in tags:
            if name not in listed:
                failures.append(f"the model picker does not list {name} (it lists {listed})")

        def judge(ok, what: str):
            return lambda model, a: [] if ok(a) else [f"{model}'s answer is not {what}: {a!r}"]
        checks = [("sql-expert:v1", SQL_PROMPT, "2-sql-expert.png",
                   judge(lambda a: "SELECT" in a.upper() and "FROM" in a.upper(), "SQL (SELECT ... FROM)")),
                  ("pirate:v1", PIRATE_PROMPT, "3-pirate.png",
                   judge(lambda a: bool(re.search(r"\b(arr+|matey|ye|ahoy|aye|hearties)\b|\bo'\s", a, re.I)),
                         "pirate speak (arr, matey, ye, ahoy, aye, o')")),
                  (f"{PROFILE}:latest", PROFILE_PROMPT, "5-sql-pirate.png",
                   lambda model, a: compare(recorder.last_chat(model), ui.stored_answer(), a, expected))]
        for i, (model, prompt, png, check) in enumerate(checks):
            if i:
                ui.open()  # a new chat
            ui.pick(model, shot="4-sql-pirate-picked.png" if model.startswith(PROFILE) else None)
            t = time.monotonic()
            answer = ui.ask(prompt, args.answer_timeout)
            t = mark(f"{model} answered", t)
            ui.shot(png)
            crops.append((args.out / png, ui.exchange_box(prompt)))
            log(f"{model} <- {prompt!r}: {answer!r}")
            failures += check(model, answer)
        summary(crops, args.out / "webui-check.png")
    except Exception as e:  # noqa: BLE001 - ours or Selenium's: keep a screenshot of the page
        failures.append(str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}")
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.save_screenshot(str(args.out / "failure.png"))
                (args.out / "failure.html").write_text(driver.page_source)
                log(f"the page at the failure: {args.out / 'failure.png'}, {args.out / 'failure.html'}")
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.quit()
        stop(webui, "Open WebUI")
        stop(daemon, "loractld")
        if args.keep_data or failures:
            log(f"Open WebUI's data folder (with its log): {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)

    total = time.monotonic() - t0
    for what, secs in timings:
        print(f"  {secs:7.1f} s  {what}")
    print(f"  {total:7.1f} s  in all")
    if failures:
        for f in failures:
            log(f"FAILED: {f}")
        return 1
    log(f"passed in {total:.0f} s (screenshots in {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
