"""`kvsidecar demo`: a sidecar, a small model and two chats that share a
system prompt, each turn run with the cache and recomputed, side by side.

It starts a private sidecar (own instance name, temporary runtime directory,
a small CPU tier and an SSD tier in the same temporary directory), builds
the local random-weight tiny Llama (or loads `--model PATH`), and runs the
two conversations turn by turn. Text becomes token ids one character per
token (its code point), so prompts are readable; the random model's replies
are shown as characters too, but mean nothing. Per turn it prints the prompt
length, the tokens loaded from each tier, the time to first token with the
cache and recomputed by the same model without it (same prefill schedule),
and whether the outputs matched: each turn on stderr as it completes, the
table on stdout at the end. At the end, or on SIGTERM or Ctrl-C, the sidecar
is stopped with SIGTERM and the temporary directory removed; the demo checks
that no shared memory was left behind.
"""

# Only argparse is imported at module level: building the `kvsidecar` parser
# must not import torch or transformers.

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_shim.local_sidecar import Shutdown

SYSTEM_PROMPT = (
    "You are the assistant of Crumb & Co, a bakery with three shops. "
    "Answer in one or two short sentences, politely, and only about the bakery. "
    "Opening hours: Monday to Friday 7:00-19:00, Saturday 8:00-18:00, Sunday 8:00-13:00. "
    "Shops: Harbour Street 4, Market Square 11 and the railway station hall. "
    "Cakes must be ordered two days ahead; a cake for twelve costs 38 euros. "
    "Gluten-free bread is baked on Tuesdays and Fridays, in limited numbers. "
    "Delivery: within 5 km, on weekdays, for orders above 25 euros. "
    "Allergens: hazelnuts in the praline cake and the Florentines; sesame in the rye loaf. "
    "Never promise anything the rules above do not say; suggest calling the shop instead. "
)
# Smaller than the two chats together, larger than one prompt: the blocks
# of the chat that waited longest are evicted and come back from SSD.
CPU_TIER_BLOCKS = 48
CONVERSATIONS = {
    "A": (
        "What time do you open on Sundays?",
        "Can I order a cake for twelve people for Saturday?",
        "Which of your cakes contain nuts?",
    ),
    "B": (
        "Where is your shop near the station?",
        "Do you deliver to the old town on weekdays?",
        "Is there gluten-free bread on Friday?",
    ),
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `kvsidecar demo` on the `kvsidecar` subcommand parsers."""
    p = subparsers.add_parser(
        "demo",
        help="run two short chats through a private sidecar, cached vs recomputed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="a local causal LM directory (default: tiny)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (1-3, default 3)")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generated per turn")
    p.add_argument(
        "--cpu-capacity",
        help=f"the sidecar's CPU tier (default: {CPU_TIER_BLOCKS} KV blocks of the model, "
        "at least 1 MiB, so that the chats overflow it onto SSD)",
    )
    p.add_argument("--no-ssd", action="store_true", help="no SSD tier")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=64,
        help="prefill schedule in tokens (a multiple of 16), so that cached runs are "
        "bit-exact; 0 = one forward for the uncached suffix (default 64)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvsidecar.demo [options]`, the same as `kvsidecar demo`."""
    parser = argparse.ArgumentParser(prog="kvsidecar demo", description=__doc__)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.turns <= 3 or args.new_tokens < 1:
        print("kvsidecar demo: --turns must be 1-3 and --new-tokens >= 1", file=sys.stderr)
        return 2
    if (
        args.chunk_tokens < 0
        or args.chunk_tokens % 16
        or (args.threads is not None and args.threads < 1)
    ):
        print(
            "kvsidecar demo: --chunk-tokens must be 0 or a multiple of 16, --threads >= 1",
            file=sys.stderr,
        )
        return 2
    if args.cpu_capacity is not None:
        from sidecar.config import ConfigError, parse_overrides

        try:  # the sidecar would refuse it only after the model is loaded
            parse_overrides([f"cpu_capacity={args.cpu_capacity}"], source="--cpu-capacity")
        except ConfigError as err:
            print(f"kvsidecar demo: {err}", file=sys.stderr)
            return 2
    try:
        from engine_shim.hf import kv_block_bytes, load_model, tiny_llama
    except ImportError:
        print("kvsidecar demo needs transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model = load_model(args.model) if args.model else tiny_llama(seed=0)
    except (OSError, ValueError) as err:  # no config.json, no weights, an unknown model type
        print(f"kvsidecar demo: --model: {err}", file=sys.stderr)
        return 2
    block_bytes = kv_block_bytes(model)
    with _sigterm_exits():
        workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
        try:
            shutdown, all_matched = _with_sidecar(args, model, workdir, block_bytes)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    clean = shutdown.exit_code == 0 and not shutdown.leftovers
    print(
        f"sidecar stopped with SIGTERM: exit code {shutdown.exit_code}, "
        f"{len(shutdown.leftovers)} shm segment(s) left behind; {workdir} removed"
    )
    return 0 if clean and all_matched else 1


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Within, SIGTERM unwinds like Ctrl-C (SystemExit, exit status 143), so
    the `finally` blocks stop the sidecar and remove the temporary directory."""

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _with_sidecar(
    args: argparse.Namespace, model: Any, workdir: Path, block_bytes: int
) -> tuple[Shutdown, bool]:
    """Start a sidecar in `workdir`, run the chats, stop it: how it stopped,
    and whether every turn matched."""
    from engine_shim.local_sidecar import LocalSidecar

    # The sidecar takes no CPU tier under 1 MiB (a model of small blocks).
    capacity = args.cpu_capacity or f"{max(CPU_TIER_BLOCKS * block_bytes, 1 << 20)}B"
    settings: dict[str, object] = {"drain_seconds": 1}
    if not args.no_ssd:
        (workdir / "ssd").mkdir()
        # Room for both chats many times over (they need ~60 blocks).
        ssd_bytes = max(8 * CPU_TIER_BLOCKS * block_bytes, 1 << 20)
        settings.update(ssd_dirs=workdir / "ssd", ssd_capacity_per_dir=f"{ssd_bytes}B")
    sidecar = LocalSidecar(workdir, cpu_capacity=capacity, settings=settings, tag="demo")
    try:
        print(f"demo: starting a sidecar in {workdir}", file=sys.stderr, flush=True)
        sidecar.start()
        print(sidecar.banner.strip())
        all_matched = _chat(args, model, sidecar.endpoint)
    finally:
        shutdown = sidecar.close()
    return shutdown, all_matched


def _chat(args: argparse.Namespace, model: Any, endpoint: str) -> bool:
    """Run the conversations and print a row per turn; whether every turn's
    tokens matched the recompute."""
    import torch

    from cachesim.report import print_table
    from engine_shim.client import KVClient
    from engine_shim.hf import CachedLM

    client = KVClient.connect(endpoint, timeout=5.0)
    try:
        lm = CachedLM(model, client, chunk_tokens=args.chunk_tokens or None)
        for _ in range(2):  # first-call costs (allocations, kernel choice) out of the timings
            lm.prefill(encode(SYSTEM_PROMPT), use_sidecar=False)
        history = {name: SYSTEM_PROMPT for name in CONVERSATIONS}
        rows: list[list[Any]] = []
        all_matched = True
        for turn in range(args.turns):
            for name, messages in CONVERSATIONS.items():
                prompt = f"{history[name]}\nUser: {messages[turn]}\nAssistant:"
                ids = encode(prompt)
                cached = lm.generate(ids, args.new_tokens)
                fresh = lm.generate(ids, args.new_tokens, use_sidecar=False)
                # The recompute is stateless: its median of 3 keeps a noisy
                # neighbour from inflating the speedup.
                recompute_s = statistics.median(
                    [fresh.info.ttft_s]
                    + [lm.prefill(ids, use_sidecar=False).info.ttft_s for _ in range(2)]
                )
                same = torch.equal(cached.tokens, fresh.tokens)
                all_matched &= same
                reply = decode(cached.tokens.tolist())
                history[name] = f"{prompt} {reply}"
                info, match = cached.info, _match(cached, fresh, same)
                print(
                    f"demo: turn {name}{turn + 1}: {info.prompt_tokens} tokens, "
                    f"{info.loaded_from.cpu} from cpu, {info.loaded_from.ssd} from ssd, "
                    f"{info.computed_tokens} computed; TTFT {info.ttft_s * 1e3:.1f} ms cached, "
                    f"{recompute_s * 1e3:.1f} ms recomputed; {match}",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(
                    [
                        f"{name}{turn + 1}",
                        info.prompt_tokens,
                        info.loaded_from.cpu,
                        info.loaded_from.ssd,
                        info.computed_tokens,
                        info.ttft_s * 1e3,
                        recompute_s * 1e3,
                        recompute_s / info.ttft_s,
                        match,
                        repr(reply),
                    ]
                )
        hits = client.stats()["hits"]
    finally:
        client.close()
    print_table(
        [
            "turn",
            "prompt",
            "from cpu",
            "from ssd",
            "computed",
            "TTFT cached ms",
            "TTFT recompute ms",
            "speedup",
            "output",
            "reply (ids as chars)",
        ],
        rows,
    )
    ratio = hits["hit_ratio_by_tier"]
    print(
        f"sidecar block hit ratio {hits['hit_ratio']:.0%} "
        f"(cpu {ratio['cpu']:.0%}, ssd {ratio['ssd']:.0%}) over {hits['requests']} lookups"
    )
    return all_matched


def _match(cached: Any, fresh: Any, same_tokens: bool) -> str:
    import torch

    if not same_tokens:
        return "DIFFERENT tokens"
    if torch.equal(cached.logits, fresh.logits):
        return "same tokens, bit-exact"
    diff = (cached.logits.float() - fresh.logits.float()).abs().max().item()
    return f"same tokens, |dlogit| {diff:.1e}"


def encode(text: str) -> Any:
    """One token per character: its code point (the demo's prompts are ASCII)."""
    import torch

    return torch.tensor([ord(c) for c in text], dtype=torch.long)


def decode(ids: list[int]) -> str:
    """Token ids as printable ASCII characters, for display only."""
    return "".join(chr(32 + i % 95) for i in ids)


if __name__ == "__main__":
    sys.exit(main())
