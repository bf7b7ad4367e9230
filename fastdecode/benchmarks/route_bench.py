"""`fastdecode bench route`: `up --replicas 2` behind vllm-router, one fleet per router policy.

Phase 1, per policy: P distinct system prompts (each at least `system_tokens` tokens of the model's
tokenizer, drawn from a fixed word list with a fixed seed) times U users (a short distinct user
message each), in one seeded random order shared by every policy, streamed through the router's
OpenAI endpoint with `stream_options.include_usage`, `concurrency` in flight. Per policy: the share
of requests after each prompt's first (in send order) whose usage reports cached_tokens > 0, the
time to the first content chunk (p50, p90) and the total seconds; then cache_aware against
round_robin, same run.

Phase 2 (`kill`, on the cache_aware fleet): a steady load of short streamed requests through the
router while (1) one replica's gateway is killed with SIGKILL and (2), once `up` has restarted it,
every process of the other replica (gateway, scheduler, gpu_dense, kv_attention shards: the pids
the state file lists for it) is killed with SIGKILL at once. `up` is one supervisor for all the
replicas, not one per replica: it is left running (killing it would take both replicas' supervision
away) and, with its default `--restart on-failure`, restarts what died. So "a whole replica killed"
here means all its service processes dead at the same moment, then restored by `up`. Every request
has a deadline (`request_timeout`): one that passes it is counted as hung. The router's notice of a
kill is measured from the requests themselves: the time from the kill to the send of the first
success after which every request sent (until the next kill, or the end) succeeded.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.common import bench_workdir
from fastdecode.runtime.errors import InvalidInput
from fastdecode.tools.fleet import UpProcess, free_port, launch_up
from fastdecode.tools.replicas import POLICIES, ROUTER_NOTICE_S

WORDS = (
    "river stone lantern copper meadow harbor violet engine orchard signal canyon ember falcon "
    "glacier hollow island juniper kettle lagoon marble nectar oyster pepper quartz raven saddle "
    "thistle umber velvet willow yarrow zephyr anchor beacon cedar dune fable garnet heron indigo "
    "jasper kiln lichen mantle nimbus onyx prairie quill russet spruce tundra upland vessel wharf "
    "atlas bramble cobalt delta estuary fjord granite"
).split()
REPLICAS = 2
FAILED_PAUSE_S = 0.2  # a load stream's pause after a failed request
WHOLE_REPLICA = (
    "every service process of the replica (gateway, scheduler, gpu_dense, kv_attention shards, the "
    "pids the state file lists) killed with SIGKILL at once; `up`, one supervisor for all replicas, "
    "left running with --restart on-failure, restarts them"
)


# ---- prompts -----------------------------------------------------------------------------------------
def system_prompts(model: Path, n: int, min_tokens: int, seed: int) -> tuple[list[str], list[int]]:
    """n distinct system prompts of at least min_tokens tokens of the model's tokenizer, and their counts."""
    from fastdecode.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model)
    rng = random.Random(seed)
    prompts, counts = [], []
    for i in range(n):
        words = [f"Briefing {i}:"]
        text = " ".join(words)
        while (count := len(tok.encode(text, add_special_tokens=False))) < min_tokens:
            words += [rng.choice(WORDS) for _ in range(8)]
            text = " ".join(words)
        prompts.append(text)
        counts.append(count)
    return prompts, counts


def user_message(u: int) -> str:
    return f"User {u} here: name one word from the briefing."


def load_message(n: int) -> str:
    """The kill phase's n-th request: distinct from its first characters (no shared prefix to route by)."""
    return f"{WORDS[n % len(WORDS)]} {n} {WORDS[n * 7 % len(WORDS)]}: say a word."


def send_order(prompts: int, users: int, seed: int) -> list[tuple[int, int]]:
    order = [(p, u) for p in range(prompts) for u in range(users)]
    random.Random(seed).shuffle(order)
    return order


# ---- one streamed request ----------------------------------------------------------------------------
@dataclass
class Outcome:
    sent: float  # time.monotonic() when sent
    ended: float
    ok: bool
    hung: bool = False
    ttft: float | None = None  # seconds to the first content chunk
    cached: int = 0
    prompt_tokens: int = 0
    error: str = ""


