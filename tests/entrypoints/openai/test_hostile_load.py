"""Hostile grammars and hostile chat templates beside normal requests, through the live server.

Clients keep sending grammars that are deep, huge, unsatisfiable or slow to compile, and chat
templates that loop for ever or allocate until they run out of memory, while normal requests
(a completion whose long prompt is tokenized on a worker thread, and a chat request on the
server's template) arrive every 0.1 s. Each kind's median latency must stay within 2x of its
idle median, every hostile request must be answered at once with a clear 400 (or a 503 with
``Retry-After`` from a full queue), and afterwards the engine core's and the API process's
memory must be back at their baseline. On a loaded 2-core machine it takes about 20 s.

What it guards: a grammar compiled on the engine thread holds every step for the whole
compilation (seconds here, minutes for the issue's 100,000-string enum), and a chat template
rendered on the threads that also tokenize long prompts makes those prompts wait for the
templates' budgets; either makes the normal requests' median many times idle.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import statistics
import time

import httpx
import pytest

from tests.live_server import API_KEY, MODEL_NAME, memory_use

pytest.importorskip("xgrammar")  # the shared server's grammar backend ("auto")

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
# The stress's compile budget: the slow grammars below take seconds of CPU on this vocabulary
# (the 50,000-item enum about 2.5 s, the 50,000-string choice 1.3 s on one core), so they are
# abandoned and refused; set on the shared server for the test and restored after.
COMPILE_TIMEOUT_S = 0.5


def _body(route: str, **fields) -> tuple[str, bytes]:
    base = {"model": MODEL_NAME, "max_tokens": 4}
    base |= {"messages": MESSAGES} if route == "chat/completions" else {"prompt": "Once upon"}
    return f"/v1/{route}", json.dumps(base | fields).encode()


def _nested_object(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# Name -> (request, what its 400 says). The first two each take seconds of compile-worker CPU.
HOSTILE_GRAMMARS = {
    "choice 50k": (
        _body("completions", guided_choice=[f"x{i}" for i in range(50_000)]),
        "grammar_compile_timeout_s",
    ),
    "enum 50k": (
        _body(
            "chat/completions",
            response_format=_json_schema({"enum": [f"e{i:06d}" for i in range(50_000)]}),
        ),
        "grammar_compile_timeout_s",
    ),
    "enum 100k": (
        _body("completions", guided_json={"enum": [f"item{i:06d}" for i in range(100_000)]}),
        "max_grammar_bytes",
    ),
    "deep schema": (_body("completions", guided_json=_nested_object(440)), "deeper than"),
    "left-recursive grammar": (
        _body("completions", guided_grammar='root ::= root "a"'),
        "matches no complete text",
    ),
    "empty regex": (_body("completions", guided_regex=r"[^\s\S]"), "matches no complete text"),
    "external ref": (
        _body("completions", guided_json={"$ref": "file:///etc/passwd"}),
        "external $ref",
    ),
    "64-bit overflow": (
        _body("completions", guided_json={"type": "integer", "maximum": 10**40}),
        "64-bit",
    ),
}
# A grammar client's pause between an answer and its next request. The slow grammars' abandoned
# compilations run on for seconds, so one resent every second keeps the compile workers busy;
# resending megabyte bodies at once would measure the API process's JSON parsing (50-130 ms
# of its event loop for each of these bodies), not the grammars.
GRAMMAR_PAUSE_S = 0.3
# The core's refusal (503) while compilations past their budget still run.
BUSY = "grammar compilations past their time budget are still running"
SLOW = ("choice 50k", "enum 50k")

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Sixty million small strings: the worker's 2 GiB address-space cap (or its time budget) ends it.
MEMORY_BOMB = "{% set l = ('xy,' * 60000000).split(',') %}{{ l | length }}"
# More than the sandbox's 2 workers + 6 queued, and than the threads that tokenize long
# prompts (asyncio's default executor: cpu_count + 4, at most 32), which they would fill if
# templates rendered there.
NUM_TEMPLATE_CLIENTS = min(32, (os.cpu_count() or 1) + 4) + 4

# The normal requests, by kind: a completion whose 5,100-character prompt is tokenized on a
# worker thread (as every prompt over 4,096 characters is), and a chat request on the server's
# own template.
NORMAL = {
    "completion": _body(
        "completions",
        prompt="Once upon a time " * 300,
        truncate_prompt_tokens=32,
        max_tokens=32,
        ignore_eos=True,
        temperature=0.0,
    ),
    "chat": _body("chat/completions", max_tokens=32, ignore_eos=True, temperature=0.0),
}
# Normal requests arrive every INTERVAL_S whether or not the earlier ones are answered (an open
# loop): a request sent only after the previous answer would see a server blocked for seconds
# once, then slip through the gaps, while requests arriving at set times meet each blockage
# in proportion to its length.
INTERVAL_S = 0.1
IDLE_S = 2.0  # 10 requests of each kind
BUSY_S = 3.0  # beside the hostile ones: a template budget (2 s) and several grammar budgets


async def _timed(http: httpx.AsyncClient, kind: str) -> tuple[str, float]:
    path, body = NORMAL[kind]
    started = time.perf_counter()
    response = await http.post(path, content=body)
    assert response.status_code == 200, response.text
    return kind, time.perf_counter() - started


async def _normal_latencies(http, duration_s: float, probe=None) -> tuple[dict, int]:
    """Each kind's latencies (seconds) of normal requests sent every ``INTERVAL_S`` for
    ``duration_s``, and at how many sends ``await probe()`` was true."""
    tasks, hits, kinds = [], 0, list(NORMAL)
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(_timed(http, kinds[len(tasks) % len(kinds)])))
        hits += bool(probe and await probe())
        await asyncio.sleep(INTERVAL_S)
    latencies = collections.defaultdict(list)
    for kind, seconds in await asyncio.gather(*tasks):
        latencies[kind].append(seconds)
    return dict(latencies), hits


async def _grammar_client(http, names, stop: asyncio.Event, answers: list, slow: list) -> None:
    """Send ``names``' requests in turn until ``stop``, backing off as a 503's ``Retry-After``
    says, and pausing ``GRAMMAR_PAUSE_S`` after other answers."""
    while not stop.is_set():
        for name in names:
            path, body = HOSTILE_GRAMMARS[name][0]
            slow[0] += name in SLOW
            try:
                response = await http.post(path, content=body)
            finally:
                slow[0] -= name in SLOW
            retry = response.headers.get("Retry-After")
            answers.append((name, response.status_code, response.json(), retry))
            await asyncio.sleep(float(retry) if response.status_code == 503 else GRAMMAR_PAUSE_S)


async def _template_client(http, index: int, stop: asyncio.Event, statuses) -> None:
    sent = 0
    while not stop.is_set():
        sent += 1
        template = MEMORY_BOMB if (index + sent) % 5 == 0 else NESTED_LOOPS
        path, body = _body("chat/completions", max_tokens=1, chat_template=template)
        response = await http.post(path, content=body)
        statuses[response.status_code] += 1
        if response.status_code == 503:  # a full queue: back off as Retry-After says
            await asyncio.sleep(float(response.headers["Retry-After"]))
        else:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "chat_template"


async def _hostile_phase(server, http) -> tuple[dict, list, collections.Counter, int]:
    """The normal requests' latencies beside the hostile clients (by kind), the grammar
    answers, the template statuses, and at how many normal sends hostile work was running."""
    sandbox = server.app.state.chat.template_sandbox
    stop, answers, statuses = asyncio.Event(), [], collections.Counter()
    slow = [0]  # slow grammars sent and not answered yet
    grammar_clients = [[name] for name in SLOW] + [sorted(set(HOSTILE_GRAMMARS) - set(SLOW))]
    tasks = [
        asyncio.create_task(_grammar_client(http, names, stop, answers, slow))
        for names in grammar_clients
    ]
    tasks += [
        asyncio.create_task(_template_client(http, i, stop, statuses))
        for i in range(NUM_TEMPLATE_CLIENTS)
    ]

    async def hostile_running() -> bool:
        """A slow grammar compiles (or waits for its answer) and templates render."""
        if not sandbox.num_admitted:
            return False
        return slow[0] > 0 or await asyncio.to_thread(server.call, "num_compiling_grammars") > 0

    try:
        deadline = time.monotonic() + 30
        while not await hostile_running():  # both kinds are at work before measuring
            assert time.monotonic() < deadline, "the hostile requests never started"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # past the first burst of hostile bodies
        latencies, overlapped = await _normal_latencies(http, BUSY_S, hostile_running)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return latencies, answers, statuses, overlapped


def _check_grammar_answers(answers: list) -> None:
    """Every hostile grammar got its 400, naming its field and reason, or a 503 with
    ``Retry-After`` while too many compilations past their budget still ran; the slow ones
    may also compile within the budget on a fast machine (then they are served: 200)."""
    seen = collections.Counter(name for name, *_ in answers)
    assert set(seen) == set(HOSTILE_GRAMMARS), seen
    timed_out = 0
    for name, status, body, retry_after in answers:
        if status == 200:
            assert name in SLOW, (name, body)
            continue
        message = body["error"]["message"]
        if status == 503:
            assert BUSY in message and retry_after == "1", (name, body, retry_after)
            continue
        assert status == 400, (name, status, body)
        timed_out += "grammar_compile_timeout_s" in message
        assert HOSTILE_GRAMMARS[name][1] in message, (name, message)
        assert body["error"]["param"], (name, body)
    assert timed_out, answers  # the time budget refused a slow grammar at least once


def test_hostile_grammars_and_templates_beside_normal_requests(server):
    sandbox = server.app.state.chat.template_sandbox

    async def run():
        limits = httpx.Limits(max_connections=NUM_TEMPLATE_CLIENTS + 8)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as http:
            # Warm: the step programs of every batch the open loop may form, the tokenizer, the
            # server's template.
            for burst in (4, 2, 1):
                await asyncio.gather(*[_timed(http, list(NORMAL)[i % 2]) for i in range(burst)])
            await _normal_latencies(http, 1.0)
            # The grammar backend is imported (torch, seconds) on a compile worker at start-up:
            # a constrained request waits for it, so the baseline is taken after it.
            path, body = _body("completions", guided_regex="[a-z]+", max_tokens=2)
            assert (await http.post(path, content=body)).status_code == 200
            await asyncio.to_thread(sandbox.render, "{{ 1 }}", {})  # the template workers
            idle, _ = await _normal_latencies(http, IDLE_S)
            before = _memory(server, sandbox)
            previous = await asyncio.to_thread(
                server.call, "set_grammar_compile_timeout", COMPILE_TIMEOUT_S
            )
            try:
                phase = await _hostile_phase(server, http)
            finally:
                await asyncio.to_thread(server.call, "set_grammar_compile_timeout", previous)
            return idle, before, phase

    started = time.monotonic()
    try:
        idle, before, (busy, answers, statuses, overlapped) = asyncio.run(run())
    finally:  # the next tests on this server find no compilation past its budget running
        _wait_for_compilations(server)
    took_s = time.monotonic() - started
    # 1. Normal requests beside the hostile ones: each kind's median within 2x of its idle
    # median. The 10 ms is for timer and scheduling noise on a loaded 2-core machine, where
    # idle is 10-20 ms; a request that waits on a grammar or a template waits for seconds.
    shown = {
        f"{kind} {phase} ms": [round(t * 1e3) for t in latencies[kind]]
        for phase, latencies in (("idle", idle), ("busy", busy))
        for kind in NORMAL
    }
    for kind in NORMAL:
        idle_s, busy_s = statistics.median(idle[kind]), statistics.median(busy[kind])
        assert busy_s <= 2 * idle_s + 0.01, (kind, shown)
    sends = sum(map(len, busy.values()))
    assert 2 * overlapped >= sends, (overlapped, sends)  # most beside running hostile work
    # 2. Every hostile request had its clear answer.
    _check_grammar_answers(answers)
    assert statuses[400] >= 2 and set(statuses) <= {400, 503}, statuses
    # 3. Memory back to baseline, once the abandoned compilations have run out (above).
    assert server.wait_idle()["num_free_blocks"] == before["num_gpu_blocks"]
    after = _memory(server, sandbox)
    _check_memory(before, after)
    print(f"stress: {shown}; {took_s:.1f} s to the end of the hostile clients; {overlapped}/{sends} sends beside "
          f"hostile work; memory { {k: (before[k], after[k]) for k in before} }; templates "
          f"{dict(statuses)}")  # fmt: skip


def _wait_for_compilations(server, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.call("num_compiling_grammars"):
        assert time.monotonic() < deadline, "abandoned grammar compilations still run"
        time.sleep(0.05)


def _memory(server, sandbox) -> dict:
    stats = server.call("get_stats")
    return {
        "core": server.call("memory_use"),
        "api": memory_use(),
        "template_workers_rss": [_rss(pid) for pid in sandbox.worker_pids()],
        "grammar_cache_bytes": stats["grammar_cache_bytes"],
        "num_gpu_blocks": stats["num_gpu_blocks"],
    }


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # the worker was just recycled
        return 0


def _check_memory(before: dict, after: dict) -> None:
    """What the hostile requests left behind, beyond what the bounded grammar cache holds more
    (a slow grammar served on a fast machine stays cached; it is reported and bounded).

    Engine core. In use (malloc's bytes handed out and Python's tracked objects): back to
    baseline, within 16 MB and 5,000 objects. Each hostile grammar compiled here holds
    65-110 MB (the issue's 100,000-string enum 465 MB), so one kept alive fails this, as would
    the hostile requests' parameters (each a 50,000-item list). Resident: within 320 MB.
    What is freed is not all returned: glibc gives each compiling thread its own malloc arena
    (up to 8 per core), and the pages of an arena where a few blocks still live stay resident
    after ``malloc_trim`` (measured here: 80-300 MB after a few seconds of hostile grammars,
    with nothing of it in use; in one process, no more after further rounds). Two arenas
    (``MALLOC_ARENA_MAX=2``) bring that under 40 MB but made the engine thread share its arena
    with the compile threads: normal requests took 2.6x idle beside the compilations, against
    without (1.4-1.5x). API process: resident within 64 MB (it parsed ~50 MB of hostile bodies). Template
    workers: fresh ones, or under the sandbox's recycle bound (a memory bomb's is replaced)."""
    from jaxpaged.entrypoints.openai.template_sandbox import RECYCLE_RSS_BYTES

    cached = max(0, after["grammar_cache_bytes"] - before["grammar_cache_bytes"])
    core_before, core_after = before["core"], after["core"]
    if core_before["malloc_in_use"] is not None:  # glibc
        grown = core_after["malloc_in_use"] - core_before["malloc_in_use"]
        assert grown <= cached + (16 << 20), (before, after)
    assert core_after["python_objects"] - core_before["python_objects"] <= 5000, (before, after)
    assert core_after["rss"] - core_before["rss"] <= cached + (320 << 20), (before, after)
    assert after["api"]["rss"] - before["api"]["rss"] <= 64 << 20, (before, after)
    assert all(rss <= RECYCLE_RSS_BYTES for rss in after["template_workers_rss"]), after


def test_while_abandoned_compilations_run_a_grammar_is_a_503_with_retry_after(server):
    """Past their budget, compilations run on (the libraries cannot be stopped); with two
    still running the core refuses new grammars at once. That refusal is no fault of the
    request: a 503 with ``Retry-After`` (it was a 400 saying "retry later")."""
    previous = server.call("set_grammar_compile_timeout", 0.05)
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            statuses = []
            for n in range(3):  # ~3 s of compilation each here: both still run at the third
                path, body = _body(
                    "completions", guided_choice=[f"{n}{i:x}" for i in range(80_000)]
                )
                statuses.append(http.post(path, content=body))
    finally:
        server.call("set_grammar_compile_timeout", previous)
        _wait_for_compilations(server)  # the next tests' grammars compile
    first, second, third = statuses
    for timed_out in (first, second):
        assert timed_out.status_code == 400, timed_out.text
        assert "grammar_compile_timeout_s (0.05 s)" in timed_out.json()["error"]["message"]
    assert third.status_code == 503 and third.headers["Retry-After"] == "1", third.text
    assert BUSY in third.json()["error"]["message"]
    assert server.wait_idle()["kv_cache_usage_perc"] == 0.0
