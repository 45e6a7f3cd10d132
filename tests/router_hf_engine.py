"""A `kvsidecar demo`-style engine behind an OpenAI-compatible HTTP server,
for the end-to-end test of `kvsidecar router proxy`.

    python -m tests.router_hf_engine --sidecar ENDPOINT --tokenizer DIR --name NAME \\
        --namespace-out FILE

The local random-weight tiny Llama (engine_shim.hf.tiny_llama) caches its
prompts' KV in the kvsidecar at ENDPOINT through CachedLM (which publishes
the KV events the proxy follows). POST /v1/completions tokenizes the prompt
with the tokenizer in DIR, generates greedily, and answers the text with
what the prefill took from the sidecar (`loaded_tokens`). At start it
writes the namespace its blocks are keyed in to FILE (the proxy's
--namespace) and prints {"url": ...}; it exits when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


async def _main(args: argparse.Namespace) -> None:
    import torch
    from aiohttp import web

    from engine_shim.client import KVClient
    from engine_shim.hf import CachedLM, tiny_llama
    from router.prompts import PromptTokenizer

    torch.set_num_threads(1)
    prompts = PromptTokenizer(args.tokenizer)
    client = KVClient.connect(args.sidecar, timeout=30.0)
    lm = CachedLM(tiny_llama(seed=0), client, model_name="tiny")
    registered = client._link.registered
    assert registered is not None
    namespace = dataclasses.asdict(registered.hasher.namespace)
    Path(args.namespace_out).write_text(json.dumps(namespace))

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        ids = torch.tensor(prompts.completion(body), dtype=torch.long)
        gen = lm.generate(ids, int(body.get("max_tokens", 4)))
        text = prompts.tokenizer.decode(gen.tokens.tolist())
        return web.json_response(
            {
                "object": "text_completion",
                "model": "tiny",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "engine": args.name,
                "loaded_tokens": gen.info.loaded_tokens,
                "saved_tokens": gen.info.saved_tokens,
            }
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(json.dumps({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await runner.cleanup()
        client.close()


def _parse(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser()
    p.add_argument("--sidecar", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--namespace-out", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(_main(_parse()))
