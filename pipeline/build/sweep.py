"""Sweeps (``python -m pipeline -m ...``): each job's row, and the sweep's report at its root.

Every job of a multirun, built or failed, writes ``<sweep dir>/<job number>/job.json``; then, under
a lock on the sweep directory, it rewrites the report from every job record there: ``summary.csv``,
``summary.md`` and the plots ``kv_bytes.png`` and ``decode_tokens_per_s.png`` (against
``kv.max_seqs``, one line per layout). Written by each job rather than at the end of the sweep,
the report is whole whichever job finishes last and however the others ended: a failed job is a
row with its error. Every file is written to a temporary name and renamed.
"""

import csv
import io
import json
import os
from pathlib import Path

COLUMNS = ("job", "overrides", "status", "layout", "max_seqs", "backend", "artifact_mb", "kv_bytes", "build_s",
           "stages_built", "validation_error", "verdict", "decode_tok_s", "version", "error")


def _write(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


def job_row(cfg, job: dict, version: Path | None, seconds: float, error: str | None, decode: dict | None,
            status: str | None = None) -> dict:
    """One job's row: what it built (from its version's records), or its error; ``status``: ok, failed, or how
    SLURM ended it (cancelled, timeout, killed)."""
    row = dict.fromkeys(COLUMNS, "")
    row |= {"job": job["num"], "overrides": job["overrides"], "status": status or ("failed" if error else "ok"),
            "layout": cfg.kv.layout, "max_seqs": cfg.kv.max_seqs, "backend": cfg.backend.name, "build_s": round(seconds, 1),
            "error": error or ""}
    if version is not None:
        record = json.loads((version / "build.json").read_text())
        programs = [v["bytes"] for k, v in record["artifacts"].items() if k.endswith((".pte", ".ptd"))]
        row |= {"version": str(version), "kv_bytes": record.get("kv_bytes_total", ""),
                "artifact_mb": round(sum(programs) / 1e6, 3) if programs else "",
                "stages_built": " ".join(s for s, e in record["stage_entries"].items() if e["from"] == "built") or "none",
                "verdict": "not run"}
        if (version / "validation.json").is_file():
            report = json.loads((version / "validation.json").read_text())
            row |= {"validation_error": f"{report['max_relative_error']:.2e}", "verdict": "PASSED" if report["passed"] else "FAILED"}
    if decode:
        row["decode_tok_s"] = round(decode["tokens_per_s"], 1)
    return row


def record_job(sweep_dir: Path, row: dict) -> None:
    """The job's record, then the sweep's report rewritten from every record (under a file lock)."""
    from filelock import FileLock

    job_dir = sweep_dir / str(row["job"])
    job_dir.mkdir(parents=True, exist_ok=True)
    _write(job_dir / "job.json", json.dumps(row, indent=2) + "\n")
    with FileLock(sweep_dir / ".summary.lock"):
        write_report(sweep_dir)


def rows(sweep_dir: Path) -> list[dict]:
    found = []
    for path in sweep_dir.glob("*/job.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: int(r["job"]))


def write_report(sweep_dir: Path) -> None:
    table = rows(sweep_dir)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(table)
    _write(sweep_dir / "summary.csv", out.getvalue())
    failed = sum(r["status"] != "ok" for r in table)
    lines = [f"# Sweep {sweep_dir.name}: {len(table)} jobs, {failed} failed", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in COLUMNS) + " |" for r in table]
    _write(sweep_dir / "summary.md", "\n".join(lines) + "\n")
    _plot(table, sweep_dir, "kv_bytes", "KV bytes", "kv_bytes.png")
    _plot(table, sweep_dir, "decode_tok_s", "decode tokens/s (all sequences)", "decode_tokens_per_s.png")


def _plot(table: list[dict], sweep_dir: Path, column: str, label: str, name: str) -> None:
    """``column`` against max_seqs, one line per layout and backend; nothing when no job has it."""
    points: dict[str, list[tuple[int, float]]] = {}
    for r in table:
        if r["status"] == "ok" and r.get(column) not in ("", None):
            points.setdefault(f"{r['layout']} ({r['backend']})", []).append((int(r["max_seqs"]), float(r[column])))
    if not points:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for series, xy in sorted(points.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=series)
    ax.set_xticks(sorted({x for xy in points.values() for x, _ in xy}))
    ax.set_xlabel("kv.max_seqs")
    ax.set_ylabel(label)
    ax.set_title(f"{label} against kv.max_seqs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    _write(sweep_dir / name, buf.getvalue())
