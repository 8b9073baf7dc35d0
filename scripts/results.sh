#!/usr/bin/env bash
# Run every headline command N times, in turns (round 1: each command once; round 2: each
# again; ...), and keep what each run measured under docs/results/NAME/:
#   run-K.json       the command's own JSON, as it wrote it
#   run-K.meta.json  the exact command, when it ran, how long it took, and the host
# then regenerate the tables in README.md and docs/*.md (scripts/docs_tables.py).
#
#   scripts/results.sh [-n N] [--only NAME,NAME] [--append] [--list]
#
# -n N      rounds (default 2: a figure reaches the README only once a second run has it)
# --only    run only these commands (names as in --list)
# --append  keep the runs already stored and number the new ones after them
#           (default: a command's stored runs are replaced by this call's)
# Runs take turns so that a slow stretch of a shared machine lands on one run of every
# command, not on every run of one. A run that writes no JSON keeps nothing and the script
# exits non-zero; a run that writes its JSON and exits 1 (one of its own checks failed, e.g.
# simulate --validate over a limit) is kept, with its exit status in the sidecar.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RESULTS=docs/results
LIMIT_S=${PLAIT_RESULTS_TIMEOUT_S:-1200}   # per run; a hung run is stopped, not waited for

# NAME|plait arguments[|VAR=VALUE …]. {json}: where the JSON goes; {out}: a report folder (the
# JSON is taken from {out}/demo.json); {round}: this round's run number of each command; the
# optional third field sets environment variables for that command alone.
COMMANDS=(
  "bench-collectives-quick|bench collectives --hosts 2 --link 1gbit --quick --no-progress --json {json}"
  "bench-ops-quick|bench ops --hosts 2 --link 1gbit --quick --no-progress --json {json}"
  # the same with gloo's comm threads left alone, and at SCHED_FIFO (the old default): the
  # default (auto: nice -10 where ranks fit the cores) is bench-ops-quick, run just before
  "comm-priority-off|bench ops --hosts 2 --link 1gbit --quick --no-progress --json {json}|PLAIT_COMM_PRIORITY=off"
  "comm-priority-rt|bench ops --hosts 2 --link 1gbit --quick --no-progress --json {json}|PLAIT_COMM_PRIORITY=rt"
  "bench-tp-quick|bench tp --hosts 2 --link 1gbit --quick --no-progress --json {json}"
  # width 128: a GPT whose all-reduces weigh against its compute (at 512 the two placements
  # are within the noise; the model predicts 1.28 x between them at 128)
  "bench-tp-dp|bench tp --dp 2 --tp 2 --hosts 2 --link 1gbit --quick --n-embd 128 --batch-size 16 --no-progress --json {json}"
  "bench-tp-hf-llama-quick|bench tp --model hf-llama --hosts 2 --link 1gbit --quick --no-progress --json {json}"
  "bench-hetero-quick|bench hetero --quick --ranks 2 --scenarios none,straggler-2x --policies even,semi --seeds 1 --no-progress --json {json}"
  # issue 22's command in full: 3 seeds, every policy, the spike beside the straggler
  "bench-hetero|bench hetero --quick --ranks 2 --scenarios none,straggler-2x,spike --policies even,resize,migrate,semi --seeds 3 --no-progress --json {json}"
  # the same straggler and spike made by the kernel: a host's CPU budget / F (issue 22)
  "bench-hetero-kernel|bench hetero --quick --hosts 2 --link 1gbit --slow-by kernel --scenarios none,straggler-2x,spike --policies even,resize,migrate,semi --seeds 3 --no-progress --json {json}"
  # 4 hosts of half a core each (4 ranks on 2 cores, each its fair share), the graded
  # slowdowns 4x, 2x, 1x, 1x; and the two scenario files (issue 22)
  "bench-hetero-graded|bench hetero --quick --hosts 4 --link 1gbit --host-cpu 0.5 --scenarios none,graded --policies even,migrate,semi --seeds 1 --no-progress --json {json}"
  "bench-hetero-graded-kernel|bench hetero --quick --hosts 4 --link 1gbit --host-cpu 0.5 --slow-by kernel --scenarios none,graded --policies even,migrate,semi --seeds 1 --no-progress --json {json}"
  "bench-hetero-drift|bench hetero --quick --ranks 2 --scenarios none --scenario-file examples/scenarios/drift.json --policies even,semi --seeds 3 --no-progress --json {json}"
  "bench-hetero-jitter|bench hetero --quick --ranks 2 --scenarios none --scenario-file examples/scenarios/jitter.json --policies even,semi --seeds 3 --no-progress --json {json}"
  # a straggler that moves from the last rank to rank 0 half-way (80 steps: two decisions'
  # worth each half), and two stragglers (2x, 1.5x) on 3 hosts of half a core each
  "bench-hetero-moving|bench hetero --quick --steps 80 --ranks 2 --scenarios none --scenario-file examples/scenarios/moving.json --policies even,migrate,semi --seeds 2 --no-progress --json {json}"
  "bench-hetero-two|bench hetero --quick --hosts 3 --link 1gbit --host-cpu 0.5 --scenarios none --scenario-file examples/scenarios/two-stragglers.json --policies even,migrate,semi --seeds 1 --no-progress --json {json}"
  # a real noisy neighbour (a busy loop) on the last host from step 20 on, 80 steps (issue 22)
  "bench-hetero-noisy|bench hetero --quick --steps 80 --hosts 2 --link 1gbit --scenarios none,noisy-neighbour --policies even,migrate,semi --seeds 3 --no-progress --json {json}"
  "demo|demo --no-progress --out {out}"
  "elastic-kill|elastic --hosts 3 --link 1gbit --steps 60 --kill-host 2@20 --checkpoint-every 5 --no-progress --json {json}"
  # ≥ 5 checkpoints of each kind, blocking and asynchronous taking turns (issue 25)
  "bench-checkpoint|bench checkpoint --hosts 2 --link 1gbit --checkpoints 5 --no-progress --json {json}"
  # a 2.1 GB Llama saved with save_pretrained, loaded whole and on 2 and 3 ranks (issue 37)
  "bench-load|bench load --size-gb 2 --no-progress --json {json}"
  # 2 ranks on one host: shared memory against gloo's loopback TCP, taking turns (issue 39)
  "bench-collectives-shm|bench collectives --ranks 2 --transport shm,gloo --quick --no-progress --json {json}"
  "bench-ops-shm|bench ops --ranks 2 --transport shm,gloo --quick --no-progress --json {json}"
  # decoding a transformers Llama 4 x 512 (8 heads over 4 KV heads) with its KV cache: 2 ranks
  # at batch 1 and 16, 3 ranks (uneven heads), and a host at half its CPU budget (issue 40)
  # against one process on both cores, eager and compiled (issue 49): a Llama 4 x 512, 8 heads
  # over 4 KV heads, vocabulary 2048; and two emulated hosts of one core each against one
  # such host alone, both compiled
  "bench-decode|bench decode --ranks 2 --batch-sizes 1,8 --vocab-size 2048 --compile --no-progress --json {json}"
  "bench-decode-hosts|bench decode --hosts 2 --link 10gbit --host-cpu 1,1 --batch-sizes 1,8 --vocab-size 2048 --systems plait,one-process --compile --no-progress --json {json}"
  "bench-tp-hf-llama-compile|bench tp --model hf-llama --hosts 2 --link 1gbit --quick --compile --no-progress --json {json}"
  "bench-decode-3|bench decode --ranks 3 --batch-sizes 1 --no-progress --json {json}"
  # 3 hosts, host 2 at half the others' CPU budget (a cgroup quota): the split by the speeds
  # measured at batch 64 against the even split and the capacity ideal, in one run
  "bench-decode-slow|bench decode --hosts 3 --link 10gbit --host-cpu 0.6 --slow-by kernel --slow 2:2 --split speed --n-embd 2048 --n-head 16 --n-kv-head 4 --batch-sizes 64 --new-tokens 12 --rounds 3 --systems plait --no-progress --json {json}"
  # MoE experts placed by routed load and rank speed, hot ones replicated, against even
  # blocks: 8 experts, top-2, skewed routing; 2 ranks, 2 ranks with rank 1 2x slow, 3 ranks
  # (issue 51)
  "bench-experts|bench experts --ranks 2 --no-progress --json {json}"
  "bench-experts-slow|bench experts --ranks 2 --slow 1:2 --no-progress --json {json}"
  "bench-experts-3|bench experts --ranks 3 --no-progress --json {json}"
  # what the cross-rank checks cost a decoding step when each is a gloo gather of its own
  "check-cost|bench decode --ranks 2 --batch-sizes 1 --systems plait,plait-gather-checks,one-process --no-progress --json {json}"
  # serving: 8 requests in turn, rank 1 turning 2 x slow from the fourth; the split kept
  # even, then moved between requests by the speeds measured
  "serve-even|generate --ranks 2 --requests each --split even --slow 1:2@3 --prompt-file examples/prompts.txt --max-new-tokens 48 --json {json}"
  "serve-adaptive|generate --ranks 2 --requests each --split adaptive --slow 1:2@3 --prompt-file examples/prompts.txt --max-new-tokens 48 --json {json}"
  "simulate-h100-16k|simulate --cluster h100-16k --model llama3-70b --json {json}"
  "simulate-validate|simulate --validate --measurements $RESULTS/bench-collectives-quick/run-{round}.json $RESULTS/bench-ops-quick/run-{round}.json --json {json}"
)