def stream_chat(address: str, body: dict[str, Any], timeout: float) -> Outcome:
    """POST /v1/chat/completions with stream=True; every read bounded by what is left of `timeout`."""
    host, port = address.rsplit(":", 1)
    t0 = time.monotonic()
    deadline = t0 + timeout
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    out = Outcome(sent=t0, ended=t0, ok=False)
    done = finished = False
    try:
        conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
            return out
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if conn.sock is not None:
                conn.sock.settimeout(left)
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = f"stream error: {str(chunk['error'])[:200]}"
                return out
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") and out.ttft is None:
                    out.ttft = time.monotonic() - t0
                finished = finished or bool(choice.get("finish_reason"))
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                out.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out.ok = done and finished
        if not out.ok:
            out.error = "stream ended early"
    except TimeoutError:
        out.hung, out.error = True, f"no answer within {timeout:.0f} s"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        out.ended = time.monotonic()
        conn.close()
    return out


# ---- helpers ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def model_id(up: UpProcess) -> str:
    return Path(up.model).name


def warm_replicas(up: UpProcess, timeout: float) -> None:
    """One short request to each replica's gateway directly (not through the router, whose
    prefix tree it would seed): the first request of a fresh process pays one-off costs."""
    for i, r in enumerate(up.state["replicas"]):
        body = {
            "model": model_id(up),
            "messages": [{"role": "user", "content": f"warm-up {i}"}],
            "max_tokens": 2,
        }
        out = stream_chat(r["gateway"]["http"], body, timeout)
        if not out.ok:
            raise InvalidInput(f"warm-up of replica {i} failed: {out.error}")


def stop_up(up: UpProcess, timeout: float = 240) -> None:
    """Stop `up` (its supervisor may be inside a restart that waits up to 120 s); past `timeout`,
    kill it and every process its state file lists."""
    import subprocess

    try:
        up.stop(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = up.reload() if up.state_file is not None and up.state_file.exists() else up.state
        up.proc.kill()
        pids = [state["router"]["pid"]] + [
            p for i in range(len(state["replicas"])) for p in replica_pids(state, i).values()
        ]
        for pid in pids:
            with contextlib.suppress(OSError, TypeError):
                os.kill(int(pid), signal.SIGKILL)


def start_replicas(model: Path, workdir: Path, policy: str, kv_capacity: int) -> tuple[UpProcess, str]:
    port = free_port()
    up = launch_up(
        model,
        workdir,
        "--replicas",
        str(REPLICAS),
        "--http-port",
        str(port),
        "--router-policy",
        policy,
        shards=1,
        kv_capacity=kv_capacity,
        timeout=600,
    )
    return up, f"127.0.0.1:{port}"


# ---- phase 1: prefix hits per policy ----------------------------------------------------------------
def run_prefix_phase(
    up: UpProcess,
    router: str,
    prompts: list[str],
    order: list[tuple[int, int]],
    max_tokens: int,
    concurrency: int,
    timeout: float,
) -> dict[str, Any]:
    model = model_id(up)

    def one(pu: tuple[int, int]) -> Outcome:
        p, u = pu
        messages = [{"role": "system", "content": prompts[p]}, {"role": "user", "content": user_message(u)}]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return stream_chat(router, body, timeout)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(one, order))
    total = time.monotonic() - t0
    seen: set[int] = set()
    later = hits = 0
    for (p, _), out in zip(order, outs, strict=True):
        if p in seen:
            later += 1
            hits += out.ok and out.cached > 0
        seen.add(p)
    ttfts = [o.ttft for o in outs if o.ok and o.ttft is not None]
    return {
        "requests": len(outs),
        "succeeded": sum(o.ok for o in outs),
        "failed": sum(not o.ok for o in outs),
        "hung": sum(o.hung for o in outs),
        "later_requests": later,
        "later_cached": hits,
        "cached_share": round(hits / later, 3) if later else None,
        "cached_tokens_mean": round(sum(o.cached for o in outs) / len(outs), 1) if outs else None,
        "prompt_tokens_mean": round(sum(o.prompt_tokens for o in outs) / len(outs), 1) if outs else None,
        "ttft_ms_p50": ms(percentile(ttfts, 0.5)),
        "ttft_ms_p90": ms(percentile(ttfts, 0.9)),
        "total_s": round(total, 2),
        "errors": sorted({o.error for o in outs if o.error})[:5],
    }


