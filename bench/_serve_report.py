"""The tables of ``bench/serve.py``'s section, from its rows: pure functions of the measured numbers, so
that ``bench/test_serve_bench.py`` checks them without a server.

A run's rows: ``table[server][(prompt_tokens, clients)]`` is ``_load.summarize``'s dict for that
server's requests at that prompt length and client count."""

import math

PEER = "llama-server"  # the row every ratio divides by: llama.cpp's own server


def _ms(seconds: float, digits: int = 0) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.{digits}f}"


def _ratio(ours: float, theirs: float) -> str:
    bad = any(v is None or math.isnan(v) for v in (ours, theirs)) or not theirs
    return "-" if bad else f"{ours / theirs:.2f}"


def _prompt(row: dict) -> str:
    """The prompt tokens as the server counted them (mean per request) and those it took from its cache
    (the row's total over its requests)."""
    if row.get("prompt_tokens") is None:
        return "-"
    return f"{row['prompt_tokens']:.0f} / {row.get('cached_tokens', 0)}"


def rows_table(table: dict[str, dict[tuple[int, int], dict]], peer: str = PEER) -> list[str]:
    """One line per server, prompt length and client count; ``x peer`` is its tokens/s over the peer's."""
    lines = [f"| server | prompt | clients | tok/s | x {peer} | req/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | "
             "ITL p95 ms | tokens / request | prompt tokens per request / cached, row total (server's count) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = table.get(peer, {})
    for name, rows in table.items():
        for (prompt, clients), r in rows.items():
            ratio = _ratio(r["tok_s"], base[prompt, clients]["tok_s"]) if (prompt, clients) in base else "-"
            lines.append(f"| {name} | {prompt} | {clients} | {r['tok_s']:.1f} | {ratio} | {r['req_s']:.2f} | "
                         f"{_ms(r['ttft_p50'])} | {_ms(r['ttft_p95'])} | {_ms(r['itl_p50'], 1)} | {_ms(r['itl_p95'], 1)} | "
                         f"{r['tokens_per_request']:.1f} | {_prompt(r)} | {r['errors']} |")
    return lines


def ratio_table(table: dict[str, dict[tuple[int, int], dict]], ours: list[str], peer: str = PEER) -> list[str]:
    """Ours over the peer at each prompt length and client count (the peer's rows): aggregate tokens/s
    (above 1: ours is faster), TTFT p50 and ITL p50 (below 1: ours is quicker), one group per artifact."""
    base = table.get(peer, {})
    head = "| prompt | clients | " + " | ".join(f"{name}: tok/s | TTFT p50 | ITL p50" for name in ours) + " |"
    lines = [head, "|---|---|" + "---|---|---|" * len(ours)]
    for key, theirs in base.items():
        cells = []
        for name in ours:
            r = table.get(name, {}).get(key)
            cells += ([_ratio(r["tok_s"], theirs["tok_s"]), _ratio(r["ttft_p50"], theirs["ttft_p50"]),
                       _ratio(r["itl_p50"], theirs["itl_p50"])] if r else ["-", "-", "-"])
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines


def memory_table(memory: dict[str, dict[str, float]]) -> list[str]:
    """Resident memory of each server (its process and its children), once ready and after its rows."""
    lines = ["| server | RSS when ready, MB | RSS after its rows, MB |", "|---|---|---|"]
    for name, m in memory.items():
        lines.append(f"| {name} | {m['ready']:.0f} | {m['end']:.0f} |")
    return lines


def engine_table(alone: dict[str, float], table: dict[str, dict[tuple[int, int], dict]], key: tuple[int, int]) -> list[str]:
    """The engine driven alone (no HTTP) against the server through the same requests (the ``key`` row)."""
    lines = [f"| artifact | engine alone, tok/s | server, {key[1]} clients, tok/s | server / engine |", "|---|---|---|---|"]
    for name, value in alone.items():
        served = table.get(name, {}).get(key, {}).get("tok_s", float("nan"))
        lines.append(f"| {name} | {value:.1f} | {served:.1f} | {_ratio(served, value)} |")
    return lines
