#!/usr/bin/env bash
# One device call: a search over a shape suite, then `bench` on it (logs, the run store and the tuning database land
# in $OUT). Each family's first PREBUILD settings a shape (default 8; 0: none) are compiled before the run.
# The run is a default one (profiles off unless RUN_ARGS has --profile); after bench, tools/honest_gap.py on the run.
# Usage on the GPU machine: [LAYOUT=nk] [PREBUILD=8] [RUN_ARGS=--no-db] bash tools/gpu_devsuite.sh SHAPES_FILE
#   BUDGET_MINUTES MAX_CANDIDATES      (RUN_ARGS: more options of `agent run`; --no-db: the run without the learner,
#   --profile: Nsight Compute on each shape's leaders)
. tools/gpu_env.sh
export HGEMM_AGENT_CACHE=$PWD/.cache/cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HGEMM_AGENT_TUNING_DB=${HGEMM_AGENT_TUNING_DB:-$OUT/tuning.sqlite}
L=${LAYOUT:-kn}; T0=$(date +%s)
if [ "${PREBUILD:-8}" != 0 ]; then  # PREBUILD=0: nothing compiled before the run, as a user's first run
  timeout 150 python3 tools/prebuild.py "$1" --b-layout "$L" --top "${PREBUILD:-8}" --jobs "$(nproc)" \
    --cache "$HGEMM_AGENT_CACHE" > "$OUT/devsuite_${L}_prebuild.log" 2>&1
  echo "prebuild rc=$? $(( $(date +%s) - T0 )) s: $(tail -1 "$OUT/devsuite_${L}_prebuild.log")"
fi
timeout $(( ${2%.*} * 60 + 150 )) python3 -m agent run --shapes "$1" --budget-minutes "$2" --max-candidates "$3" \
  --b-layout "$L" ${RUN_ARGS:-} > "$OUT/devsuite_${L}_run.log" 2>&1
echo "run rc=$? $(( $(date +%s) - T0 )) s"; R=$(ls -t runs | grep -v gitkeep | head -1)
timeout ${BENCH_TIMEOUT:-200} python3 -m agent bench "$R" > "$OUT/devsuite_${L}_bench.log" 2>&1; echo "bench rc=$? $(( $(date +%s) - T0 )) s"
# the run store gzipped: a 48-shape run's is more than a file the device call brings back (16 MiB)
gzip -c "runs/$R/run.sqlite" > "$OUT/devsuite_${L}.sqlite.gz"; cp "runs/$R/bench/bench.json" "$OUT/devsuite_${L}_bench.json"
case " ${RUN_ARGS:-} " in *" --no-db "*)  # the run kept no tuning rows: import its results for the analyses
  python3 -m agent db --db "$OUT/tuning.sqlite" --import "$R" > /dev/null ;; esac
python3 - "runs/$R/run.sqlite" <<'PY'
import json, sqlite3, sys
rows = [json.loads(r[0]) for r in sqlite3.connect(sys.argv[1]).execute("SELECT record FROM results")]
bad = [r for r in rows if r["status"] in ("wrong", "fault", "timeout")]
print(f"{len(rows)} results: {sum(r['status'] == 'ok' for r in rows)} ok, {len(bad)} rejected, "
      f"{sum(bool(r.get('fresh')) for r in rows)} re-checked on fresh inputs")
for r in bad:
    print("REJECTED", r["candidate_id"], r["status"], r["reason"][:200])
# where the run's time went: the GPU's evaluations (each measurement's own wall time; a store without them: the
# candidate's first) against the span
db = sqlite3.connect(sys.argv[1])
wall = {cid: json.loads(rec).get("wall_s", 0.0) for cid, rec in db.execute("SELECT candidate_id, record FROM results")}
walls = [(cid, w) for cid, w in db.execute("SELECT candidate_id, wall_s FROM measurements")] if "wall_s" in {
    row[1] for row in db.execute("PRAGMA table_info(measurements)")} else [(cid, None) for (cid,) in db.execute(
    "SELECT candidate_id FROM measurements")]
extra = sum(wall.get(cid, 0.0) if w is None else w for cid, w in walls) - sum(
    wall[cid] for (cid,) in db.execute("SELECT candidate_id FROM results WHERE status = 'ok'"))
t0 = db.execute("SELECT MIN(created) FROM candidates").fetchone()[0] or 0
t1 = max(db.execute("SELECT MAX(created) FROM results").fetchone()[0] or 0, db.execute(
    "SELECT MAX(created) FROM measurements").fetchone()[0] or 0)
if not wall or t1 <= t0:
    sys.exit()
busy = sum(wall.values()) + max(extra, 0.0)
cached = db.execute("SELECT SUM(cached), COUNT(*), SUM(CASE WHEN cached THEN 0 ELSE compile_s END) FROM builds").fetchone()
fam = dict(db.execute("SELECT family, COUNT(*) FROM candidates GROUP BY family").fetchall())
firsts = [wall[cid] for (cid,) in db.execute("SELECT id FROM candidates c WHERE seq = (SELECT MIN(seq) FROM candidates "
                                             "WHERE problem_key = c.problem_key)") if cid in wall]
print(f"GPU busy {busy:.0f} s of {t1 - t0:.0f} s ({busy / (t1 - t0):.0%}); evaluations median "
      f"{sorted(wall.values())[len(wall) // 2]:.2f} s, each shape's first {sum(firsts) / max(1, len(firsts)):.2f} s "
      f"on average; builds {cached[0]} of {cached[1]} from the cache, the rest {cached[2] or 0:.0f} s of NVRTC; "
      f"candidates by family {fam}")
again = sorted(w for (w,) in db.execute("SELECT wall_s FROM measurements WHERE honest = 1 AND wall_s > 0")) if any(
    w is not None for _, w in walls) else []
if again:  # a re-measurement times the honest mode alone
    print(f"re-measurements: {len(again)}, median {again[len(again) // 2]:.2f} s each")
per = [n for (_, n) in db.execute("SELECT p.key, COUNT(c.id) FROM problems p LEFT JOIN candidates c "
                                  "ON c.problem_key = p.key GROUP BY p.key")]
print(f"shapes searched {sum(n > 0 for n in per)} of {len(per)}; candidates a shape min {min(per)}, median "
      f"{sorted(per)[len(per) // 2]}, {sum(n < 12 for n in per)} shapes under 12; "
      f"{db.execute('SELECT COUNT(*) FROM profiles').fetchone()[0]} profiles")
cut = [m for (m,) in db.execute("SELECT message FROM events WHERE kind = 'budget' ORDER BY ts")]
if cut:  # shapes that stopped proposing short of the candidates, on time
    print(f"{len(cut)} shapes cut short by their time share: " + "; ".join(cut[:6]) + ("; ..." if len(cut) > 6 else ""))
PY
python3 tools/honest_gap.py "runs/$R" --markdown > "$OUT/devsuite_${L}_gap.md"; head -12 "$OUT/devsuite_${L}_gap.md"
python3 tools/class_table.py "runs/$R/bench/bench.json" "$HGEMM_AGENT_TUNING_DB" --run "$R" --markdown
tail -42 "$OUT/devsuite_${L}_bench.log"