rounds=2 only="" append=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) rounds=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --append) append=1; shift ;;
    --list) for c in "${COMMANDS[@]}"; do echo "${c%%|*}: ./run.sh ${c#*|}"; done; exit 0 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "results.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

selected=()
for c in "${COMMANDS[@]}"; do
  name=${c%%|*}
  if [ -z "$only" ] || [[ ",$only," == *",$name,"* ]]; then selected+=("$c"); fi
done
[ ${#selected[@]} -gt 0 ] || { echo "results.sh: no command matches --only $only" >&2; exit 2; }

# Set up .venv as run.sh does, and read the host's facts once.
source scripts/env.sh
set +e   # env.sh sets -e; a failed run is reported and the others still run
PY=.venv/bin/python
host_json=$($PY - <<'EOF'
import json, os, platform, subprocess, sys
import torch
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None
cpu = None
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip(); break
except OSError:
    pass
try:
    import plait; plait_version = plait.__version__
except Exception:
    plait_version = None
print(json.dumps({
    "cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__,
    "python": platform.python_version(), "kernel": platform.release(),
    "plait": plait_version, "root": os.geteuid() == 0,
    "commit": sh("git", "rev-parse", "--short", "HEAD"),
    "dirty": bool(sh("git", "status", "--porcelain", "--untracked-files=no", "src")),
}))
EOF
)

declare -A base
for c in "${selected[@]}"; do
  name=${c%%|*}
  mkdir -p "$RESULTS/$name"
  if [ $append -eq 0 ]; then
    rm -f "$RESULTS/$name"/run-*.json
    base[$name]=0
  else
    base[$name]=$(find "$RESULTS/$name" -name 'run-*.meta.json' | wc -l)
  fi
done

failed=0
for r in $(seq 1 "$rounds"); do
  for c in "${selected[@]}"; do
    name=${c%%|*}
    k=$(( ${base[$name]} + r ))
    json="$RESULTS/$name/run-$k.json"
    out="reports/results/$name/run-$k"
    args=${c#*|}
    envs=""
    if [[ "$args" == *"|"* ]]; then envs=${args#*|}; args=${args%%|*}; fi
    args=${args//\{json\}/$json}
    args=${args//\{out\}/$out}
    args=${args//\{round\}/$k}
    log="reports/results/$name/run-$k.log"
    mkdir -p "reports/results/$name"
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    echo "[round $r] $name: ./run.sh $args"
    t0=$(date +%s%N)
    # shellcheck disable=SC2086  # the arguments are meant to split on spaces
    # shellcheck disable=SC2086
    timeout --signal=TERM --kill-after=30 "$LIMIT_S" env $envs ./run.sh $args >"$log" 2>&1
    rc=$?
    wall_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    if [ $rc -eq 0 ] && [[ "$c" == *"{out}"* ]]; then
      cp "$out/demo.json" "$json" 2>/dev/null || rc=1
    fi
    if [ ! -s "$json" ] || { [ $rc -ne 0 ] && [ $rc -ne 1 ]; }; then
      echo "  FAILED (exit $rc, $(( wall_ms / 1000 )) s): see $log" >&2
      rm -f "$json"
      failed=1
      continue
    fi
    # exit 1 with its JSON written: the command ran and one of its own checks failed (e.g.
    # simulate --validate over its limit); the run is kept and its tables say so.
    [ $rc -eq 1 ] && echo "  exit 1: a check in its output failed; its JSON is kept (see $log)" >&2
    json_from=None
    [[ "$c" == *"{out}"* ]] && json_from="\"$out/demo.json\""
    $PY - "$RESULTS/$name/run-$k.meta.json" <<EOF
import json, sys
meta = {"name": "$name", "run": $k, "command": "${envs:+$envs }./run.sh $args", "exit": $rc, "json_from": $json_from,
        "started": "$started", "wall_s": round($wall_ms / 1000, 1), "loadavg_before": "$load",
        "host": json.loads(r'''$host_json''')}
with open(sys.argv[1], "w") as f:
    json.dump(meta, f, indent=1)
    f.write("\n")
EOF
    echo "  done in $(( wall_ms / 1000 )) s"
  done
done

$PY scripts/docs_tables.py || failed=1
exit $failed
