"""Tokenization throughput on long chats: in process, and the tokenizer service at 1 vs 2 replicas.

Chats of about ``--tokens`` tokens each (default 8k, 16k, 32k): a system
message, then user / assistant turns of about 2k tokens cut from Python
standard-library sources (code, docstrings, comments), a different slice per
request.

1. In process (one thread), median wall and CPU milliseconds per chat:
   ``apply_chat_template(tokenize=True)`` (transformers: render + encode the
   joined string), the recipe encoding its text segments one by one
   (``parallel=False``, no cutting), and the recipe with the segments, cut
   into ~8k-character pieces at safe newlines, in one ``encode_batch``
   (Rust threads).
2. Through NATS request/reply: a private nats-server and 1, then 2, replicas
   of ``deepinfer serve tokenizer`` (started by ``deepinfer.launcher.Mesh``),
   ``--requests`` chats per size sent ``--concurrency`` at a time; requests/s,
   tokens/s and the median latency.

    python benchmarks/bench_tokenizer.py [--model DIR] [--tokens 8000 16000 32000]
                                         [--requests 16] [--concurrency 4] [--repeat 5]

The figures depend on free cores: the script prints ``os.cpu_count()`` and
the load average, and CPU time beside wall time in part 1.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deepinfer.launcher import Mesh  # noqa: E402
from deepinfer.mesh.client import MeshClient  # noqa: E402
from deepinfer.models.convert import resolve_model  # noqa: E402
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, LoadReport, subjects, unpack  # noqa: E402
from deepinfer.recipe import ChatRecipe  # noqa: E402

TURN_CHARS = 8000  # about 2k tokens of code


def corpus() -> str:
    import argparse as a, asyncio.base_events as b, email.message as c, inspect as d, json.decoder as e
    import logging as f, pathlib as g, subprocess as h, textwrap as i, typing as j

    return "".join(inspect.getsource(m) for m in (a, b, c, d, e, f, g, h, i, j))


def make_chat(recipe: ChatRecipe, text: str, tokens: int, offset: int) -> tuple[list[dict], int]:
    """A chat of about ``tokens`` tokens whose turns start at ``offset`` in ``text``; and its length."""
    chat = [{"role": "system", "content": "You are a careful code reviewer."}]
    pos = offset % (len(text) - TURN_CHARS)
    approx = 0
    while approx < tokens:
        role = "user" if len(chat) % 2 else "assistant"
        chat.append({"role": role, "content": text[pos : pos + TURN_CHARS]})
        pos = (pos + TURN_CHARS) % (len(text) - TURN_CHARS)
        approx += TURN_CHARS // 4
    n = len(recipe.encode_chat(chat))
    while n > tokens * 1.1 and len(chat) > 2:  # trim the last turn towards the target
        chat[-1]["content"] = chat[-1]["content"][: len(chat[-1]["content"]) * 3 // 4]
        n = len(recipe.encode_chat(chat))
    return chat, n


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        c, t = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def in_process(recipe: ChatRecipe, chats: dict[int, tuple[list[dict], int]], repeat: int) -> None:
    print("\n1. in process: ms per chat (wall / CPU) and tokens/s (wall)")
    print(f"{'tokens':>7} | {'transformers':>22} | {'recipe, sequential':>22} | {'recipe, encode_batch':>22} | ids equal")
    for size, (chat, n) in chats.items():
        def hf():
            return recipe.hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)

        segments = recipe.segments(chat)

        def seq():
            saved, recipe.chunk_chars = recipe.chunk_chars, 0
            try:
                return recipe.encode_chat(chat, parallel=False)
            finally:
                recipe.chunk_chars = saved

        def par():
            return recipe.encode_chat(chat, parallel=True)

        equal = list(hf()) == seq() == par()
        cells = []
        for fn in (hf, seq, par):
            wall, cpu = timed(fn, repeat)
            cells.append(f"{wall * 1e3:6.1f}/{cpu * 1e3:6.1f} {n / wall / 1e3:5.0f}k/s")
        print(f"{n:>7} | " + " | ".join(f"{c:>22}" for c in cells) + f" | {equal} ({len(segments)} segments)")


async def wait_for_workers(client: MeshClient, n: int, timeout: float = 120) -> None:
    """Until ``n`` distinct tokenizer workers have sent a heartbeat."""
    seen: set[str] = set()
    done = asyncio.Event()

    async def on_load(msg):
        report = unpack(msg.data)
        if isinstance(report, LoadReport) and report.role == "tokenizer":
            seen.add(report.worker_id)
            if len(seen) >= n:
                done.set()

    sub = await client.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()


async def load(client: MeshClient, chats: list[list[dict]], concurrency: int) -> tuple[float, list[float], int]:
    """Send every chat, ``concurrency`` at a time: (wall seconds, latencies, tokens)."""
    queue = list(enumerate(chats))
    latencies: list[float] = []
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i, chat = queue.pop()
            t = time.perf_counter()
            reply = await client.request(subjects.TOKENIZER_ENCODE_CHAT, EncodeChatRequest(f"b{i}", chat),
                                         timeout=300, expect=EncodeChatReply)
            latencies.append(time.perf_counter() - t)
            tokens += len(reply.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, latencies, tokens


async def measure(nats_url: str, replicas: int, workloads: dict[int, list[list[dict]]], concurrency: int) -> dict:
    """size -> (requests/s, tokens/s, median latency s) against ``replicas`` running workers."""
    client = await MeshClient.connect(nats_url, "bench-tokenizer")
    try:
        await wait_for_workers(client, replicas)
        out = {}
        for size, chats in workloads.items():
            await load(client, chats[: 2 * replicas], concurrency)  # warm-up
            wall, lat, tokens = await load(client, chats, concurrency)
            out[size] = (len(chats) / wall, tokens / wall, statistics.median(lat))
        return out
    finally:
        await client.close()


def service(model_dir, recipe: ChatRecipe, text: str, sizes: list[int], requests: int, concurrency: int) -> None:
    print(f"\n2. tokenizer service over NATS: {requests} chats per size, {concurrency} in flight")
    workloads = {size: [make_chat(recipe, text, size, 7919 * k + size)[0] for k in range(requests)]
                 for size in sizes}
    results = {}
    for replicas in (1, 2):
        mesh = Mesh(model=str(model_dir), services=("tokenizer",), replicas={"tokenizer": replicas})
        mesh.start()
        try:
            results[replicas] = asyncio.run(measure(mesh.nats_url, replicas, workloads, concurrency))
        finally:
            mesh.stop()
    print(f"{'tokens':>7} | {'1 replica: req/s  tok/s  p50':>30} | {'2 replicas: req/s  tok/s  p50':>31} | speed-up")
    for size in sizes:
        a, b = results[1][size], results[2][size]
        fmt = "{:6.2f} {:7.0f}k {:6.0f} ms"
        print(f"{size:>7} | {fmt.format(a[0], a[1] / 1e3, a[2] * 1e3):>30} | "
              f"{fmt.format(b[0], b[1] / 1e3, b[2] * 1e3):>31} | {b[1] / a[1]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8000, 16000, 32000])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-service", action="store_true")
    args = p.parse_args()

    model_dir = resolve_model(args.model)
    print(f"model {model_dir.name}; os.cpu_count() = {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; "
          f"TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")
    recipe = ChatRecipe.from_pretrained(model_dir)
    text = corpus()
    chats = {size: make_chat(recipe, text, size, size) for size in args.tokens}
    in_process(recipe, chats, args.repeat)
    if not args.skip_service:
        service(model_dir, recipe, text, args.tokens, args.requests, args.concurrency)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
