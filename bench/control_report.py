"""The tables `kvsidecar bench control` prints: round trips, then rates and encodings."""

from __future__ import annotations

from typing import Any

from cachesim.report import print_table

LABELS = {
    "floor_rtt_us.lookup": "floor: raw ping-pong, lookup sizes",
    "floor_rtt_us.load_save": "floor: raw ping-pong, load/save sizes",
    "floor_rtt_us.load_save_full": "floor: raw plan + Complete ping-pongs",
    "hash_us": "hash tokens into keys (KeyHasher)",
    "lookup_rtt_us": "lookup: KVClient.lookup (hashes)",
    "lookup_keys_rtt_us": "lookup: raw, pre-hashed keys",
    "load_plan_rtt_us": "load: raw request -> plan reply",
    "save_plan_rtt_us": "save: raw request -> plan reply",
    "load_full_us": "load: KVClient.load().wait() full",
    "save_full_us": "save: KVClient.save().wait() full",
}
HEADERS = ("figure", "blocks", "clients", "p50 us", "p99 us", "x floor p50", "x floor p99")


def print_report(r: dict[str, Any]) -> None:
    print_table((*HEADERS, "target", "note"), latency_rows(r))
    print()
    print_table(("figure", "value", "target", "note"), rate_and_codec_rows(r))
    print()
    print_table(
        ("2,048-block lookup target, side by side", "p50 us", "p99 us", "note"), paired_rows(r)
    )
    print()
    print_table(
        (f"{r['rate_blocks']}-block rate target, 4 clients, side by side", "req/s", "note"),
        paired_rate_rows(r),
    )


def paired_rate_rows(r: dict[str, Any]) -> list[tuple]:
    t, rates = r["targets"]["lookup_rate_4_clients_vs_raw"], r["rates_paired_rps"]
    where = "within" if t["within"] else "over"
    notes = {
        "raw": "raw ping-pong, lookup sizes",
        "lookup": f"{where} target; {rates['lookup_vs_raw']:.2f}x raw (target {t['limit']:g}x)",
        "lookup_keys": f"pre-hashed keys; {rates['lookup_keys_vs_raw']:.2f}x raw",
    }
    return [(name, rates[name], note) for name, note in notes.items()]


def paired_rows(r: dict[str, Any]) -> list[tuple]:
    t = r["targets"]["lookup_2048_p50_us"]
    notes = {
        "floor": "raw ping-pong, lookup sizes",
        "hash": "KeyHasher.hash_tokens",
        "lookup": f"{'within' if t['within'] else 'over'} target <= {t['limit']:.1f}",
        "floor_after_hash": "the same ping-pong right after an untimed hashing; with it the "
        f"target would be <= {t['with_floor_after_hash']['limit']:.1f}",
    }
    return [(name, s["p50"], s["p99"], notes[name]) for name, s in r["lookup_paired_us"].items()]


def latency_rows(r: dict[str, Any]) -> list[tuple]:
    rows: list[tuple] = []
    sizes = r["message_header_bytes"]
    for figure, label in LABELS.items():
        for n, by_clients in _by_blocks(r, figure).items():
            for c, s in by_clients.items():
                ratio = r["vs_floor"].get(figure, {}).get(n, {}).get(c)
                target, note = "", _note(r, figure, int(n), c, sizes)
                if figure == "lookup_rtt_us" and n == "2048" and c == "1":
                    t = r["targets"]["lookup_2048_p50_us"]["from_separate_cases"]
                    where = "within" if t["within"] else "over"
                    target = f"<= {t['limit']:.1f}"
                    note = f"{where} the rule on these separate cases; target: see side by side"
                rows.append(
                    (
                        label,
                        int(n),
                        int(c),
                        s["p50"],
                        s["p99"],
                        ratio["p50"] if ratio else "",
                        ratio["p99"] if ratio else "",
                        target,
                        note,
                    )
                )
    return rows


def _by_blocks(r: dict[str, Any], figure: str) -> dict[str, dict[str, Any]]:
    if figure == "hash_us":  # one process, no clients
        return {n: {"1": s} for n, s in r["hash_us"].items()}
    if figure.startswith("floor_rtt_us."):
        return r["floor_rtt_us"][figure.split(".")[1]]  # type: ignore[no-any-return]
    return r[figure]  # type: ignore[no-any-return]


def _note(r: dict[str, Any], figure: str, n: int, c: str, sizes: dict[str, int]) -> str:
    if figure == "floor_rtt_us.lookup":
        return f"{sizes['lookup_request']}+{16 * n} B -> {sizes['lookup_reply']} B"
    if figure == "floor_rtt_us.load_save":
        return f"{sizes['plan_request']}+{24 * n} B -> {sizes['plan_reply']}+{16 * n} B"
    if figure == "floor_rtt_us.load_save_full":
        return f"the plan sizes, then {sizes['complete_request']} B -> {sizes['lookup_reply']} B"
    if figure == "hash_us":
        return f"{n * 16:,} tokens, 1 process"
    if figure.endswith("_full_us"):
        plan = r[figure.replace("_full_us", "_plan_rtt_us")][str(n)][c]["p50"]
        full = r[figure][str(n)][c]["p50"]
        copied = n * r["kv_block_bytes"]
        return f"2 round trips + copies of {copied:,} B; {full - plan:+.0f} us vs plan"
    if figure == "lookup_rtt_us":
        return f"hashing p50 {r['hash_us'][str(n)]['p50']:.1f} us (1 process)"
    if figure == "save_plan_rtt_us":
        return "new blocks; plan cancelled untimed"
    if figure == "load_plan_rtt_us":
        return "all hit; plan cancelled untimed"
    return ""


def rate_and_codec_rows(r: dict[str, Any]) -> list[tuple]:
    rows: list[tuple] = []
    blocks = r["rate_blocks"]
    t = r["targets"]["lookup_rate_4_clients_vs_raw"]
    for c, raw in r["raw_rate_rps"].items():
        rows.append(
            (
                f"raw closed-loop rate, {c} client(s) (req/s)",
                raw,
                "",
                f"{blocks}-block lookup sizes",
            )
        )
    for name, key, label in (
        ("lookup_rate_rps", "lookup_rate_vs_raw", "KVClient.lookup"),
        ("lookup_keys_rate_rps", "lookup_keys_rate_vs_raw", "raw, pre-hashed keys"),
    ):
        for c, rate in r[name].items():
            ratio = r[key][c]
            target, note = "", f"{ratio:.2f}x raw"
            if name == "lookup_rate_rps" and c == str(max(r["client_counts"])):
                target = f">= {t['limit'] * r['raw_rate_rps'][c]:,.0f}"
                where = "within" if t["from_separate_cases"]["within"] else "over"
                note = f"{ratio:.2f}x raw: {where} the rule here; target: see side by side"
            rows.append((f"{blocks}-block lookups/s, {label}, {c} client(s)", rate, target, note))
    for codec, by_message in r["encode_us"].items():
        for message, us in by_message.items():
            base = r["encode_us"]["msgspec_struct"][message]
            rows.append(
                (
                    f"encode+decode {message} header, {codec} (us)",
                    us,
                    "",
                    f"{r['header_bytes'][message]} B; {us / base:.2f}x msgspec_struct",
                )
            )
    for fmt, us in r["keys_encode_us"].items():
        note = f"{r['keys_bytes'][fmt]:,} B"
        if fmt != "raw_frame":
            note += f"; {r['keys_list_vs_raw'][fmt]:.0f}x the raw frame"
        rows.append((f"encode+decode 2,048 keys, {fmt} (us)", us, "", note))
    return rows
