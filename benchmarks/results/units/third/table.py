import json, statistics, glob, sys
rows = []
for side in ("before", "after"):
    for backend in ("fsdp1", "fsdp2"):
        b_cpu, p_cpu, b_wall, p_wall, paired = [], [], [], [], []
        for f in sorted(glob.glob(f"benchmarks/results/units/third/{side}[0-9]*.json")):
            recs = json.load(open(f))["units"]["records"]
            by = {}
            for r in recs:
                if r["backend"] == backend and not r.get("error"):
                    by.setdefault(r["repeat"], {})[r["family"]] = r
            for rep, fam in by.items():
                if "builder" in fam and "baseline" in fam:
                    b, p = fam["builder"], fam["baseline"]
                    b_cpu.append(b["cpu_seconds"]); p_cpu.append(p["cpu_seconds"])
                    b_wall.append(b["seconds"]); p_wall.append(p["seconds"])
                    paired.append(b["cpu_seconds"] / p["cpu_seconds"])
        m = statistics.median
        q = statistics.quantiles(paired, n=4)
        rows.append(f"| {backend} | {side} | {len(paired)} | {m(b_wall):.2f} | {m(p_wall):.2f} | {m(b_cpu):.2f} | {m(p_cpu):.2f} | {m(b_cpu)/m(p_cpu):.2f} | {m(paired):.2f} | {q[0]:.2f}–{q[2]:.2f} |")
print("| backend | code | builds | builder wall s | plain wall s | builder CPU s | plain CPU s | CPU ratio of medians | median paired CPU ratio | paired ratio, middle half |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
print("\n".join(sorted(rows)))
