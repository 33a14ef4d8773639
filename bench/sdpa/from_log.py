"""The report of a GPU bench run rebuilt from its log (the lines it prints per row and per
sweep variant), for a run that was stopped before it wrote its report:

    python -m bench.sdpa.from_log BENCH.LOG --cmd "the command that ran" --date "YYYY-MM-DD HH:MM" --out PATH

Only what the log holds: rows, sweep lines, numerics, the machine's ceilings."""

import argparse
import re

from . import report

ROW = re.compile(r"^\[\s*([\d.]+)s\] (.+?): KV ([\d.]+) GB  ours (\S+) us \(\+ plan (\S+) us per step\)"
                 r"(?: prev (\S+) us)?  ([\d.]+) TB/s  ([\d.]+) TFLOP/s \| (.*)  \([\d.]+s\)$")
PEER = re.compile(r"(sdpa|varlen|flex|et)=([^\s(]+)(?:\(([^)]*)\))?")
SWEEP = re.compile(r"^sweep (.+?) (\{.*?\}): sum of ratios (\S+) \| (.*)$")
NUM = re.compile(r"^  \('(.+)', ([\d.e-]+), ([\d.e-]+)\)$")


def _num(x):
    return None if x in ("—", None) else float(x.replace(",", ""))


def parse(text):
    rows, sweep, num, head = [], [], [], {}
    for line in text.splitlines():
        if m := ROW.match(line):
            _, name, kv, ours, plan, prev, tbs, tf, peers = m.groups()
            found = {p: (_num(v), note or "") for p, v, note in PEER.findall(peers)}
            rows.append(dict(name=name, kv=float(kv), ours=_num(ours), plan=_num(plan), prev=_num(prev),
                             tbs=float(tbs), tf=float(tf), peers=found))
        elif m := SWEEP.match(line):
            group, var, tot, cases = m.groups()
            sweep.append(f"| {group} `{var}` | {float(tot):.3f} | " + cases.replace(" | ", "; ") + " |")
        elif m := NUM.match(line):
            num.append((m.group(1), float(m.group(2)), float(m.group(3))))
        elif line.startswith("GPU "):
            head["gpu"] = line
        elif line.startswith("read bandwidth"):
            head["read"], head["mm"] = (float(x) for x in re.findall(r": ([\d.]+) T", line))
        elif line.startswith("fastest on the sweep cases: Tuning("):
            head["chosen"], head["defaults"] = line.split(": ", 1)[1].split("; defaults: ")
        elif "cases; ours timed with Tuning(" in line:
            head["table"] = line.split("ours timed with ", 1)[1]
    return rows, sweep, num, head


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--cmd", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    rows, sweep, num, head = parse(open(args.log).read())

    class Prop:  # the name line is replaced below by the log's own
        name, multi_processor_count = "?", 0

    # the Tuning values as the log printed them: a log of an earlier version names fields ours may not have
    sweep_result = (head.get("chosen", "?"), head.get("defaults", "?"), sweep) if sweep else None
    text = report.markdown(cmd=args.cmd, prop=Prop, read_tbs=head["read"], mm_tf=head["mm"], rows=rows, num=num,
                           compare=None, sweep=sweep_result, table_tuning=head.get("table", "?"),
                           profile=[], skipped=[], budget_s=0, wall_s=0, final=True)
    lines = text.splitlines()
    lines = [ln for ln in lines if not ln.startswith("Total bench wall time")]
    for i, ln in enumerate(lines):
        if ln.startswith("- date:"):
            lines[i] = f"- date: {args.date} UTC"
        elif ln.startswith("- GPU:"):
            lines[i] = "- GPU: " + head["gpu"][4:]
        elif ln.startswith("- varlen:") and any("KV heads repeated" in r["peers"].get("varlen", (0, ""))[1] for r in rows):
            lines[i] = ("- varlen: torch.nn.attention.varlen.varlen_attn on packed contiguous K/V with KV heads repeated "
                        "(no enable_gqa in that torch); packing not timed")
    lines.insert(3, f"- rebuilt from the run's log by `python -m bench.sdpa.from_log` ({args.note})")
    open(args.out, "w").write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}: {len(rows)} rows, {len(sweep)} sweep lines, {len(num)} numerics")


if __name__ == "__main__":
    main()
