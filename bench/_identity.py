"""bench/byte_identity.py's comparison: what a version of a build is made of (its files' sha256, not
the build's records), where two of them differ, the table, and the self-test's perturbed copies."""

import hashlib
import json
import shutil
from pathlib import Path

RECORDS = {"build.json", "validation.json"}  # records of a build (timings, paths, revision): not compared


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def artifact_files(vdir: Path) -> dict[str, str]:
    """sha256 of every file of a version that makes the artifact (not the build's records)."""
    files = {}
    for p in sorted(vdir.rglob("*")):
        rel = p.relative_to(vdir)
        if p.is_file() and rel.parts[0] != ".hydra" and rel.as_posix() not in RECORDS:
            files[rel.as_posix()] = sha256_file(p)
    return files


def json_diff(a, b, path: str = "") -> list[str]:
    """Where two parsed JSON documents differ (dicts compared by key, so key order is ignored)."""
    def show(v) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 100 else text[:97] + "..."

    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(a.keys() | b.keys(), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(f"{sub}: only in base ({show(a[key])})")
            elif key not in a:
                out.append(f"{sub}: only in head ({show(b[key])})")
            else:
                out += json_diff(a[key], b[key], sub)
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [line for i, (x, y) in enumerate(zip(a, b, strict=False)) for line in json_diff(x, y, f"{path}[{i}]")]
        if len(a) != len(b):
            out.append(f"{path or '<root>'}: list of {len(a)} items in base, {len(b)} in head")
        return out
    if a != b or type(a) is not type(b):
        return [f"{path or '<root>'}: base {show(a)} != head {show(b)}"]
    return []


def compare(base: dict, head: dict) -> dict:
    """One config's row: the .pte/.ptd hashes, the manifests, the other files, and what differs."""
    row = {"config": base["config"], "seconds": (base.get("seconds"), head.get("seconds")),
           "reused": (base.get("reused", False), head.get("reused", False)), "diffs": []}
    if not (base["ok"] and head["ok"]):
        failed = [s for s, r in (("base", base), ("head", head)) if not r["ok"]]
        row.update(base_sha="-", head_sha="-", pte=None, manifest=None, others=None, identical=False)
        row["diffs"] = [f"{s} build failed (exit {r['returncode']}; log {r['log']})" for s, r in (("base", base), ("head", head))
                        if s in failed]
        return row
    bf, hf = base["files"], head["files"]
    row["base_sha"], row["head_sha"] = bf["model.pte"][:12], hf["model.pte"][:12]
    programs = sorted(n for n in bf.keys() | hf.keys() if n.endswith((".pte", ".ptd")) and "/" not in n)
    row["pte"] = all(bf.get(n) == hf.get(n) for n in programs)
    for n in programs:
        if bf.get(n) != hf.get(n):
            row["diffs"].append(f"{n}: base {(bf.get(n) or 'missing')[:16]} != head {(hf.get(n) or 'missing')[:16]}"
                                + (f" ({Path(base['version'], n).stat().st_size} vs {Path(head['version'], n).stat().st_size} bytes)"
                                   if n in bf and n in hf else ""))
    manifests = [json.loads(Path(r["version"], "manifest.json").read_text()) for r in (base, head)]
    manifest_diff = json_diff(*manifests)
    row["manifest"] = not manifest_diff
    row["diffs"] += [f"manifest.json {line}" for line in manifest_diff]
    others = sorted(n for n in bf.keys() | hf.keys() if n not in programs and n != "manifest.json")
    row["others"] = all(bf.get(n) == hf.get(n) for n in others)
    row["diffs"] += [f"{n}: {'missing in head' if n not in hf else 'missing in base' if n not in bf else 'contents differ'}"
                     for n in others if bf.get(n) != hf.get(n)]
    row["identical"] = row["pte"] and row["manifest"] and row["others"]
    return row


def table(rows: list[dict]) -> str:
    def yes(v) -> str:
        return "n/a" if v is None else "yes" if v else "**NO**"

    def secs(row) -> str:
        parts = [f"{s:.1f}{' (reused)' if r else ''}" if s is not None else "-" for s, r in zip(row["seconds"], row["reused"], strict=True)]
        return " / ".join(parts)

    lines = ["| config | base sha256[:12] | head sha256[:12] | pte identical | manifest identical | other files identical "
             "| seconds base / head |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | `{r['base_sha']}` | `{r['head_sha']}` | {yes(r['pte'])} | {yes(r['manifest'])} "
              f"| {yes(r['others'])} | {secs(r)} |" for r in rows]
    return "\n".join(lines)


def diffs_text(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["diffs"]:
            out.append(f"{r['config']}:")
            out += [f"  - {d}" for d in r["diffs"][:40]]
            if len(r["diffs"]) > 40:
                out.append(f"  - ... and {len(r['diffs']) - 40} more")
    return "\n".join(out)


def perturb(base_records: dict[str, dict], out: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """The self-test's head: a copy of the base's outputs with known changes; the records, and what was done."""
    root = out / "self-test"
    if root.exists():
        shutil.rmtree(root)
    names = [n for n, r in base_records.items() if r["ok"]]
    records, done = {}, {}
    for name in names:
        dst = root / name
        shutil.copytree(base_records[name]["version"], dst)
        records[name] = base_records[name] | {"version": str(dst), "seconds": None}
    if names:  # 1: a manifest value changed (the first number found), a key added and one removed
        name = names[0]
        path = Path(records[name]["version"], "manifest.json")
        doc = json.loads(path.read_text())
        where = _bump_first_number(doc)
        doc["self_test_extra"] = True
        removed = sorted(doc)[0]
        del doc[removed]
        path.unlink()  # a copy of a hard link: write a new file
        path.write_text(json.dumps(dict(reversed(list(doc.items()))), indent=2) + "\n")  # key order changed too: ignored
        done[name] = f"manifest.json: {where} incremented, key self_test_extra added, key {removed} removed, key order reversed"
    if len(names) > 1:  # 2: one byte of model.pte flipped
        name = names[1]
        path = Path(records[name]["version"], "model.pte")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.unlink()
        path.write_bytes(bytes(data))
        done[name] = f"model.pte: the byte at offset {len(data) // 2} of {len(data)} XOR 0x01"
    if len(names) > 2:  # 3: another config's outputs in place of this one's
        name, other = names[2], names[1 if len(names) < 4 else 3]
        if name != other:
            shutil.rmtree(records[name]["version"])
            shutil.copytree(base_records[other]["version"], records[name]["version"])
            done[name] = f"replaced by config {other}'s outputs (a different config)"
    for name in names:
        records[name]["files"] = artifact_files(Path(records[name]["version"]))
    return records, done


def _bump_first_number(doc, path: str = "") -> str | None:
    if isinstance(doc, dict):
        items = sorted(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    else:
        return None
    for key, value in items:
        sub = f"{path}[{key}]" if isinstance(doc, list) else f"{path}.{key}" if path else str(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            doc[key] = value + 1
            return sub
        if (found := _bump_first_number(value, sub)) is not None:
            return found
    return None