# ---- phase 2: kills under load ------------------------------------------------------------------------
def replica_pids(state: dict[str, Any], i: int) -> dict[str, int]:
    r = state["replicas"][i]
    pids = {name: int(r[name]["pid"]) for name in ("gateway", "scheduler", "gpu_dense") if r.get(name)}
    pids.update({f"kv_attention_{k}": int(s["pid"]) for k, s in enumerate(r.get("kv_attention") or [])})
    return pids


def wait_restored(up: UpProcess, i: int, old: dict[str, int], limit: float) -> float | None:
    """Seconds until the state file lists a new, live pid for every one of `old`'s services."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            now = replica_pids(up.reload(), i)
            r = up.state["replicas"][i]
        except (OSError, ValueError, KeyError):
            now, r = {}, {}
        alive = all(
            (r.get(n) or {}).get("alive", True) for n in ("gateway", "scheduler", "gpu_dense")
        ) and all(s.get("alive", True) for s in r.get("kv_attention") or [])
        if now and alive and all(now.get(k) not in (None, v) for k, v in old.items()):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def event_figures(outs: list[Outcome], t_kill: float, t_next: float) -> dict[str, Any]:
    in_flight = [o for o in outs if o.sent < t_kill < o.ended]
    # sent after this kill; one still in flight at the next kill and failed is the next kill's
    after = sorted(
        (o for o in outs if t_kill <= o.sent < t_next and (o.ok or o.ended <= t_next)), key=lambda o: o.sent
    )
    last_bad = max((k for k, o in enumerate(after) if not o.ok), default=-1)
    steady = after[last_bad + 1 :]
    return {
        "in_flight_at_kill": len(in_flight),
        "failed_in_flight": sum(not o.ok for o in in_flight),
        "sent_after_kill": len(after),
        "failed_after_kill": sum(not o.ok for o in after),
        "router_notice_s": round(steady[0].sent - t_kill, 2) if steady else None,
    }


def run_kill_phase(
    up: UpProcess,
    router: str,
    load: int,
    max_tokens: int,
    timeout: float,
    settle_s: float,
    gap_s: float,
    restore_limit: float,
    whole: bool = True,
) -> dict[str, Any]:
    model = model_id(up)
    outs: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()
    counter = iter(range(10**9))

    def loader() -> None:
        while not stop.is_set():
            with lock:
                n = next(counter)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": load_message(n)}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            out = stream_chat(router, body, timeout)
            with lock:
                outs.append(out)
            if not out.ok:
                stop.wait(FAILED_PAUSE_S)  # a steady pace: a router that fails fast is not hammered

    threads = [threading.Thread(target=loader, daemon=True) for _ in range(load)]
    for t in threads:
        t.start()
    kills: list[tuple[str, dict[str, int], float, float | None]] = []  # what, pids, when, restored
    gap_served: list[float | None] = []
    try:
        time.sleep(settle_s)
        old = {"gateway": replica_pids(up.reload(), 0)["gateway"]}
        t1 = time.monotonic()
        os.kill(old["gateway"], signal.SIGKILL)
        kills.append(("kill -9 of replica 0's gateway", old, t1, wait_restored(up, 0, old, restore_limit)))
        before = served(up)
        time.sleep(gap_s)
        gap_served = [
            None if a is None or b is None else b - a for a, b in zip(before, served(up), strict=True)
        ]
        if whole:
            old2 = replica_pids(up.reload(), 1)
            t2 = time.monotonic()
            for pid in old2.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            restored = wait_restored(up, 1, old2, restore_limit)
            kills.append(("kill -9 of replica 1, all its processes", old2, t2, restored))
            time.sleep(gap_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout + 5)
    t_end = time.monotonic()
    events = []
    for k, (what, pids, t_kill, restored) in enumerate(kills):
        t_next = kills[k + 1][2] if k + 1 < len(kills) else t_end
        events.append(
            {
                "what": what,
                "killed_pids": sorted(pids.values()),
                "restored_s": None if restored is None else round(restored, 2),
                **event_figures(outs, t_kill, t_next),
            }
        )
    return {
        "whole_replica": WHOLE_REPLICA if whole else "not killed (gateway kill only)",
        "load_streams": load,
        "request_timeout_s": timeout,
        "restore_limit_s": restore_limit,
        "expected_notice_s": ROUTER_NOTICE_S,
        "requests_sent": len(outs),
        "succeeded": sum(o.ok for o in outs),
        "failed": sum(not o.ok for o in outs),
        "failed_in_flight": sum(e["failed_in_flight"] for e in events),
        "hung": sum(o.hung for o in outs),
        "router_alive": bool(up.reload()["router"]["alive"]),
        "served_per_replica_after_restore": gap_served,
        "direct_probe_at_end": probe_replicas(up, timeout),
        "events": events,
        "errors": sorted({o.error for o in outs if o.error})[:8],
    }


def served(up: UpProcess) -> list[float | None]:
    """Requests each replica's gateway has finished (its fastdecode_requests_total), None if unreadable."""
    counts: list[float | None] = []
    for r in up.reload()["replicas"]:
        try:
            with urllib.request.urlopen(f"http://{r['gateway']['http']}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            counts.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("fastdecode_requests_total{")
                )
            )
        except (OSError, ValueError, IndexError):
            counts.append(None)
    return counts


def probe_replicas(up: UpProcess, timeout: float) -> list[dict[str, Any]]:
    """Each replica's gateway asked directly (not through the router): /health and one request."""
    probes = []
    for i, r in enumerate(up.reload()["replicas"]):
        http = r["gateway"]["http"]
        try:
            with urllib.request.urlopen(f"http://{http}/health", timeout=5) as resp:
                health: int | str = resp.status
        except urllib.error.HTTPError as e:
            health = e.code
        except OSError as e:
            health = type(e).__name__
        body = {"model": model_id(up), "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2}
        out = stream_chat(http, body, min(timeout, 30))
        probes.append({"replica": i, "health": health, "request_ok": out.ok, "error": out.error})
    return probes


# ---- the benchmark ---------------------------------------------------------------------------------
def run_route_bench(
    model: Path,
    policies: tuple[str, ...] = ("cache_aware", "round_robin"),
    prompts: int = 4,
    users: int = 8,
    system_tokens: int = 256,
    max_tokens: int = 16,
    concurrency: int = 4,
    seed: int = 0,
    kill: bool = True,
    kill_policy: str = "cache_aware",
    load: int = 3,
    kill_max_tokens: int = 8,
    request_timeout: float = 60.0,
    settle_s: float = 4.0,
    gap_s: float = 5.0,
    kill_whole: bool = True,
    restore_limit: float = 60.0,
    kv_capacity: int = 256 << 20,
) -> dict[str, Any]:
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise InvalidInput(f"policies must be among {', '.join(POLICIES)}, got {', '.join(bad) or 'none'}")
    texts, counts = system_prompts(model, prompts, system_tokens, seed)
    order = send_order(prompts, users, seed)
    result: dict[str, Any] = {
        "model": model.name,
        "replicas": REPLICAS,
        "shards_per_replica": 1,
        "prompts": prompts,
        "users": users,
        "system_tokens_min": min(counts),
        "system_tokens_max": max(counts),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "seed": seed,
    }
    runs: dict[str, dict[str, Any]] = {}
    kill_result: dict[str, Any] | None = None
    for policy in policies:
        with bench_workdir(f"route-{policy}") as workdir:
            up, router = start_replicas(model, workdir, policy, kv_capacity)
            try:
                warm_replicas(up, request_timeout)
                runs[policy] = run_prefix_phase(
                    up, router, texts, order, max_tokens, concurrency, request_timeout
                )
                if kill and policy == kill_policy:
                    kill_result = run_kill_phase(
                        up,
                        router,
                        load,
                        kill_max_tokens,
                        request_timeout,
                        settle_s,
                        gap_s,
                        restore_limit,
                        kill_whole,
                    )
            finally:
                stop_up(up)
    result["policies"] = runs
    for policy, r in runs.items():
        for key in ("cached_share", "ttft_ms_p50", "ttft_ms_p90", "total_s", "failed"):
            result[f"{policy}_{key}"] = r[key]
    ca, rr = runs.get("cache_aware"), runs.get("round_robin")
    if ca and rr:
        for key in ("ttft_ms_p50", "ttft_ms_p90", "total_s"):
            a, b = ca[key], rr[key]
            result[f"{key}_ratio_cache_aware_over_round_robin"] = round(a / b, 3) if a and b else None
    if kill_result is not None:
        result["kill"] = kill_result
        for key in ("requests_sent", "succeeded", "failed", "failed_in_flight", "hung"):
            result[f"kill_{key}"] = kill_result[key]
        for k, e in enumerate(kill_result["events"], 1):
            result[f"kill_{k}_router_notice_s"] = e["router_notice_s"]
            result[f"kill_{k}_failed_after_kill"] = e["failed_after_kill"]
    return result
